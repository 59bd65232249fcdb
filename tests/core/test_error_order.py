"""With `on_bad_record = "error"`, which bad record a run raises, and at which batch, is a function
of (config, seed, data), like the order: not of which lane's thread met its bad record first.

Several lanes each meet bad records (text: malformed JSON lines, a corrupt zstd frame; images:
a corrupt image and a caption missing). Every run, whatever the backend, buffer sizes, tokenizer
and decode calls' sizes, injected read latency, or resume, raises the same DataError after the
same number of batches. Before, the first lane to reach its bad record stopped the run, so the
record named changed between identical runs."""

from __future__ import annotations

import random

import msgspec
import pytest
import zstandard

from zephon_stream import DataError
from zephon_stream.formats.tar import write_tar_shards
from zephon_stream.loader.config import SourceConfig
from zephon_stream.loader.loader import BatchStream, Loader
from zephon_stream.operators.types import LaneFailure
from zephon_stream.testing.stores import WithLatency

from .conftest import make_docs, make_image


def _line(text: str) -> bytes:
    return msgspec.json.encode({"text": text}) + b"\n"


def _text_shards(root, rng: random.Random) -> None:
    """Eight shards of 60 documents; six of them hold a bad record somewhere past their middle."""
    root.mkdir()
    for k in range(8):
        lines = [_line(t) for t in make_docs(rng, 60, 40)]
        if k in (1, 2, 4, 5):
            lines.insert(rng.randrange(30, 60), b'{"text": "unterminated\n')
        if k == 3:
            lines.insert(rng.randrange(30, 60), b'{"body": "no text field"}\n')
        if k == 6:  # a corrupt frame: its records and the ones after it in the shard are not read
            c = zstandard.ZstdCompressor(write_checksum=True)
            frames = [c.compress(b"".join(lines[i:i + 7])) for i in range(0, len(lines), 7)]
            frames[6] = frames[6][:-1] + bytes([frames[6][-1] ^ 0xFF])
            (root / f"s{k}.jsonl.zst").write_bytes(b"".join(frames))
            continue
        (root / f"s{k}.jsonl").write_bytes(b"".join(lines))


def bad_text_config(config, root):
    """`config` over the bad text shards, written under `root` (also the Ray child's error case)."""
    _text_shards(root / "bad", random.Random(5))
    return config.replace(sources=[SourceConfig(name="bad", uri=f"file://{root}/bad/")], lanes=6,
                          global_batch_size=6, shuffle_window=4, split_bytes=2048, max_epochs=1)


@pytest.fixture()
def text_config(config, tmp_path):
    return bad_text_config(config, tmp_path)


def first_errors(cfg, *, backend="threads", dp_size=1, wrap_store=None, resume_at=None):
    """(batches each rank made before its error, that error's text), the world's ranks one after another;
    with `resume_at`, rank 0 alone stops after that many batches and a new loader goes on from its state."""
    out = []
    for rank in range(dp_size):
        loader, made = Loader(cfg, dp_rank=rank, dp_size=dp_size, backend=backend, wrap_store=wrap_store), 0
        try:
            for _ in loader:
                made += 1
                if resume_at is not None and made == resume_at:
                    state = loader.state_dict()
                    loader.close()
                    loader = Loader(cfg, backend=backend, wrap_store=wrap_store)
                    loader.load_state_dict(state)
                    for _ in loader:
                        made += 1
                    break
        except DataError as exc:
            out.append((made, str(exc)))
            continue
        out.append((made, None))
    return out


def _variants(cfg):
    tiny = cfg.replace(sample_buffer=1, doc_buffer=1, sample_batch=1, tokenize_batch=1, cpu_threads=1)
    large = cfg.replace(sample_buffer=16, doc_buffer=16, sample_batch=8, tokenize_batch=512, cpu_threads=4)
    return [
        dict(cfg=cfg, backend="inline"),
        dict(cfg=tiny, backend="threads", wrap_store=WithLatency(seed=1, max_ms=3)),
        dict(cfg=large, backend="threads", wrap_store=WithLatency(seed=2, max_ms=3)),
        dict(cfg=cfg, backend="threads", wrap_store=WithLatency(seed=3, max_ms=6)),
        dict(cfg=cfg, backend="processes", wrap_store=WithLatency(seed=4, max_ms=3)),
    ]


def test_text_the_same_error_after_the_same_batches(text_config):
    reference = first_errors(text_config, backend="inline")
    made, message = reference[0]
    assert message is not None and made > 0, reference  # an error, after some batches
    for variant in _variants(text_config):
        cfg = variant.pop("cfg")
        assert first_errors(cfg, **variant) == reference, variant
    assert first_errors(text_config, resume_at=made // 2) == reference  # resumed before it: the same error, same batch


def test_text_ranks_raise_their_first_error_in_the_order(text_config):
    """Each rank raises the first bad sample in its own slots; the earliest of them is the world's."""
    (made, message), = first_errors(text_config, backend="inline")
    ranks = first_errors(text_config, dp_size=3)
    assert min(ranks)[0] == made and (made, message) in ranks, ranks
    assert first_errors(text_config, dp_size=3, backend="processes") == ranks


def test_skip_mode_is_unchanged_and_runs_to_the_end(text_config):
    """Skipping, the same data runs to its end (the in-band error is error mode's alone)."""
    cfg = text_config.replace(on_bad_record="skip")
    loader = Loader(cfg)
    assert sum(1 for _ in loader) > 0
    assert loader.statistics().skipped_records >= 5


def _bad_png() -> bytes:
    good = make_image(random.Random(1))
    return good[:len(good) // 2]  # truncated: a corrupt image, found by the decode (the tokenize step)


@pytest.fixture()
def image_config(vision_config, tmp_path):
    """Four tar shards of 40 images and captions; three hold a truncated PNG, one a sample without a caption."""
    rng = random.Random(7)
    captions = make_docs(rng, 160, 20)
    root = tmp_path / "img"
    root.mkdir()
    for s in range(4):
        samples = []
        for i in range(40):
            key, members = f"{s:02d}{i:04d}", {"png": make_image(rng), "txt": captions[s * 40 + i].encode()}
            if i == 25 + 4 * s and s != 2:
                members["png"] = _bad_png()
            if s == 2 and i == 31:
                del members["txt"]
            samples.append((key, members))
        write_tar_shards(samples, root, prefix=f"img{s}")
    src = msgspec.structs.replace(vision_config.sources[0], uri=f"file://{root}/", weight=1.0)
    return vision_config.replace(sources=[src], lanes=4, global_batch_size=4, shuffle_window=2, split_bytes=4096,
                                 max_epochs=1)


def test_images_the_same_error_after_the_same_batches(image_config):
    reference = first_errors(image_config, backend="inline")
    made, message = reference[0]
    assert message is not None and made > 0, reference
    vision = image_config.vision
    variants = [
        (image_config.replace(vision=msgspec.structs.replace(vision, decode_batch=1, decode_ahead=1)), "threads", 1),
        (image_config.replace(vision=msgspec.structs.replace(vision, decode_batch=16, decode_ahead=64)), "threads", 2),
        (image_config, "processes", 3),
    ]
    for cfg, backend, seed in variants:
        latency = WithLatency(seed=seed, max_ms=4)
        assert first_errors(cfg, backend=backend, wrap_store=latency) == reference, (backend, seed)


def test_a_failure_is_not_kept_by_set_weights_rewinding(text_config, monkeypatch):
    """set_weights for a step after the one a lane's failure waits at rewinds the lanes to their
    states there: the failure, received already, is dropped (it holds no state to go on from),
    and the lane, run again from its last sample, meets the record again."""
    cfg = text_config.replace(sample_batch=8)  # the failure comes behind samples: it waits in the sequencer
    reference = first_errors(cfg, backend="inline")
    made, message = reference[0]
    pending = []
    rewind = BatchStream._rewind

    async def counting(self, step):
        pending.append(sum(isinstance(s, LaneFailure) for queue in self.pending.values() for s in queue))
        return await rewind(self, step)

    monkeypatch.setattr(BatchStream, "_rewind", counting)
    loader, got = Loader(cfg), 0
    with pytest.raises(DataError) as caught:
        for _ in loader:
            got += 1
            if got == made:
                loader.set_weights({"bad": 1.0}, at_step=got + 2)
    assert (got, str(caught.value)) == (made, message)
    assert pending == [1]  # the rewind found the failure waiting, and dropped it


# ---- one split read in many parts: the records before the error do not follow the read sizes -------


def _one_split_config(config, root, files, **more):
    """One lane over `files` (name -> bytes) in one split, samples one at a time."""
    root.mkdir()
    for name, data in files.items():
        (root / name).write_bytes(data)
    return config.replace(sources=[SourceConfig(name="one", uri=f"file://{root}/", **more)], lanes=1,
                          global_batch_size=1, shuffle_window=0, split_bytes=1 << 20, sample_batch=1, max_epochs=1)


def _reads(cfg):
    """The runs that read the split in parts of other sizes: local, and read ahead 1, 2 and 16 requests."""
    yield dict(cfg=cfg)
    for ahead in (1, 2, 16):
        yield dict(cfg=cfg.replace(read_ahead=ahead), wrap_store=WithLatency(seed=ahead, max_ms=0))


def _frames(lines: list[bytes], per: int, compress) -> list[bytes]:
    return [compress(b"".join(lines[i:i + per])) for i in range(0, len(lines), per)]


@pytest.mark.parametrize("kind", ["zst", "gz"])
def test_a_corrupt_frame_after_many_gives_the_same_batches_whatever_the_read_sizes(config, tmp_path, kind):
    """A decoder that raised at a corrupt frame dropped the frames decoded before it in the same
    call, whose size follows the read sizes: 0, 162 or 220 batches before the error."""
    import gzip

    lines = [_line(t) for t in make_docs(random.Random(3), 420, 30)]
    if kind == "zst":
        c = zstandard.ZstdCompressor(write_checksum=True)
        frames = _frames(lines, 7, c.compress)
        frames[40] = frames[40][:-1] + bytes([frames[40][-1] ^ 0xFF])
    else:
        frames = _frames(lines, 7, lambda b: gzip.compress(b, mtime=0))
        frames[40] = frames[40][:20] + bytes(8) + frames[40][28:]
    cfg = _one_split_config(config, tmp_path / "one", {f"s.jsonl.{kind}": b"".join(frames)})
    runs = {str(v.get("wrap_store") and v["cfg"].read_ahead): first_errors(**v) for v in _reads(cfg)}
    assert len(set(map(str, runs.values()))) == 1, runs
    (made, message), = runs["None"]
    assert message is not None and made > 100, runs  # the 280 documents of the 40 frames before it are packed


def test_a_transform_error_gives_the_same_batches_whatever_the_read_sizes(config, tmp_path):
    """A transform's error (raised in any mode) dropped the block's earlier records: 0 or 119 batches."""
    from tests.core.transform_fns import raises_on_boom
    from zephon_stream.operators.transforms import Map

    docs = make_docs(random.Random(4), 300, 40)
    lines = [_line(t + (" BOOM" if i == 150 else "")) for i, t in enumerate(docs)]
    cfg = _one_split_config(config, tmp_path / "one", {"s.jsonl": b"".join(lines)})
    runs = []
    for variant in _reads(cfg):
        loader, made = Loader(variant["cfg"], transforms={"one": [Map(raises_on_boom)]},
                              wrap_store=variant.get("wrap_store")), 0
        with pytest.raises(DataError) as caught:
            for _ in loader:
                made += 1
        runs.append((made, str(caught.value)))
    assert len(set(runs)) == 1 and runs[0][0] > 50, runs


def test_a_parquet_string_that_is_not_utf8_is_named_by_its_row(config, tmp_path):
    """A string page with bytes that are not UTF-8 named the block's first row, and the rows before
    the bad one were lost with it (a resumed run, whose block starts at its cursor, lost fewer)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    raw = [t.encode() for t in make_docs(random.Random(3), 200, 40)]
    raw[150] = b"bad \xff text"
    root = tmp_path / "p"
    root.mkdir()
    pq.write_table(pa.table({"text": pa.array(raw, pa.binary()).view(pa.string())}), root / "a.parquet",
                   row_group_size=200, compression="none")
    cfg = _one_split_config(config, tmp_path / "unused", {}).replace(
        sources=[SourceConfig(name="one", uri=f"file://{root}/")])
    (made, message), = first_errors(cfg)
    assert "row 150 of row group 0 holds a string that is not UTF-8" in message and made > 50, message
    assert first_errors(cfg, resume_at=made // 2) == [(made, message)]


def test_a_bad_parquet_row_before_a_string_that_is_not_utf8_comes_first(config, tmp_path):
    """The page's error came before the rows' own checks: a null row 40 before a bad string at row 70
    was dropped unsaid (error mode: row 70 named, rows 41-69 handed out; skip mode: row 40 uncounted)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    def write(root, utf8_bad):
        raw = [t.encode() for t in make_docs(random.Random(3), 120, 30)]
        raw[40] = None
        if utf8_bad:
            raw[70] = b"bad \xff text"
        root.mkdir()
        pq.write_table(pa.table({"text": pa.array(raw, pa.binary()).view(pa.string())}), root / "a.parquet",
                       row_group_size=120, compression="none")
        return _one_split_config(config, root.with_name(root.name + "-unused"), {}).replace(
            sources=[SourceConfig(name="one", uri=f"file://{root}/")])

    (made, message), = first_errors(write(tmp_path / "null", False))
    assert "row 40 of row group 0: the value is null" in message
    (made_too, message_too), = first_errors(write(tmp_path / "both", True))
    assert made_too == made and message_too.replace("/both/", "/null/") == message
    loader = Loader(write(tmp_path / "skip", True).replace(on_bad_record="skip"))
    with pytest.raises(DataError, match="row 70 of row group 0 holds a string that is not UTF-8"):
        for _ in loader:
            pass
    assert loader.statistics().skipped_records == 1  # row 40, counted before the page's error


def test_images_two_bad_in_one_decode_call_name_the_first(image_config, tmp_path):
    """A bad image's decode call handed out the documents after it too: the second bad image was named."""
    rng = random.Random(9)
    captions = make_docs(rng, 60, 20)
    samples = [(f"{i:05d}", {"png": _bad_png() if i in (10, 30) else make_image(rng), "txt": captions[i].encode()})
               for i in range(60)]
    root = tmp_path / "two"
    root.mkdir()
    write_tar_shards(samples, root, prefix="two")
    src = msgspec.structs.replace(image_config.sources[0], uri=f"file://{root}/")
    cfg = image_config.replace(sources=[src], lanes=1, global_batch_size=1, split_bytes=1 << 24, sample_batch=1)
    runs = [first_errors(cfg.replace(vision=msgspec.structs.replace(cfg.vision, decode_batch=n)))
            for n in (1, 3, 8, 32)]
    assert len({str(r) for r in runs}) == 1, runs
    assert "'00010.png'" in runs[0][0][1], runs


def test_statistics_while_a_failure_waits(text_config):
    """A failure held in the sequencer's queue or a lane's buffer: statistics() (zephon stream calls it
    every batch) raised AttributeError on it."""
    loader, made = Loader(text_config.replace(sample_batch=8)), 0
    with pytest.raises(DataError):
        for _ in loader:
            made += 1
            assert loader.statistics().buffered_bytes >= 0
    assert made == first_errors(text_config.replace(sample_batch=8), backend="inline")[0][0]
