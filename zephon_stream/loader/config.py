"""The configuration tree: one msgspec Struct, loadable from TOML and printed back in full.

Settings split in two groups. *Order* settings (seed, lanes, sources, tokenizer, sequence
packing, shuffle, split size, global batch size) define the sample sequence; they go into
`order_digest()` and a checkpoint refuses to load under different ones. *Execution* settings
(backend, workers, every buffer capacity, read-ahead, tokenizer batch) only decide how fast
the same sequence is produced.
"""

from __future__ import annotations

import functools
import hashlib
import math
import numbers
import os
import types
import typing
from pathlib import Path
from typing import Any, ClassVar, Literal
from urllib.parse import unquote, urlsplit

import msgspec

from zephon_stream.errors import ConfigError, closest_key
from zephon_stream.vision.image import ImageSpec

__all__ = ["Backend", "Config", "ScheduleEntry", "SourceConfig", "TransformStep", "VisionConfig"]

Backend = Literal["inline", "threads", "processes", "ray"]

# Bounds that keep every allocation a config implies (a lane's sample, a batch) possible.
MAX_LANES = 4096
MAX_SEQ_LEN = 1 << 24
MAX_GLOBAL_BATCH_SIZE = 1 << 20
MAX_BATCH_TOKENS = 1 << 32  # global_batch_size x seq_len: 32 GiB per int64 tensor
MAX_TIMEOUT_S = 3600.0
SPLIT_PLAN = 2  # how shards are cut into splits (operators.read.plan_splits); 2: equal splits, k * lanes of them
SHUFFLE_FILL = 2  # how a shuffle window fills (operators.shuffle); 2: it grows by one document a pull until full


class VisionConfig(ImageSpec, frozen=True, forbid_unknown_fields=True):
    """The `[vision]` table: how images become tokens and pixels (Qwen2-VL conventions).

    An image is resized so that its sides are multiples of `patch_size * merge_size` and its
    pixel count lies in `[min_pixels, max_pixels]`, cut into `patch_size` patches (repeated
    `temporal_patch_size` times, as Qwen2-VL does for stills), and stands in the text as
    `vision_start_token`, one `image_token` per `merge_size x merge_size` patches, then
    `vision_end_token` (start and end are optional). A source image larger than
    `max_decoded_pixels` (width x height, read from its header) is refused before it is decoded.
    These sizing settings are `zephon_stream.vision.ImageSpec`'s, which this table extends.

    `pixel_dtype = "uint8"` (default) hands the batch raw pixels, a quarter of the bytes of
    float32; normalise them on the device with `zephon_stream.vision.normalize`. `"float32"`
    normalises on the host, bit-identical to Hugging Face's processor output.
    `decode_batch` (images per decode call), `decode_ahead` and `decode_threads` are execution
    settings. `decode_ahead` bounds the decoded images an image source reads ahead for a lane
    (rounded up to whole decode calls); it takes the place of `doc_buffer` batches for image
    sources, so that larger decode calls do not make the memory bound larger. Images decode on
    threads of their own, more than the cores by default: Pillow holds the GIL for part of every
    image (its Python, the header, copies out), and a thread waiting for the GIL leaves its core
    idle unless another has decoding to do. `decode_processes = N` (backend "threads") sends each
    decode call from those threads to one of N worker processes, out of the GIL
    (`zephon_stream.vision.processes`): the same frames, faster where the GIL is the limit.
    """

    image_token: str = "<|image_pad|>"
    vision_start_token: str | None = None
    vision_end_token: str | None = None
    pixel_dtype: Literal["uint8", "float32"] = "uint8"
    decode_batch: int = 32
    decode_ahead: int = 32  # decoded images read ahead per lane and image source (whole calls)
    decode_threads: int = 4  # decode calls at once per process (a pool beside cpu_threads)
    decode_processes: int = 0  # worker processes that decode those calls (0: the threads decode)

    def __post_init__(self) -> None:
        super().__post_init__()
        _check(self.decode_batch >= 1, "vision.decode_batch", self.decode_batch, "must be >= 1")
        _check(self.decode_ahead >= 1, "vision.decode_ahead", self.decode_ahead, "must be >= 1")
        _check(self.decode_threads >= 1, "vision.decode_threads", self.decode_threads, "must be >= 1")
        _check(self.decode_processes >= 0, "vision.decode_processes", self.decode_processes,
               "must be >= 0 (0: decode on the decode threads)")
        _check(self.decode_processes == 0 or os.name == "posix", "vision.decode_processes", self.decode_processes,
               "needs a POSIX system (its workers map memory this process hands them); set it to 0 here")
        _check(bool(self.image_token), "vision.image_token", self.image_token, "must name a token")
        for name in ("vision_start_token", "vision_end_token"):
            _check(getattr(self, name) != self.image_token, f"vision.{name}", getattr(self, name),
                   "is the image_token: the image span's start and end need tokens of their own (or unset them)")
        _check(self.vision_start_token is None or self.vision_start_token != self.vision_end_token,
               "vision.vision_end_token", self.vision_end_token, "is the vision_start_token: give each its own token")

    def max_image_tokens(self) -> int:
        """The most tokens one image takes in a sample: placeholders plus start and end."""
        placeholders = self.max_pixels // self.factor ** 2
        return placeholders + (self.vision_start_token is not None) + (self.vision_end_token is not None)

    def image_spec(self) -> ImageSpec:
        """The sizing settings alone."""
        return ImageSpec(**{f: getattr(self, f) for f in ImageSpec.__struct_fields__})

    def order_settings(self) -> list[Any]:
        """Every vision setting that shapes the samples (all but the execution settings `decode_*`)."""
        return [getattr(self, f) for f in self.__struct_fields__ if not f.startswith("decode_")]

    def decode_calls_ahead(self) -> int:
        """The decode calls an image source's feed may hold for a lane: `decode_ahead` images, rounded up."""
        return -(-self.decode_ahead // self.decode_batch)


class TransformStep(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One step of a source's `transforms`: exactly one of `map` and `filter`, an import path
    (`"mypkg.clean:strip_boilerplate"`) of a pure function of the record (see
    `zephon_stream.operators.transforms`)."""

    map: str | None = None
    filter: str | None = None

    def __post_init__(self) -> None:
        _check((self.map is None) != (self.filter is None), "transforms", {"map": self.map, "filter": self.filter},
               'each step is exactly one of { map = "pkg.module:function" } or { filter = "pkg.module:function" }')
        path = self.map or self.filter or ""
        module, _, name = path.partition(":")
        _check(bool(module) and bool(name) and " " not in path, "transforms", path,
               'must be an import path "pkg.module:function"')


def _field_default(struct: type[msgspec.Struct], name: str) -> Any:
    """The default a msgspec struct declares for field `name` (a fresh one where it has a factory)."""
    field = next(f for f in msgspec.structs.fields(struct) if f.name == name)
    return field.default_factory() if field.default is msgspec.NODEFAULT else field.default


class SourceConfig(msgspec.Struct, forbid_unknown_fields=True):
    """A named dataset: every `*.jsonl` and `*.jsonl.zst` object under `uri`, sorted by key.

    With `image_field` it is an image+text source instead: every `*.tar` object under `uri`,
    WebDataset style (the members of one sample share a key, `000123.png` + `000123.txt`).
    `image_field` lists the member extensions that hold the image (`"png"`, `"jpg;jpeg;png"`);
    `text_field` names the text member (`"txt"`) or a JSON member's field (`"json:caption"`).
    Elsewhere `text_field` (and `messages_field`, `tools_field`, `documents_field`) is a key, else a dotted path
    into nested objects (`"doc.body"`), in JSON lines and Parquet alike.
    Image sources need a `[vision]` table.

    `weight` is relative: only the ratios between the sources' weights matter (0.7 and 0.3 mix
    as 7 and 3 do, and they need not sum to 1). With `mix = "tokens"` a source's share of the
    tokens tracks `weight / sum(weights)`; with `mix = "documents"`, its share of the documents.

    `endpoint_url`, `region`, `addressing_style`, `profile` (a profile of the AWS config
    files, for a source whose credentials are not the environment's) and the timeouts
    (seconds, per request: to connect, and between bytes of a response) apply to `s3://`
    sources only. They are execution settings: they never change the order.
    """

    name: str
    uri: str
    weight: float = 1.0
    text_field: str = "text"
    image_field: str | None = None
    endpoint_url: str | None = None
    region: str | None = None
    addressing_style: Literal["auto", "path", "virtual"] | None = None
    profile: str | None = None
    connect_timeout: float = 10.0
    read_timeout: float = 30.0
    max_attempts: int = 5  # S3: attempts of one request (botocore's standard retries)
    retry_deadline: float = 120.0  # S3: how long an outage of an endpoint that answered before is ridden out
    messages_field: str | None = None  # makes it a chat source: the field holding a list of {role, content}
    chat_template: str | None = None  # a Jinja file; unset: the tokenizer_config.json next to the tokenizer
    loss_on: Literal["assistant", "last_assistant", "all"] = "assistant"
    tools_field: str | None = None  # chat sources: the field holding the tools offered (the template's `tools`)
    documents_field: str | None = None  # chat sources: the field holding retrieved documents (`documents`)
    # chat sources: extra template variables, as apply_chat_template(**kwargs) passes them (enable_thinking)
    chat_template_kwargs: dict[str, str | int | float | bool] = {}
    transforms: list[TransformStep] = []  # map / filter steps on each record, in order, before tokenizing

    def __post_init__(self) -> None:
        where = f"sources[{self.name}]"
        _check_types(self, f"{where}.", paths=("uri", "chat_template"))
        if self.messages_field is not None:
            _check(self.image_field is None, f"{where}.messages_field", self.messages_field,
                   "a source is a chat source or an image+text source, not both: unset image_field")
        if self.messages_field is None:  # a chat setting on a text source was ignored: it trained on all of `text`
            for field, value in (("chat_template", self.chat_template), ("loss_on", self.loss_on)):
                _check(value == _field_default(SourceConfig, field), f"{where}.{field}", value,
                       "is for chat sources: set messages_field too (the field that holds the conversation)")
        if self.chat_template_kwargs:
            _check(self.messages_field is not None, f"{where}.chat_template_kwargs", self.chat_template_kwargs,
                   "is for chat sources: set messages_field too")
            taken = sorted(set(self.chat_template_kwargs) & {"messages", "tools", "documents", "add_generation_prompt"})
            _check(not taken, f"{where}.chat_template_kwargs", self.chat_template_kwargs,
                   f"sets {', '.join(taken)}, which the loader passes itself")
        if self.tools_field is not None:
            _check(self.messages_field is not None, f"{where}.tools_field", self.tools_field,
                   "is for chat sources: set messages_field too (the field that holds the conversation)")
            _check(self.tools_field not in ("", self.messages_field), f"{where}.tools_field", self.tools_field,
                   "must name a field of its own, not the conversation's")
        if self.documents_field is not None:
            _check(self.messages_field is not None, f"{where}.documents_field", self.documents_field,
                   "is for chat sources: set messages_field too (the field that holds the conversation)")
            _check(self.documents_field not in ("", self.messages_field, self.tools_field), f"{where}.documents_field",
                   self.documents_field, "must name a field of its own, not the conversation's or the tools'")
        if self.image_field is not None:
            _check(bool(self.image_extensions), f"{where}.image_field", self.image_field,
                   'must list member extensions, e.g. "png" or "jpg;jpeg;png;webp"')
            ext, colon, key = self.text_field.partition(":")
            _check(bool(ext) and (not colon or bool(key)), f"{where}.text_field", self.text_field,
                   'names the caption member ("txt") or a field of a JSON member ("json:caption")')
        if self.profile is not None:
            _check(bool(self.profile.strip()), f"{where}.profile", self.profile, "must name a profile")
        if self.endpoint_url is not None:
            _check(_is_http_url(self.endpoint_url), f"{where}.endpoint_url", self.endpoint_url,
                   "is not a URL: use http://host:port or https://host")
        for field in ("connect_timeout", "read_timeout", "retry_deadline"):
            value = getattr(self, field)
            _check(0 < value <= MAX_TIMEOUT_S, f"{where}.{field}", value, f"must be in (0, {MAX_TIMEOUT_S:g}] seconds")
        _check(1 <= self.max_attempts <= 100, f"{where}.max_attempts", self.max_attempts, "must be in [1, 100]")

    @property
    def image_extensions(self) -> tuple[str, ...]:
        """The image member extensions, lowercased, in the order given (the first present wins)."""
        return tuple(e.strip().lower().lstrip(".") for e in (self.image_field or "").split(";") if e.strip())


class ScheduleEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A `[[schedule]]` table: from global step `step` on, the sources mix by `weights`
    (one relative weight >= 0 per source, by name, one > 0), until the next entry.

    ```
    [[schedule]]
    step = 2000
    weights = { web = 0.3, code = 0.7 }
    ```
    Mix counts restart at a change: the steps after it track the new weights, not a cumulative
    mix of old and new. The change applies to the documents drawn for the samples of step
    `step` on (see `operators.mix`). `Loader.set_weights` logs entries of the same shape.
    """

    step: int
    weights: dict[str, float]


class Config(msgspec.Struct, forbid_unknown_fields=True):
    """Everything that defines a loader: read it from TOML with `from_toml`, or build it here.

    `labels` is the label convention of the batch:

    - `"shifted"` (default; torchtitan and Megatron style): `labels[t]` is the target of position
      `t`, that is `input_ids[t + 1]`. Use it with a plain cross-entropy over all positions:
      `F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)`.
    - `"unshifted"` (Hugging Face style): `labels[t]` is aligned with `input_ids[t]` (-100 where
      masked, and at position 0); the model shifts them itself:
      `model(input_ids=batch["input_ids"], labels=batch["labels"]).loss`.

    Passing shifted labels to a model that shifts them again trains on the token two ahead,
    without any error: pick the one your loss expects.
    """

    seed: int
    lanes: int
    seq_len: int
    global_batch_size: int
    tokenizer: str
    sources: list[SourceConfig]
    eos_token: str = "<|endoftext|>"
    bos_token: str | None = None  # a token put before every document, for tokenizers trained with one; off by default
    labels: Literal["shifted", "unshifted"] = "shifted"  # see the Config docstring
    pad_token_id: int | None = None  # None: the EOS id
    shuffle_window: int = 64  # documents per lane (per source and lane with shuffle_scope = "source"); 0 = off
    # "lane": one window after the mix; "source": a window per source before it, so the mix decides what is packed
    # next and realized shares follow a weight change within a few steps (see operators.mix)
    shuffle_scope: Literal["lane", "source"] = "lane"
    max_epochs: int = 0  # 0 = forever
    mix: Literal["tokens", "documents"] = "tokens"
    mask_cross_document_labels: bool = True
    split_bytes: int = 1 << 20  # target bytes per split (a byte range, or a group of zstd frames)
    on_bad_record: Literal["error", "skip"] = "error"
    max_record_bytes: int = 16 << 20
    # execution settings: never change the order
    backend: Backend = "threads"
    workers: int = 2  # worker processes per rank (processes backend)
    cpu_threads: int = 2  # CapacityLimiter for CPU steps (threads backend)
    max_restarts: int = 3  # restarts of one lane worker (process or Ray actor) that died, before the loader fails
    ray_address: str | None = None  # ray backend: an existing cluster ("auto", "ray://host:10001"); None: start one
    ray_actors: int = 2  # ray backend: actors that this rank's lanes are spread over
    ray_num_cpus: float = 1.0  # ray backend: CPUs that each actor reserves
    tokenize_batch: int = 64  # documents per tokenizer call
    doc_buffer: int = 4  # tokenized document batches buffered per source per lane
    sample_buffer: int = 4  # sample batches buffered per lane
    sample_batch: int = 4  # samples per lane-to-sequencer hand-off
    read_ahead: int = 4  # ranged reads (1 MiB) of a split in flight per lane on S3; 1 = one at a time (local: always)
    stall_warning_s: float = 60.0  # a batch waiting this long for one lane's samples is logged; 0 = never
    vision: VisionConfig | None = None  # the [vision] table; needed by sources with image_field
    schedule: list[ScheduleEntry] = []  # [[schedule]] tables: weights from given global steps on (an order setting)
    packing: Literal["concat", "best_fit", "none"] = "concat"  # how documents become samples
    packing_window: int = 64  # best_fit: documents per lane that a sample is chosen from
    truncate: bool = False  # packing = "none": cut a longer document at seq_len (counted) instead of splitting it
    # text documents longer than this are cut into pieces of it (the last one shorter) as they are read, before
    # shuffling and mixing, so one long document never holds a lane to its source for many samples; 0 = off
    piece_tokens: int = 0

    def __post_init__(self) -> None:
        _check_types(self, paths=("tokenizer",))
        _check(0 <= self.seed < 1 << 64, "seed", self.seed, "must be in [0, 2**64): seeds are 64-bit")
        _check(1 <= self.lanes <= MAX_LANES, "lanes", self.lanes, f"must be in [1, {MAX_LANES}]")
        _check(2 <= self.seq_len <= MAX_SEQ_LEN, "seq_len", self.seq_len, f"must be in [2, {MAX_SEQ_LEN}]")
        _check(1 <= self.global_batch_size <= MAX_GLOBAL_BATCH_SIZE, "global_batch_size", self.global_batch_size,
               f"must be in [1, {MAX_GLOBAL_BATCH_SIZE}]")
        _check(self.global_batch_size * self.seq_len <= MAX_BATCH_TOKENS, "global_batch_size", self.global_batch_size,
               f"x seq_len = {self.global_batch_size * self.seq_len} tokens per batch, more than {MAX_BATCH_TOKENS}")
        _check(self.pad_token_id is None or 0 <= self.pad_token_id < 1 << 32, "pad_token_id", self.pad_token_id,
               "must be a token id in [0, 2**32), or unset for the EOS id")
        _check(bool(self.eos_token), "eos_token", self.eos_token, "must name the tokenizer's end-of-text token")
        _check(self.max_record_bytes >= 1, "max_record_bytes", self.max_record_bytes, "must be >= 1")
        _check(self.shuffle_window >= 0, "shuffle_window", self.shuffle_window, "must be >= 0 (0 = off)")
        _check(self.max_epochs >= 0, "max_epochs", self.max_epochs, "must be >= 0 (0 = forever)")
        _check(self.split_bytes >= 1024, "split_bytes", self.split_bytes, "must be >= 1024")
        _check(len(self.sources) >= 1, "sources", self.sources, "needs at least one [[sources]] table")
        names = [s.name for s in self.sources]
        _check(len(set(names)) == len(names), "sources", names, "source names must be unique")
        for s in self.sources:
            _check(s.weight >= 0 and math.isfinite(s.weight), f"sources[{s.name}].weight", s.weight,
                   "must be >= 0 (0: paused until the others end)")
        _check(any(s.weight > 0 for s in self.sources), "sources.weight", [s.weight for s in self.sources],
               "one source needs a weight > 0")
        for field in ("workers", "cpu_threads", "tokenize_batch", "doc_buffer", "sample_buffer", "sample_batch",
                      "read_ahead"):
            _check(getattr(self, field) >= 1, field, getattr(self, field), "must be >= 1")
        _check(self.packing_window >= 1, "packing_window", self.packing_window, "must be >= 1")
        _check(self.stall_warning_s == 0 or 0.1 <= self.stall_warning_s < math.inf, "stall_warning_s",
               self.stall_warning_s, "must be 0 (never warn) or a number of seconds >= 0.1")
        _check(self.piece_tokens >= 0, "piece_tokens", self.piece_tokens, "must be >= 0 (0 = documents whole)")
        _check(not self.truncate or self.packing == "none", "truncate", self.truncate,
               'applies to packing = "none" only (concat and best_fit split long documents)')
        _check(self.packing == "concat" or self.vision is None, "packing", self.packing,
               'image+text sources pack with "concat" only')
        _check(self.max_restarts >= 0, "max_restarts", self.max_restarts, "must be >= 0 (0: fail at the first death)")
        _check(self.ray_actors >= 1, "ray_actors", self.ray_actors, "must be >= 1")
        _check(self.ray_num_cpus > 0 and math.isfinite(self.ray_num_cpus), "ray_num_cpus", self.ray_num_cpus,
               "must be > 0 (a fraction shares a CPU between actors)")
        self._check_vision()
        self._check_schedule()

    def _check_vision(self) -> None:
        images = [s.name for s in self.sources if s.image_field is not None]
        if images and self.vision is None:
            raise ConfigError(f"config sources {images} have image_field but there is no [vision] table: add one "
                              "(its defaults follow Qwen2-VL)")
        if self.vision is None:
            return
        need = self.vision.max_image_tokens() + 1 + (self.bos_token is not None)  # and EOS (and BOS)
        _check(need <= self.seq_len, "seq_len", self.seq_len,
               f"cannot hold one image: at vision.max_pixels = {self.vision.max_pixels} an image takes up to "
               f"{need - 1} tokens plus EOS; raise seq_len to >= {need} or lower vision.max_pixels to <= "
               f"{(self.seq_len - need + self.vision.max_pixels // self.vision.factor ** 2) * self.vision.factor ** 2}")

    def _check_schedule(self) -> None:
        steps = [e.step for e in self.schedule]
        _check(steps == sorted(set(steps)), "schedule", steps, "steps must be strictly increasing, one table a step")
        for e in self.schedule:
            self.check_weights(e.weights, f"schedule[step={e.step}].weights")
            _check(e.step >= 0, f"schedule[step={e.step}].step", e.step, "must be >= 0")

    def check_weights(self, weights: object, where: str) -> list[float]:
        """`weights` (name -> relative weight) as a list in source order; ConfigError unless it
        names every source exactly once with a finite weight >= 0, one of them > 0."""
        names = [s.name for s in self.sources]
        unknown = sorted(set(weights) - set(names)) if isinstance(weights, dict) else []
        missing = [n for n in names if n not in weights] if isinstance(weights, dict) else []
        _check(isinstance(weights, dict) and set(weights) == set(names), where, weights,
               f"must give a weight to each source, by name: {names}"
               + (f" ({', '.join(map(repr, unknown))} {'is' if len(unknown) == 1 else 'are'} not one)"
                  if unknown else "")
               + (f" (no weight for {', '.join(map(repr, missing))}: 0 pauses a source)" if missing else ""))
        assert isinstance(weights, dict)
        for name, w in weights.items():
            _check(isinstance(w, (int, float)) and not isinstance(w, bool) and w >= 0 and math.isfinite(w),
                   f"{where}.{name}", w, "must be a number >= 0 (weights are relative; 0 pauses the source)")
        _check(any(weights.values()), where, weights, "one source needs a weight > 0")
        return [float(weights[n]) for n in names]

    def weights_by_step(self) -> list[tuple[int, list[float]]]:
        """[(step, weights in source order)]: the sources' weights from step 0, then each schedule
        entry's (one at step 0 replaces the sources' weights)."""
        out = {0: [s.weight for s in self.sources]}
        out.update((e.step, self.check_weights(e.weights, f"schedule[step={e.step}].weights")) for e in self.schedule)
        return sorted(out.items())

    def with_decisions(self, decisions: list[ScheduleEntry]) -> Config:
        """This config with `decisions` (a `Loader.set_weights` log, in call order) merged into its
        schedule: a decision replaces the entry at its step, and a later decision an earlier one."""
        merged = {e.step: e for e in self.schedule}
        merged.update((d.step, d) for d in decisions)
        return self.replace(schedule=[merged[k] for k in sorted(merged)])

    @classmethod
    def from_toml(cls, path: str | Path) -> Config:
        """Read a config from a TOML file: top-level settings, one `[[sources]]` table per source, an
        optional `[vision]` table and `[[schedule]]` tables.

        ```
        seed = 1234
        lanes = 12
        seq_len = 2048
        global_batch_size = 24
        tokenizer = "/data/tokenizer.json"
        [[sources]]
        name = "web"
        uri = "file:///data/web/"
        weight = 0.7
        ```
        A relative `tokenizer` path or a plain (scheme-less) source path is taken relative to the
        config file's directory. Unset settings take their defaults (`zephon config FILE` prints
        them all). A file that cannot be read, is not TOML, or holds an unknown key or a bad value
        raises `ConfigError` naming the file, the key and the value (and, for a misspelt key, the
        key it is closest to).
        """
        try:
            data = Path(path).read_bytes()
        except OSError as exc:
            raise ConfigError(f"config file {str(path)!r} cannot be read: {exc.strerror or exc}; give the path "
                              "of a TOML file") from exc
        try:
            return msgspec.toml.decode(data, type=cls).with_paths_from(Path(path).parent)
        except msgspec.ValidationError as exc:
            hint = closest_key(str(exc), {"": cls, "sources": SourceConfig, "transforms": TransformStep,
                                          "vision": VisionConfig, "schedule": ScheduleEntry})
            raise ConfigError(f"invalid config {path}: {exc}{hint}") from exc
        except msgspec.DecodeError as exc:
            raise ConfigError(f"config {path} is not valid TOML: {exc}") from exc

    def to_toml(self) -> str:
        """The full configuration, defaults included, as TOML that `from_toml` reads back."""
        plain = msgspec.to_builtins(self)
        sources = plain.pop("sources")
        vision = plain.pop("vision")
        schedule = plain.pop("schedule")
        lines = [f"{k} = {_toml_value(v)}" for k, v in plain.items() if v is not None]
        if vision is not None:
            lines += ["", "[vision]"] + [f"{k} = {_toml_value(v)}" for k, v in vision.items() if v is not None]
        for src in sources:
            steps = src.pop("transforms", [])
            lines += ["", "[[sources]]"] + [f"{k} = {_toml_value(v)}" for k, v in src.items() if v is not None]
            for step in steps:  # tables of the source above: [[sources.transforms]]
                lines += ["[[sources.transforms]]"] + [f"{k} = {_toml_value(v)}" for k, v in step.items() if v]
        for entry in schedule:
            weights = ", ".join(f"{_toml_value(k)} = {_toml_value(v)}" for k, v in entry["weights"].items())
            lines += ["", "[[schedule]]", f"step = {entry['step']}", f"weights = {{ {weights} }}"]
        return "\n".join(lines) + "\n"

    def with_paths_from(self, base: str | Path) -> Config:
        """This config with a relative tokenizer path, and plain source paths (no `file://`, `s3://`),
        made absolute from `base`; a plain source path becomes a `file://` URI."""
        root = Path(base).resolve()
        tokenizer = self.tokenizer
        if tokenizer.startswith("file:///"):  # a source's URI form, for a local file
            tokenizer = unquote(urlsplit(tokenizer).path)
        tokenizer = tokenizer if Path(tokenizer).is_absolute() else str(root / tokenizer)
        sources = [msgspec.structs.replace(s, uri=_file_uri(root / s.uri)) if "://" not in s.uri else s
                   for s in self.sources]
        sources = [msgspec.structs.replace(s, chat_template=str(root / s.chat_template))
                   if s.chat_template is not None and not Path(s.chat_template).is_absolute() else s
                   for s in sources]
        return self.replace(tokenizer=tokenizer, sources=sources)

    def replace(self, **changes: object) -> Config:
        return msgspec.structs.replace(self, **changes)

    @property
    def tokenizer_file(self) -> str:
        """The tokenizer.json that `tokenizer` names: the path itself, or the `tokenizer.json` of a
        model directory (as Hugging Face lays them out, `tokenizer_config.json` beside it)."""
        inside = Path(self.tokenizer) / "tokenizer.json"
        return str(inside) if inside.is_file() else self.tokenizer

    def order_settings(self, tokenizer_sha: str) -> dict[str, Any]:
        """Every setting that shapes the sample sequence (not execution settings), as plain data."""
        order: dict[str, Any] = {
            f: getattr(self, f)
            for f in ("seed", "lanes", "seq_len", "global_batch_size", "eos_token", "pad_token_id",
                      "shuffle_window", "max_epochs", "mix", "mask_cross_document_labels",
                      "split_bytes", "on_bad_record", "max_record_bytes")
        }
        if self.bos_token is not None:  # only when set: configs from before it keep their digest
            order["bos_token"] = self.bos_token
        if self.labels != "shifted":
            order["labels"] = self.labels
        order["split_plan"] = SPLIT_PLAN
        if self.shuffle_window > 0:  # a window that grows draws other documents first: a new order
            order["shuffle_fill"] = SHUFFLE_FILL
        order["sources"] = [[s.name, s.weight, s.text_field] + ([s.image_field] if s.image_field else [])
                            + (_chat_order(s, self.tokenizer_file) if s.messages_field is not None else [])
                            + ([[[t.map, t.filter] for t in s.transforms]] if s.transforms else [])
                            for s in self.sources]
        if self.vision is not None:
            order["vision"] = self.vision.order_settings()
        if self.shuffle_scope != "lane":  # absent at its default, like schedule
            order["shuffle_scope"] = self.shuffle_scope
        if self.schedule:  # absent when empty: configs without one keep their digests (and checkpoints)
            order["schedule"] = [[e.step, self.check_weights(e.weights, "schedule")] for e in self.schedule]
        if self.packing != "concat":  # absent at its default: older configs keep their digests
            order.update(packing=self.packing, packing_window=self.packing_window, truncate=self.truncate)
        if self.piece_tokens:  # absent when off: configs from before it keep their digests
            order["piece_tokens"] = self.piece_tokens
        order["tokenizer_sha256"] = tokenizer_sha
        return order

    #: Order data that goes with another setting (packing's two with packing = "best_fit" or "none",
    #: the window's fill with shuffle_window > 0): named as changed only where both sides hold it,
    #: since the setting it goes with says the rest.
    ORDER_DEPENDENT: ClassVar[frozenset[str]] = frozenset({"packing_window", "truncate", "shuffle_fill"})

    @staticmethod
    def order_default(key: str) -> Any:
        """The value of order setting `key` that `order_settings` leaves out (at its default, so that
        older checkpoints keep their digest), or None for a setting it always holds."""
        return _field_default(Config, key) if key in _ORDER_OMITTED else None

    def order_digest(self, tokenizer_sha: str) -> str:
        """Digest of `order_settings`: equal digests, equal sample sequences on equal data."""
        return hashlib.sha256(msgspec.json.encode(self.order_settings(tokenizer_sha))).hexdigest()[:32]


# the order settings left out of `order_settings` at their defaults (packing's two with packing itself)
_ORDER_OMITTED = ("bos_token", "labels", "shuffle_scope", "schedule", "packing", "packing_window", "truncate",
                  "piece_tokens")


def _chat_order(s: SourceConfig, tokenizer: str) -> list[Any]:
    """A chat source's order settings: its fields, loss scope and the bytes of its template file (a
    template edited in place is a new order), or of the tokenizer_config.json next to the
    tokenizer when it has no `chat_template` (and of the model's chat_template.jinja and
    additional_chat_templates/*.jinja, where there are any)."""
    path = Path(s.chat_template) if s.chat_template is not None else Path(tokenizer).parent / "tokenizer_config.json"
    template = path.read_bytes() if path.is_file() else b""
    if s.chat_template is None:  # the model directory's template files, which transformers prefers, when there
        from zephon_stream.chat import model_template_files

        for file in model_template_files(tokenizer):
            template += b"\0" + file.name.encode() + b"\0" + file.read_bytes()
    tools = [s.tools_field] if s.tools_field is not None else []  # only when set: older configs keep their digest
    kwargs = [sorted(s.chat_template_kwargs.items())] if s.chat_template_kwargs else []  # likewise
    documents = [["documents", s.documents_field]] if s.documents_field is not None else []  # likewise
    return [[s.messages_field, s.loss_on, hashlib.sha256(template).hexdigest()[:16], *tools, *kwargs, *documents]]


def _file_uri(path: Path) -> str:
    return path.resolve().as_uri().rstrip("/") + "/"


def _toml_value(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return msgspec.json.encode(v).decode()  # a JSON string is a valid TOML basic string
    if isinstance(v, dict):  # an inline table, its keys quoted
        return "{ " + ", ".join(f"{_toml_value(str(k))} = {_toml_value(x)}" for k, x in v.items()) + " }" if v else "{}"
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return repr(v)


def _is_http_url(url: str) -> bool:
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018  (raises ValueError for a port that is not a number in range)
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname)


def _check(ok: bool, name: str, value: object, why: str) -> None:
    if not ok:
        raise ConfigError(f"config {name} = {value!r}: {why}")


_KINDS = {int: (int,), float: (int, float), str: (str,), bool: (bool,)}
_KIND_WORDS = {int: "a whole number", float: "a number", str: "a string", bool: "true or false"}


@functools.cache
def _scalar_fields(cls: type) -> list[tuple[str, type, bool]]:
    """(name, kind, may be None) of `cls`'s fields whose type is int, float, str or bool, or one of
    them or None: what a Struct made in Python (msgspec checks types only when decoding) must hold."""
    out = []
    for f in msgspec.structs.fields(cls):
        args = typing.get_args(f.type) if isinstance(f.type, types.UnionType) else (f.type,)
        kinds = [a for a in args if a is not type(None)]
        if len(kinds) == 1 and kinds[0] in _KINDS:
            out.append((f.name, kinds[0], len(kinds) < len(args)))
    return out


def _check_types(struct: msgspec.Struct, where: str = "", paths: tuple[str, ...] = ()) -> None:
    """A ConfigError for a setting of the wrong type (`seq_len="64"` in Python), before a check
    compares it and fails with a TypeError. The settings named in `paths` may be given as a
    `pathlib.Path`, which becomes its string, and numpy's numbers become Python's."""
    for name, kind, optional in _scalar_fields(type(struct)):
        value = getattr(struct, name)
        if name in paths and isinstance(value, os.PathLike):
            value = os.fspath(value)
            setattr(struct, name, value)
        elif kind in (int, float) and isinstance(value, numbers.Integral if kind is int else numbers.Real) \
                and not isinstance(value, bool) and type(value) not in _KINDS[kind]:  # numpy's int64, float64
            value = kind(value)
            setattr(struct, name, value)
        if (value is None and optional) or (isinstance(value, _KINDS[kind])
                                            and (kind is bool or not isinstance(value, bool))):
            continue
        _check(False, f"{where}{name}", value, f"must be {_KIND_WORDS[kind]}, not {type(value).__name__}")
