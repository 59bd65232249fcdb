"""User transforms and filters: `map` and `filter` steps on a source's records, before tokenizing.

A step names a function by import path, in the config or from Python:

```
[[sources.transforms]]                      loader = Loader(cfg, transforms={
map = "mypkg.clean:strip_boilerplate"           "web": [Map(strip_boilerplate), Filter(is_english)]})
[[sources.transforms]]
filter = "mypkg.clean:is_english"
```

Per record, `Records.payload` runs the source's steps in order, then takes the payload: the
`text_field` string, or for a chat source the raw `messages_field` value. A map replaces the
record with what it returns; a filter that returns False drops it (counted per source and
epoch, in `Loader.statistics().filtered_records`).

The contract (what keeps determinism, checkpoints and exactly-once):

- A step is a pure function of the record: the same record gives the same result on every
  backend, in every process, on every run. It keeps no state between calls, and draws no
  randomness except from its `seed` keyword argument, if it declares one: a 64-bit int, a pure
  function of (config seed, source, epoch, the record's split and offset), so a record gets the
  same seed on every backend and world size and after a resume, and a new one each epoch.
- A map returns a dict (the new record; it may be the argument, changed); a filter returns a
  bool (a NumPy bool too). Anything else, or an exception from the function, is a `DataError` naming the function,
  the shard and the record's offset. It is raised whatever `on_bad_record` says: it is a bug in
  the function, not bad data. A record whose payload field is missing or of the wrong type
  after the steps is a bad record (raised, or skipped and counted with `on_bad_record = "skip"`).
- It is module-level and importable by name in every process: worker processes (`processes`)
  and Ray actors (`ray`) import it by its path. A function passed from Python is turned into
  its path (`"module:qualname"`) before anything starts; a lambda, a function defined inside
  another function, a bound method or a callable object is refused (`ConfigError`). A function
  in the script run as `__main__` works with every backend but `ray` (actors do not import the
  driver's script).

Order: a step's path is part of the order digest (`Config.order_settings`), so a checkpoint
refuses to resume under other steps. Only the path is: editing a function's body in place is
not noticed; give the changed function a new name (or version the module) to start fresh.

Image+text sources take no transforms (`ConfigError`): their records are images and captions,
not JSON records.

Parquet sources: the record is the row, a dict of every column (a source with transforms fetches
them all, where one without fetches only its text column); a dotted `text_field` ("doc.body")
is also under its dotted name.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import msgspec
import numpy as np

from zephon_stream.engine.rng import mix64
from zephon_stream.errors import ConfigError, DataError
from zephon_stream.loader.config import Config, SourceConfig, TransformStep
from zephon_stream.operators.types import Conversation, field

__all__ = ["Filter", "Map", "Records", "Step", "Transform", "check_transforms", "import_path", "record_seed",
           "resolve", "with_transforms"]

_SEED_TAG = 0x5452414E  # keys the per-record seeds of transforms ("TRAN")


class Transform:
    """A step passed from Python: `Map(fn)` or `Filter(fn)`. `fn` must be importable by name
    (see the module docstring); its import path is checked here, before anything starts."""

    kind = ""

    def __init__(self, fn: Callable[..., Any]) -> None:
        if not self.kind:
            raise TypeError("Transform is the base of Map and Filter: use one of those")
        self.fn, self.path = fn, import_path(fn)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.path!r})"

    def step(self) -> TransformStep:
        """The config step this is: the function's import path."""
        return TransformStep(**{self.kind: self.path})


class Map(Transform):
    """A step that replaces each record with `fn(record)` (a dict)."""

    kind = "map"


class Filter(Transform):
    """A step that keeps a record where `fn(record)` is True and drops it where False."""

    kind = "filter"


def import_path(fn: Callable[..., Any]) -> str:
    """`"module:qualname"` of a module-level function, checked to import back to `fn` itself."""
    name = getattr(fn, "__qualname__", None)
    module = getattr(fn, "__module__", None)
    if not callable(fn) or not isinstance(name, str) or not isinstance(module, str) or inspect.ismethod(fn):
        raise ConfigError(f"transform {fn!r} is not a module-level function: worker processes and Ray actors "
                          "import a transform by its name; define it with `def` at the top level of a module")
    if "<lambda>" in name or "<locals>" in name:
        what = "a lambda" if "<lambda>" in name else "defined inside a function"
        raise ConfigError(f"transform {module}.{name} is {what}: worker processes and Ray actors import a "
                          "transform by its name, so it must be a `def` at the top level of a module")
    path = f"{module}:{name}"
    try:
        found = _lookup(path)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"transform {path}: {exc}; define it at the top level of an importable module") from None
    if found is not fn:
        raise ConfigError(f"transform {path}: that name holds {found!r}, not the function given (was it "
                          "redefined or decorated?); pass the object the module holds under that name")
    return path


def resolve(source: str, path: str) -> Callable[..., Any]:
    """The function at import `path` ("pkg.module:function") for `source`'s transforms, or a
    ConfigError naming the source, the path and what failed."""
    try:
        fn = _lookup(path)
    except ModuleNotFoundError as exc:
        raise ConfigError(f"source {source!r} transform {path!r}: no module {exc.name!r} "
                          f"({exc}); check the path, and that the module is importable in every process "
                          "(installed, or on PYTHONPATH)") from None
    except AttributeError as exc:
        raise ConfigError(f"source {source!r} transform {path!r}: {exc}; name a function defined at the "
                          "top level of the module") from None
    except Exception as exc:  # the module itself failed while importing: say so, with its error
        raise ConfigError(f"source {source!r} transform {path!r}: importing the module raised "
                          f"{type(exc).__name__}: {exc}") from exc
    if not callable(fn):
        raise ConfigError(f"source {source!r} transform {path!r} is {type(fn).__name__} {fn!r}, not callable: "
                          "name a function")
    if inspect.iscoroutinefunction(fn) or inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
        raise ConfigError(f"source {source!r} transform {path!r} is an async or generator function: a step "
                          "returns its result directly (a dict for a map, a bool for a filter)")
    return fn


@functools.cache
def _lookup(path: str) -> Any:
    """The object at `path`: import the module, then follow the dotted attribute names."""
    module, _, name = path.partition(":")
    obj: Any = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def _takes_seed(fn: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # some builtins have no signature: they take no seed
        return False
    seed = params.get("seed")
    return seed is not None and seed.kind in (seed.POSITIONAL_OR_KEYWORD, seed.KEYWORD_ONLY)


def record_seed(seed: int, source: int, epoch: int, shard: int, split_start: int, offset: int) -> int:
    """The seed a transform gets for one record: a pure function of the config seed, the source,
    the epoch and the record's place (its split's shard and start, and its offset in the split)."""
    return mix64(seed, _SEED_TAG, source, epoch, shard, split_start, offset)


class Step(NamedTuple):
    """One resolved step: its path (for messages), the function, and what it is."""

    path: str
    fn: Callable[..., Any]
    is_filter: bool
    seeded: bool  # the function declares a `seed` keyword


def _steps(src: SourceConfig) -> list[Step]:
    steps = []
    for t in src.transforms:
        path = t.map or t.filter or ""
        fn = resolve(src.name, path)
        steps.append(Step(path, fn, t.filter is not None, _takes_seed(fn)))
    return steps


def check_transforms(config: Config) -> None:
    """Resolve every source's transforms (a ConfigError for a bad path), before anything starts,
    and refuse them on image+text sources."""
    for src in config.sources:
        if src.transforms and src.image_field is not None:
            raise ConfigError(f"config sources[{src.name}].transforms: image+text sources take no transforms "
                              "(their records are an image and a caption); remove them, or transform the captions "
                              "when writing the shards")
        _steps(src)
        _check_main(src, config.backend)


def _check_main(src: SourceConfig, backend: str) -> None:
    """A function of `__main__` imports in spawned worker processes only when `__main__` is a script
    file (they run it again as `__mp_main__`), and never in Ray actors."""
    main = [p for t in src.transforms if (p := t.map or t.filter or "").startswith("__main__:")]
    if not main or backend in ("inline", "threads"):
        return
    if backend == "ray" or not _main_has_file():
        where = "Ray actors do not import the driver's script" if backend == "ray" else (
            "__main__ is not a script file here (an interactive session or notebook), so worker processes "
            "cannot import it")
        raise ConfigError(f"source {src.name!r} transform {main[0]!r} is defined in __main__: {where}; move it "
                          "into a module (a .py file beside the script), or use backend \"threads\"")


def with_transforms(config: Config, transforms: Mapping[str, Sequence[Transform]] | None) -> Config:
    """`config` with the steps passed from Python appended to each named source's `transforms`."""
    if not transforms:
        return config
    names = [s.name for s in config.sources]
    unknown = [k for k in transforms if k not in names]
    if unknown:
        raise ConfigError(f"transforms for {unknown}: no such source; the sources are {names}")
    sources = []
    for src in config.sources:
        given = transforms.get(src.name, ())
        steps = [given] if isinstance(given, Transform) else list(given)
        bad = [s for s in steps if not isinstance(s, Transform)]
        if bad:
            raise ConfigError(f"transforms[{src.name!r}] holds {bad[0]!r}: wrap each function as Map(fn) or "
                              "Filter(fn) (from zephon_stream.operators.transforms)")
        sources.append(src if not steps else
                       _replace(src, transforms=[*src.transforms, *(s.step() for s in steps)]))
    return config.replace(sources=sources)


def _replace(src: SourceConfig, **changes: Any) -> SourceConfig:
    return msgspec.structs.replace(src, **changes)


class Records:
    """record -> payload for one source: its transforms in order, then its payload field.

    `plain` is True when there is nothing to do but take a text field: parsers then keep their
    fast path, which decodes that field alone.
    """

    def __init__(self, src: SourceConfig, source: int = 0, seed: int = 0) -> None:
        """The records of `src`, source number `source` of a config whose seed is `seed`."""
        self.name, self.source, self.seed = src.name, source, seed
        self.steps = _steps(src)
        self.chat = src.messages_field is not None
        self.field = src.messages_field if src.messages_field is not None else src.text_field
        self.tools = src.tools_field  # a chat source's tools and documents: the payload is then a Conversation
        self.documents = src.documents_field
        self.seeded = any(s.seeded for s in self.steps)
        self.plain = not self.steps and not self.chat

    def __repr__(self) -> str:
        return f"Records({self.name!r}, steps={[s.path for s in self.steps]}, field={self.field!r})"

    def payload(self, record: Any, reader: Any, pos: int) -> Any:
        """The payload of `record` (read by `reader` at offset `pos`), or None if a filter dropped
        it (counted) or it is a bad record that the reader's policy skipped (counted)."""
        seed = record_seed(self.seed, self.source, reader.bad.epoch, reader.split.shard, reader.split.start,
                           pos) if self.seeded else 0
        for step in self.steps:
            out = self._call(step, record, seed, reader, pos)
            if not step.is_filter:
                record = out
            elif not out:
                reader.bad.filtered()
                return None
        return self._field(record, reader, pos)

    def _call(self, step: Step, record: Any, seed: int, reader: Any, pos: int) -> Any:
        try:
            out = step.fn(record, seed=seed) if step.seeded else step.fn(record)
        except Exception as exc:
            raise self._error(step, reader, pos, f"raised {type(exc).__name__}: {exc}") from exc
        if step.is_filter and not isinstance(out, (bool, np.bool_)):
            raise self._error(step, reader, pos, f"returned {_shown(out)}, not a bool: a filter returns True to "
                                                 "keep the record, False to drop it")
        if not step.is_filter and not isinstance(out, dict):
            raise self._error(step, reader, pos, f"returned {_shown(out)}, not a dict: a map returns the new "
                                                 "record")
        return out

    def _error(self, step: Step, reader: Any, pos: int, what: str) -> DataError:
        kind = "filter" if step.is_filter else "map"
        return DataError(f"source {self.name!r} {kind} {step.path!r} {what} (record at {reader.where(pos)} of "
                         f"{reader.key!r}); fix the function: this is raised whatever on_bad_record says",
                         key=reader.key, offset=pos)

    def _field(self, record: Any, reader: Any, pos: int) -> Any:
        """The payload field of the transformed record; a bad record if it is missing or not a string
        (chat: missing or null; the chat renderer checks the rest)."""
        value = field(record, self.field)
        if value is None or (not self.chat and not isinstance(value, str)):
            what = "has no field" if value is None else f"has {type(value).__name__} {_shown(value)} in field"
            hint = "" if reader.bad.skipping else ' (set on_bad_record = "skip" to skip such records)'
            after = " after its transforms" if self.steps else ""
            fields = ""
            if value is None and isinstance(record, dict):  # the setting names another field: say which there are
                shown = ", ".join(repr(str(k)) for k in list(record)[:8]) + (", ..." if len(record) > 8 else "")
                fields = f"; the record's fields are {shown or 'none'}"
            reader.bad(DataError(f"bad record in {reader.key!r} at {reader.where(pos)}: the record{after} {what} "
                                 f"{self.field!r}{' (a string)' if not self.chat else ''}{fields}{hint}",
                                 key=reader.key, offset=pos))
            return None
        return self.conversation(record, value)

    def conversation(self, record: Any, messages: Any) -> Any:
        """A chat record's payload: its `messages`, or with the source's tools or documents field a
        Conversation of the three (a field the record lacks is None)."""
        if self.tools is None and self.documents is None:
            return messages
        return Conversation(messages, None if self.tools is None else field(record, self.tools),
                            None if self.documents is None else field(record, self.documents))


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _main_has_file() -> bool:
    return getattr(sys.modules.get("__main__"), "__file__", None) is not None
