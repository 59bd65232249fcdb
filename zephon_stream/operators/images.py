"""Image+text sources: read WebDataset tar shards, and turn a sample into tokens and pixels.

A tar shard's index (`formats.tar.tar_index`) lists the byte offset of every sample's first
header, so splits are groups of whole samples, like zstd frames: a split owns the samples that
start in it, and reads nothing outside them.

```
shard:   |hdr 000.png|data|hdr 000.txt|data|hdr 001.png|data|hdr 001.txt|data| ...
index:   ^0                               ^1                               ^2
split:   [samples 0, 1) -> one document: "<vs> <img>*k <ve> caption EOS" + the resized image
```

`TarSplitReader.blocks` keeps the read path's contract (`(offset, bytes)` blocks of whole
records, offsets relative to the split's first sample), so the lane's producer, restore and
source check are the same for text and images. A document's reference is the sample's offset
and length: restore re-reads and re-decodes it; pixels are never in a checkpoint.

Pixels stay uint8 from decode to collate: the worker that decodes an image also gathers its
patches (`vision.patch_frame`, one frame, as many bytes as the resized image: at most
`max_pixels * 3` per image in any buffer) while its bytes are in the cache; collate only
copies them into the batch with the temporal copies (`vision.patch_rows`).
"""

from __future__ import annotations

import functools
import re
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Literal

import msgspec
import numpy as np

from zephon_stream.connectors.base import Store
from zephon_stream.engine.window import Spawn, read_ranges
from zephon_stream.errors import DataError, IncompatibleState
from zephon_stream.operators.read import MAX_DEPTH, BadRecords, ShardPlan, Split, too_deep
from zephon_stream.operators.types import ImageDoc, field, located

__all__ = ["ImageParser", "ImageRecord", "TarSplitReader", "VisionTokens", "mark_images"]

_READ_PART = 1 << 20  # the largest ranged read of a split, unless one sample is larger


class TarSplitReader:
    """Streams the samples a split of a tar shard owns, in blocks of whole samples (<= 1 MiB,
    or one larger sample), through a `ReadWindow` of `read_ahead` requests when given `spawn`."""

    def __init__(self, store: Store, shard: ShardPlan, split: Split, max_record: int,
                 run_cpu: Callable[..., Awaitable[Any]] | None = None, *, spawn: Spawn | None = None,
                 read_ahead: int = 1, bad: BadRecords | None = None) -> None:
        self.store, self.key, self.shard, self.split = store, shard.key, shard, split
        self.max_record, self.spawn, self.read_ahead = max_record, spawn, read_ahead
        self.bad = bad or BadRecords()
        self.base = shard.frames[split.start]

    def __repr__(self) -> str:
        return f"TarSplitReader({self.key!r}, {self.split})"

    def where(self, pos: int) -> str:
        return f"byte {self.base + pos}"

    def _ranges(self, first: int) -> list[tuple[int, int, str]]:
        """Reads covering samples [first, split.end): consecutive samples together, up to _READ_PART,
        or a `read_ahead`-th of the split when there is a window, so that its requests overlap;
        a sample with a member over max_record_bytes is `(start, end, why)`, not read."""
        starts, oversized = self.shard.frames, self.shard.oversized
        part = _READ_PART
        if self.spawn is not None and self.read_ahead > 1:
            part = min(_READ_PART, -(-(starts[self.split.end] - starts[first]) // self.read_ahead))
        out, lo = [], starts[first]
        for i in range(first, self.split.end):
            if starts[i] in oversized:
                if lo < starts[i]:
                    out.append((lo, starts[i], ""))
                out.append((starts[i], starts[i + 1], oversized[starts[i]]))
                lo = starts[i + 1]
            elif starts[i + 1] - lo >= part or i + 1 == self.split.end:
                out.append((lo, starts[i + 1], ""))
                lo = starts[i + 1]
        return out

    async def blocks(self, offset: int = 0) -> AsyncIterator[tuple[int, bytes]]:
        """(offset, bytes) blocks of whole samples from `offset` (a sample start) to the split's end."""
        starts = self.shard.frames
        first = next((i for i in range(self.split.start, self.split.end + 1) if starts[i] - self.base == offset), None)
        if first is None:
            raise IncompatibleState(f"offset {offset} of {self.key!r} ({self.where(offset)}) is not a sample start "
                                    f"of split {self.split}")
        ranges = self._ranges(first) if first < self.split.end else []  # a cursor at the end: nothing left
        reads = [(lo, hi) for lo, hi, why in ranges if not why]
        parts = read_ranges(functools.partial(self.store.read, self.key), reads, self.read_ahead, self.spawn)
        for lo, hi, why in ranges:
            if why:  # a sample too large to read: one bad record, where it lies
                self.bad(DataError(f"tar shard {self.key!r}: {why}", key=self.key, offset=lo))
                continue
            data = await parts.__anext__()
            if len(data) != hi - lo:
                raise DataError(f"tar shard {self.key!r} changed or was cut while reading: bytes [{lo}, {hi}) "
                                f"gave {len(data)} bytes", key=self.key, offset=lo)
            yield lo - self.base, data
        if self.split.end == len(starts) - 1 and self.shard.bad_tail:  # the split that owns the shard's tail
            self.bad(DataError(f"tar shard {self.key!r}: {self.shard.bad_tail}", key=self.key, offset=starts[-1]))


class ImageRecord(msgspec.Struct, frozen=True, array_like=True):
    """One sample's payload before decoding: its caption, its image bytes and where they came from."""

    text: str
    image: bytes
    member: str  # the image member's name, for error messages


_TOGETHER = "; a sample's members follow one another in the tar, as WebDataset writes them"
_IMAGE_EXTS = ("jpg", "jpeg", "png", "webp", "gif", "bmp", "tif", "tiff")  # what a missing image member may be under
_HINT_JSON_MAX = 1 << 16  # a JSON member whose fields an error lists: at most this many bytes


class ImageParser:
    """Decodes blocks of tar samples into `(offset, length, ImageRecord)` records.

    `image_exts`: the member extensions that may hold the image, the first present wins;
    `text_field`: the text member's extension, or `"json:<field>"` for a JSON member's field.
    A sample without either is a bad record (a DataError, or a counted skip).
    """

    def __init__(self, text_field: str, image_exts: tuple[str, ...], on_bad: Literal["error", "skip"],
                 max_record: int) -> None:
        self.text_field, self.image_exts, self.max_record = text_field, image_exts, max_record
        self.text_ext, _, self.json_field = text_field.partition(":")
        self.text_ext = self.text_ext.lower()
        self.bad = BadRecords(on_bad)

    @property
    def skipped(self) -> int:
        return self.bad.count

    def __repr__(self) -> str:
        return f"ImageParser(text_field={self.text_field!r}, image={';'.join(self.image_exts)!r})"

    @staticmethod
    def record_offset(reader: TarSplitReader, error: DataError) -> int:
        """The offset of `parse`'s records that a bad sample's error names (its offset in the shard)."""
        return error.offset - reader.base

    def parse(self, reader: TarSplitReader, block_pos: int, block: bytes) -> list[tuple[int, int, ImageRecord]]:
        from zephon_stream.formats.tar import parse_samples

        out = []
        for sample in parse_samples(block, reader.base + block_pos, reader.key, self.max_record):
            try:
                out.append((sample.offset - reader.base, sample.length, self._record(reader, sample)))
            except DataError as err:
                reader.bad(err)  # the reader's policy: it counts into the epoch of its split
        return out

    def _image_hint(self, members: dict[str, bytes]) -> str:
        """The fix for a sample without an image member: the image extensions it has, else where its
        image may be (a member apart from the others in the tar)."""
        found = [e for e in sorted(members) if e.lower() in _IMAGE_EXTS]
        if not found:
            return _TOGETHER
        return f": to read its {', '.join(found)} too, give image_field = {';'.join([*self.image_exts, *found])!r}"

    def _caption_hint(self, members: dict[str, bytes]) -> str:
        """The fix for a sample without the caption member: a text member it has, or a JSON member's
        fields (`json:FIELD`), else where its caption may be."""
        texts = [e for e in sorted(members) if e.lower() in ("txt", "text", "caption", "md")]
        if texts:
            return f": give text_field = {texts[0]!r} to read its {texts[0]} member"
        jsons = [e for e in sorted(members) if e.lower().endswith("json")]
        if not jsons:
            return _TOGETHER
        raw, fields = members[jsons[0]], []
        if len(raw) <= _HINT_JSON_MAX and not too_deep(raw):  # an error message's work stays small
            try:
                fields = [k[:40] for k, v in msgspec.json.decode(raw, type=dict[str, Any]).items()
                          if isinstance(v, str)]
            except (msgspec.DecodeError, msgspec.ValidationError):
                pass
        usual = [f for f in ("caption", "text", "txt", "description") if f in fields]
        pick = (usual or fields or ["FIELD"])[0]
        listed = f" (its string fields: {', '.join(fields[:8])})" if fields else ""
        return f": for a field of its {jsons[0]} member, give text_field = {f'{jsons[0]}:{pick}'!r}{listed}"

    def _record(self, reader: TarSplitReader, sample: Any) -> ImageRecord:
        where = f"sample {sample.key!r} of {reader.key!r} at byte {sample.offset}"
        image_ext = next((e for e in self.image_exts if e in sample.members), None)
        if image_ext is None:
            raise DataError(f"{where} has no image member (looked for {', '.join(self.image_exts)}; it has "
                            f"{', '.join(sorted(sample.members)) or 'none'}{self._image_hint(sample.members)})",
                            key=reader.key, offset=sample.offset)
        if self.text_ext not in sample.members:
            raise DataError(f"{where} has no caption member {self.text_ext!r} (it has "
                            f"{', '.join(sorted(sample.members))}{self._caption_hint(sample.members)})",
                            key=reader.key, offset=sample.offset)
        raw = sample.members[self.text_ext]
        if self.json_field and too_deep(raw):  # msgspec's RecursionError ended a run in skip mode
            raise DataError(f"{where}: caption member {self.text_ext!r} nests JSON arrays or objects more than "
                            f"{MAX_DEPTH} deep, the most a record may", key=reader.key, offset=sample.offset)
        try:
            text = (field(msgspec.json.decode(raw, type=dict[str, Any]), self.json_field) if self.json_field
                    else raw.decode())
        except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as exc:
            raise DataError(f"{where}: caption member {self.text_ext!r} does not decode: {exc}",
                            key=reader.key, offset=sample.offset) from exc
        if text is None:
            raise DataError(f"{where}: its {self.text_ext!r} member has no field {self.json_field!r} (text_field "
                            f"{self.text_field!r})", key=reader.key, offset=sample.offset)
        if not isinstance(text, str):
            raise DataError(f"{where}: caption {self.text_field!r} is {type(text).__name__}, not a string",
                            key=reader.key, offset=sample.offset)
        if not text.strip():
            raise DataError(f"{where}: empty caption {self.text_field!r}", key=reader.key, offset=sample.offset)
        return ImageRecord(text, sample.members[image_ext], f"{sample.key}.{image_ext}")


class VisionTokens:
    """Turns image records into documents: the image decoded and resized, the caption tokenized.

    A document's ids are `[vision_start] + [image_token] * k + [vision_end] + caption + [EOS]`
    (after a BOS, with `bos_token`), where k is the number of merged patches; the image span
    (BOS to vision end) is never cut by packing and never trained on.
    """

    def __init__(self, vision: Any, tokenizer: Any, seq_len: int, pool: Any = None) -> None:
        self.vision, self.tokenizer, self.seq_len = vision, tokenizer, seq_len
        self.pool = pool  # a `vision.processes.DecodePool` that decodes the calls, or None: decoded here
        # this loader's calls in the pool at once: its own decode_processes (the pool is the process's)
        self._at_once = threading.Semaphore(max(1, vision.decode_processes))
        self.spec = vision.image_spec()
        self.image_id = tokenizer.token_id(vision.image_token, "vision.image_token")
        self.start = [tokenizer.token_id(t, f"vision.{f}") for f, t in
                      (("vision_start_token", vision.vision_start_token),) if t is not None]
        self.end = [tokenizer.token_id(t, f"vision.{f}") for f, t in
                    (("vision_end_token", vision.vision_end_token),) if t is not None]
        self.bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
        # the ids that only an image span may hold: a caption or text whose words encode to one (its text
        # holds "<|image_pad|>") would give the model a placeholder without an image
        self.reserved = {self.image_id: vision.image_token}
        for tid, token in zip(self.start + self.end, [t for t in (vision.vision_start_token, vision.vision_end_token)
                                                       if t is not None]):
            self.reserved[tid] = token
        self._reserved = np.array(sorted(self.reserved), dtype=np.uint32)

    def clean(self, docs: list[tuple[Any, Any]], bad: BadRecords, key: str, where: Callable[[int], str] | None,
              what: str = "document") -> list[tuple[Any, Any]]:
        """`docs` (`(ref, ids)`, ids an array or a doc that holds `ids`) without those whose ids hold a
        vision token, each a bad record: the text has that token's text in it."""
        dropped = self.holding_vision_tokens(docs, bad, key, where, what)
        return docs if not dropped else [d for i, d in enumerate(docs) if i not in dropped]

    def holding_vision_tokens(self, docs: list[tuple[Any, Any]], bad: BadRecords, key: str,
                              where: Callable[[int], str] | None, what: str | Callable[[int], str]) -> set[int]:
        """The positions in `docs` of those whose ids hold a vision token, each passed to `bad`,
        named `what` (or `what(i)`: a caption by its sample's key)."""
        if not docs or not self._holds_reserved(np.concatenate([getattr(d, "ids", d) for _, d in docs])):
            return set()  # one look at them all: the common case
        out = set()
        for i, (ref, doc) in enumerate(docs):
            found = np.isin(self._reserved, getattr(doc, "ids", doc))
            if not found.any():
                continue
            at = located(where, ref[2])
            tokens = ", ".join(repr(self.reserved[int(t)]) for t in self._reserved[found])
            name = what if isinstance(what, str) else what(i)
            bad(DataError(f"bad {name} in {key!r} at {at}: its text holds {tokens}, which only an image span may: "
                          "the model would take it for part of an image; remove it from the data", key=key,
                          offset=ref[2]))
            out.add(i)
        return out

    def _holds_reserved(self, ids: np.ndarray) -> bool:
        """Whether `ids` holds a vision token: one comparison pass per token (there are at most
        three), not `np.isin`, whose fixed cost was a tenth of the image path's Python time."""
        return any((ids == t).any() for t in self._reserved)

    def _frames(self, images: list[bytes]) -> list[Any]:
        """Each image's `(patch_frame, grid_h, grid_w)`, or the BadImage it raised: in `self.pool`'s
        processes, or here, where the frame is gathered while the image is in the cache."""
        from zephon_stream.vision.image import BadImage, load_image, patch_frame

        if self.pool is not None:
            return self.pool.decode(images, self.spec, self._at_once)
        out: list[Any] = []
        for data in images:
            try:
                image = load_image(data, self.spec)  # refuses a bomb from its header, before decoding
            except BadImage as exc:
                out.append(exc)
                continue
            p = self.spec.patch_size
            out.append((patch_frame(image, self.spec), image.shape[0] // p, image.shape[1] // p))
        return out

    def __call__(self, docs: list[tuple[Any, ImageRecord]], bad: BadRecords, key: str,
                 where: Callable[[int], str] | None = None) -> list[tuple[Any, ImageDoc]]:
        """Decode the images of `docs` (read from shard `key`), skipping or raising on a bad one
        as `bad` says, named at `where(offset)` (the reader's words: the sample's byte in the
        shard); tokenize the captions."""
        from zephon_stream.vision.image import BadImage

        images = []
        for (ref, rec), got in zip(docs, self._frames([rec.image for _, rec in docs])):
            try:
                if isinstance(got, BadImage):
                    raise got
                frame, gh, gw = got
                if gh * gw // self.spec.merge_size ** 2 + len(self.bos + self.start + self.end) >= self.seq_len:
                    raise BadImage(f"it takes {gh * gw // self.spec.merge_size ** 2} image tokens, more than "
                                   f"seq_len = {self.seq_len} holds")
                images.append((ref, rec, frame, (gh, gw)))
            except BadImage as exc:
                at = located(where, ref[2])
                bad(DataError(f"bad image {rec.member!r} in {key!r} (the sample at {at}): {exc}", key=key,
                              offset=ref[2]))
        captions = self.tokenizer.each([rec.text for _, rec, _, _ in images])  # see Tokenize.each
        dropped = self.holding_vision_tokens([(ref, c) for (ref, *_), c in zip(images, captions)], bad, key, where,
                                             lambda i: f"caption of sample {_sample_key(images[i][1].member)!r}")
        out = []
        before, after, bos = self.bos + self.start, self.end, len(self.bos)
        first = len(before)  # the BOS (if any) opens the document, before the image
        for i, ((ref, _, frame, (gh, gw)), caption) in enumerate(zip(images, captions)):
            if i in dropped:
                continue
            k = gh * gw // self.spec.merge_size ** 2
            span = first + k + len(after)
            ids = np.empty(span + len(caption) - bos, np.uint32)  # written in place: no list of k ints
            ids[:first] = before
            ids[first:first + k] = self.image_id
            ids[first + k:span] = after
            ids[span:] = caption[bos:]
            out.append((ref, ImageDoc(ids, frame, (1, gh, gw), span, (first, first + k))))
        return out



def _sample_key(member: str) -> str:
    """The sample key of a member name: up to the first '.' of its basename (as the tar reader cuts it)."""
    return member[:member.find(".", member.rfind("/") + 1)]


def mark_images(text: str, batch: dict[str, Any], row: int, vision: Any) -> str:
    """`text` (a decoded sample of `batch`, row `row`) with each run of image placeholders shown as
    `⟦image i: WxH px, grid TxHxW, k tokens⟧`, for `zephon inspect`."""
    grids = [g for g, r in zip(batch["image_grid_thw"].tolist(), batch["image_sample"].tolist()) if r == row]
    notes = iter(f"⟦image {i}: {w * vision.patch_size}x{h * vision.patch_size} px, grid {t}x{h}x{w}, "
                 f"{t * h * w // vision.merge_size ** 2} tokens⟧" for i, (t, h, w) in enumerate(grids))
    return re.sub(f"(?:{re.escape(vision.image_token)})+", lambda _: next(notes, "⟦image⟧"), text)
