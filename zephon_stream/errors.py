"""The error tree of zephon-stream.

```
ZephonError
├── ConfigError                 a setting is invalid or cannot keep a guarantee
├── ConnectorError              an object store refused or failed a request
│   ├── ObjectNotFound          NoSuchKey / missing file
│   │   └── BucketNotFound      NoSuchBucket: the bucket name, endpoint or region is wrong
│   ├── AccessDenied            AccessDenied / InvalidAccessKeyId / key escapes the root
│   ├── AlreadyExists           a conditional put lost: the object is there
│   └── Throttled               SlowDown / 503 after every retry
├── DataError                   malformed record or shard: names object and offset
├── CheckpointError             a state cannot be decoded
│   └── IncompatibleState       a state from other data or an incompatible config
└── RefitError
    ├── DigestMismatch
    └── BaseVersionMismatch
```

Every message says what was wrong, the offending value, and what to do.
"""

from __future__ import annotations

import difflib
import re
import typing
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import msgspec

__all__ = [
    "AccessDenied", "AlreadyExists", "BaseVersionMismatch", "BucketNotFound", "CheckpointError", "ConfigError",
    "ConnectorError", "DataError", "DecodeWorkerError", "DigestMismatch", "IncompatibleState", "ObjectNotFound",
    "RefitError",
    "Throttled", "ZephonError", "closest_key", "in_source", "root_error", "unwrap_groups",
]


class ZephonError(Exception):
    """Base of every error raised by zephon-stream."""


class ConfigError(ZephonError, ValueError):
    """A configuration value is invalid, or the request cannot keep the determinism guarantee."""


class ConnectorError(ZephonError):
    """An object store failed a request."""


class ObjectNotFound(ConnectorError):
    """The object (or bucket) does not exist."""


class BucketNotFound(ObjectNotFound):
    """The bucket does not exist: a setting (bucket name, endpoint, region) is wrong, and retrying
    cannot mend it; a missing object or prefix may still appear (a publisher's first version)."""


class AccessDenied(ConnectorError):
    """The store refused access, or a key would escape the store's root."""


class AlreadyExists(ConnectorError):
    """A conditional put found the object already there."""


class Throttled(ConnectorError):
    """The store kept throttling after every retry."""


class DataError(ZephonError):
    """A record or shard is malformed. The message names the object and the offset."""

    def __init__(self, message: str, *, key: str = "", offset: int = -1) -> None:
        super().__init__(message)
        self.key = key
        self.offset = offset

    def of_source(self, name: str, uri: str) -> DataError:
        """This error with its source named first (`zephon shard` names every output
        `shard-00000.jsonl.zst`: two sources' shards can share a name), or itself if it names it."""
        if str(self).startswith(f"source {name!r}"):
            return self
        return DataError(f"source {name!r} ({uri}): {self}", key=self.key, offset=self.offset)


@contextmanager
def in_source(name: str, uri: str) -> Iterator[None]:
    """A DataError raised in the block names source `name` first (`DataError.of_source`)."""
    try:
        yield
    except DataError as exc:
        err = exc.of_source(name, uri)
        if err is exc:
            raise
        raise err from exc


class DecodeWorkerError(ZephonError, RuntimeError):
    """An image decode worker process (`vision.decode_processes`) could not start, or died and so
    did the one that took its call again."""


class CheckpointError(ZephonError):
    """A checkpoint cannot be decoded or applied."""


class IncompatibleState(CheckpointError):
    """A checkpoint was written for other data or an incompatible configuration."""


class RefitError(ZephonError):
    """A weight refit cannot proceed."""


class DigestMismatch(RefitError):
    """Bytes did not hash to the digest recorded for them."""


class BaseVersionMismatch(RefitError):
    """A delta was made against a version other than the one held."""


def root_error(exc: BaseException) -> BaseException:
    """The error that matters in a (nested) task-group failure; any other exception as it is.

    Cancellations are dropped (they are the other tasks being stopped). Of the rest the first
    `ZephonError` wins, else the first error; every other distinct failure is added to it as a
    note, so nothing is hidden. A failure of the same type and message as the one raised (two
    workers that stopped for the same reason) is not another failure and adds no note, nor does
    a stream found closed or broken beside another failure: that is the failure's consequence (a
    task that fails has its streams closed under the tasks reading them). A group of
    cancellations alone stays a group.
    """
    if not isinstance(exc, BaseExceptionGroup):
        return exc
    import asyncio  # (here, not at the top: a decode worker imports this module, and asyncio is 40 ms)

    aftermath = _aftermath()
    leaves = _leaves(exc)
    real = [e for e in leaves if not isinstance(e, asyncio.CancelledError)]
    if not real:
        return exc
    causes = [e for e in real if not isinstance(e, aftermath)]
    first = next((e for e in real if isinstance(e, ZephonError)), (causes or real)[0])
    for other in real:
        if other is first or (type(other), str(other)) == (type(first), str(first)) or isinstance(other, aftermath):
            continue
        note = f"another task failed too: {type(other).__name__}: {other}"
        if note not in getattr(first, "__notes__", ()):
            first.add_note(note)
    return first


@contextmanager
def unwrap_groups() -> Iterator[None]:
    """Raise a task group's failure as its `root_error`, not as a group (a KeyboardInterrupt or
    SystemExit among the leaves keeps the group, so it is never swallowed)."""
    try:
        yield
    except BaseExceptionGroup as group:
        err = root_error(group)
        if err is group or not isinstance(err, Exception):
            raise
        raise err from err.__cause__  # its own cause, not the group it came in


def _aftermath() -> tuple[type[BaseException], ...]:
    """A stream that another task's failure closed or broke under the task using it."""
    import anyio

    return anyio.ClosedResourceError, anyio.BrokenResourceError


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for e in exc.exceptions for leaf in _leaves(e)]
    return [exc]


_UNKNOWN = re.compile(r"unknown field `([^`]*)`(?: - at `\$([^`]*)`)?")


def closest_key(message: str, tables: Mapping[str, type]) -> str:
    """'; did you mean `x`?' for msgspec's unknown-field error in `message`, from the keys of the
    table it names: `tables` maps a table's name in the error's path ("" for the top level,
    "sources" for `$.sources[0]`) to its Struct. A top-level key found inside a table (written
    below a TOML table header) is said to be one. Empty when nothing is close. For a value not
    among a setting's choices, the choices (and the closest); for a `[table]` where `[[table]]`
    (an array of tables) belongs, that."""
    m = _UNKNOWN.search(message)
    if m is None:
        return _value_hint(message, tables)
    def keys(name: str) -> list[str]:
        table = tables.get(name)
        return [f.encode_name for f in msgspec.structs.fields(table)] if table is not None else []

    key, where = m.group(1), re.sub(r"\[\d+\]", "", m.group(2) or "").rsplit(".", 1)[-1]
    close = difflib.get_close_matches(key, keys(where), n=1, cutoff=0.7)
    if close:
        return f"; did you mean `{close[0]}`?"
    top = difflib.get_close_matches(key, keys(""), n=1, cutoff=0.7) if where else []
    if top:  # TOML puts a key written below a [table] header in that table
        said = f"`{key}` is" if top[0] == key else f"did you mean `{top[0]}`? It is"
        return f"; {said} a top-level key: put it above the first [table]"
    return ""


_ENUM = re.compile(r"Invalid enum value '([^']*)' - at `\$([^`]*)`")
_NOT_ARRAY = re.compile(r"Expected `array`, got `object` - at `\$\.?([^`]*)`")


def _value_hint(message: str, tables: Mapping[str, type]) -> str:
    if m := _NOT_ARRAY.search(message):
        table = re.sub(r"\[\d+\]", "", m.group(1))
        return f"; write [[{table}]] (an array of tables, one per entry), not [{table}]" if table else ""
    m = _ENUM.search(message)
    if m is None:
        return ""
    path = re.sub(r"\[\d+\]", "", m.group(2)).lstrip(".").split(".")
    table = tables.get(path[-2] if len(path) > 1 else "")
    field = next((f for f in msgspec.structs.fields(table) if f.encode_name == path[-1]), None) if table else None
    choices = [str(v) for v in typing.get_args(field.type) if isinstance(v, str)] if field is not None else []
    if not choices:  # Optional[Literal[...]]: the Literal inside
        choices = [str(v) for arg in typing.get_args(field.type) for v in typing.get_args(arg)
                   if isinstance(v, str)] if field is not None else []
    if not choices:
        return ""
    close = difflib.get_close_matches(m.group(1), choices, n=1, cutoff=0.6)
    return (f"; {path[-1]} is one of " + ", ".join(f'"{c}"' for c in choices)
            + (f' (did you mean "{close[0]}"?)' if close else ""))
