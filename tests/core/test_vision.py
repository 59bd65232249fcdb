"""Image+text sources end to end: batches, exactly once, checkpoints, bad input, S3, config refusals.

The determinism matrix (tests/core/test_determinism.py) runs for the image+text config too.
"""

from __future__ import annotations

import hashlib
import io
import random
import re
import struct
import tarfile
import zlib
from pathlib import Path

import anyio
import msgspec
import numpy as np
import pytest
from PIL import Image

from tests.core.conftest import make_image
from zephon_stream import ConfigError, DataError
from zephon_stream.formats.tar import write_tar_shards
from zephon_stream.loader.config import Config, SourceConfig, VisionConfig
from zephon_stream.loader.loader import Loader
from zephon_stream.loader.state import state_to_bytes
from zephon_stream.operators.collate import sample_digests
from zephon_stream.operators.types import IGNORE
from zephon_stream.testing.determinism import run_world
from zephon_stream.vision.image import image_tokens


def _ids(config: Config) -> dict[str, int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(config.tokenizer)
    return {name: tok.token_to_id(name) for name in ("<|image_pad|>", "<|vision_start|>", "<|vision_end|>")}


def _images_only(config: Config) -> Config:
    return config.replace(sources=[config.sources[0]])


def test_batch_layout_spans_labels_and_types(vision_config):
    ids = _ids(vision_config)
    spec = vision_config.vision.image_spec()
    seen = 0
    for b, batch in enumerate(Loader(vision_config, backend="threads")):
        input_ids, labels, types = batch["input_ids"], batch["labels"], batch["mm_token_type_ids"]
        grids, owner = batch["image_grid_thw"], batch["image_sample"].tolist()
        assert batch["pixel_values"].dtype.is_floating_point is False
        assert batch["pixel_values"].shape == (int(grids.prod(dim=1).sum()), 3 * 2 * 14 * 14)
        assert (types == (input_ids == ids["<|image_pad|>"])).all()
        for row in range(len(input_ids)):
            starts = (input_ids[row] == ids["<|vision_start|>"]).nonzero().flatten().tolist()
            mine = [g for g, r in zip(grids.tolist(), owner) if r == row]
            assert len(starts) == len(mine)
            for at, (t, h, w) in zip(starts, mine):  # the whole span is in this row: never cut
                k = t * h * w // spec.merge_size ** 2
                assert input_ids[row, at + 1:at + 1 + k].eq(ids["<|image_pad|>"]).all()
                assert int(input_ids[row, at + 1 + k]) == ids["<|vision_end|>"]
                assert labels[row, max(at - 1, 0):at + k + 1].eq(IGNORE).all()  # no target inside the span
                seen += 1
        if b == 12:
            break
    assert seen > 100


def test_grid_matches_the_placeholder_count(vision_config):
    spec = vision_config.vision.image_spec()
    batch = next(iter(Loader(_images_only(vision_config), backend="inline")))
    pads = batch["mm_token_type_ids"].sum(dim=1).tolist()
    per_row = [0] * len(pads)
    for (t, h, w), row in zip(batch["image_grid_thw"].tolist(), batch["image_sample"].tolist()):
        per_row[row] += t * h * w // spec.merge_size ** 2
        assert image_tokens(h * spec.patch_size, w * spec.patch_size, spec) == h * w // spec.merge_size ** 2
    assert pads == per_row


@pytest.mark.parametrize("epochs", [1, 2])
def test_every_image_appears_once_per_epoch(vision_config, vision_dataset, epochs):
    _, data = vision_dataset
    cfg = _images_only(vision_config).replace(max_epochs=epochs)
    images = 0
    for batch in Loader(cfg, dp_size=2, dp_rank=0, backend="threads"):
        images += sum(d["images"] for d in sample_digests(batch))
    for batch in Loader(cfg, dp_size=2, dp_rank=1, backend="threads"):
        images += sum(d["images"] for d in sample_digests(batch))
    assert images == epochs * len(data["img"])


def test_image_read_ahead_is_bounded_by_decode_ahead(vision_config, monkeypatch):
    """An image source reads ahead at most `vision.decode_ahead` decoded images a lane, rounded up
    to whole decode calls, however large `doc_buffer` is (the text source beside it keeps
    `doc_buffer` calls): larger decode calls do not raise the memory bound."""
    from zephon_stream.operators import feed as feed_module
    from zephon_stream.operators.types import ImageDoc

    buffers, ahead = set(), [0]
    init, send = feed_module.Feed.__init__, feed_module.FeedSender.send

    def recording(self, produce, buffer, piece_tokens=0):
        buffers.add(buffer)
        init(self, produce, buffer, piece_tokens)

    async def counting(self, docs):
        await send(self, docs)
        if any(isinstance(d[1], ImageDoc) for d in docs):
            ahead[0] = max(ahead[0], self._feed._sent - self._feed.taken)

    monkeypatch.setattr(feed_module.Feed, "__init__", recording)
    monkeypatch.setattr(feed_module.FeedSender, "send", counting)
    vision = msgspec.structs.replace(vision_config.vision, decode_batch=3, decode_ahead=7)
    cfg = vision_config.replace(doc_buffer=16, vision=vision)
    for b, _ in enumerate(Loader(cfg, backend="threads")):
        if b == 30:
            break
    assert buffers == {3, 16}  # the image feeds: three calls of three (7 rounded up); the text feeds: doc_buffer
    assert 0 < ahead[0] <= 9


def test_batches_kept_alive_keep_their_pixels(vision_config):
    """The pixels' memory is pooled (collate.PixelBuffers): a consumer that holds every batch
    still sees each one as it was handed over, while later batches are made."""
    kept, digests = [], []
    for b, batch in enumerate(Loader(vision_config, backend="threads")):
        kept.append(batch["pixel_values"])
        digests.append(hashlib.sha256(batch["pixel_values"].numpy().tobytes()).hexdigest())
        if b == 7:
            break
    assert [hashlib.sha256(p.numpy().tobytes()).hexdigest() for p in kept] == digests
    assert len({p.data_ptr() for p in kept}) == len(kept)


def test_float32_pixels_are_normalised_uint8_pixels(vision_config):
    from zephon_stream.vision.image import normalize

    raw = next(iter(Loader(vision_config, backend="inline")))
    cfg = vision_config.replace(vision=msgspec.structs.replace(vision_config.vision, pixel_dtype="float32"))
    normed = next(iter(Loader(cfg, backend="inline")))
    assert normed["pixel_values"].dtype.is_floating_point
    assert normed["pixel_values"].equal(normalize(raw["pixel_values"]))
    assert normed["input_ids"].equal(raw["input_ids"])


def test_checkpoint_holds_no_pixels_and_stays_small(vision_config):
    loader = Loader(vision_config, backend="threads")
    for b, _ in enumerate(loader):
        if b == 8:
            break
    size = len(state_to_bytes(loader.state_dict()))
    assert size < 16 * 1024, f"checkpoint of 12 lanes is {size} bytes"


def test_s3_matches_local(vision_config, vision_dataset, dataset, s3, monkeypatch):
    root, _ = vision_dataset
    text_root, _ = dataset
    client = s3.client()
    for path in sorted((root / "img").glob("*.tar")) + sorted((text_root / "a").glob("*")):
        client.put_object(Bucket=s3.bucket, Key=f"data/{path.parent.name}/{path.name}", Body=path.read_bytes())
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3.options["access_key_id"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3.options["secret_access_key"])
    remote = vision_config.replace(sources=[
        msgspec.structs.replace(src, uri=f"s3://{s3.bucket}/data/{Path(src.uri).name}/",
                                endpoint_url=s3.options["endpoint_url"], region="us-east-1", addressing_style="path")
        for src in vision_config.sources])
    local = run_world(vision_config, 1, 6, backend="inline")[0]
    assert run_world(remote, 2, 6, backend="threads")[0] == local


# ---- config ------------------------------------------------------------------------------------

def test_refuses_a_seq_len_that_cannot_hold_an_image(vision_config):
    with pytest.raises(ConfigError, match=r"cannot hold one image: .* raise seq_len to >= 19 or lower "
                                          r"vision.max_pixels to <= 10192"):
        vision_config.replace(seq_len=16)


def test_refuses_image_source_without_vision_table(vision_config):
    with pytest.raises(ConfigError, match=r"image_field but there is no \[vision\] table"):
        vision_config.replace(vision=None)


def test_unknown_image_token_lists_the_special_tokens(vision_config):
    cfg = vision_config.replace(vision=msgspec.structs.replace(vision_config.vision, image_token="<image>"))
    with pytest.raises(ConfigError, match=r"vision.image_token '<image>' is not in the vocabulary .*<\|image_pad\|>"):
        next(iter(Loader(cfg, backend="inline")))


def test_vision_settings_change_the_order_digest(vision_config):
    other = vision_config.replace(vision=msgspec.structs.replace(vision_config.vision, max_pixels=28 * 28 * 8))
    fast = vision_config.replace(vision=msgspec.structs.replace(vision_config.vision, decode_batch=1, decode_ahead=5,
                                                                decode_threads=9))
    assert other.order_digest("t") != vision_config.order_digest("t")
    assert fast.order_digest("t") == vision_config.order_digest("t")


def test_toml_round_trip(vision_config, tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(vision_config.to_toml())
    assert Config.from_toml(path) == vision_config


# ---- bad input ---------------------------------------------------------------------------------

def _bomb_png(width: int = 30000, height: int = 30000) -> bytes:
    """A PNG whose header declares width x height (the IDAT is a few bytes: never decoded)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = chunk(b"IDAT", zlib.compress(b"\0" * 1024))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + idat + chunk(b"IEND", b"")


def _encoded(mode: str, fmt: str) -> bytes:
    out = io.BytesIO()
    Image.new(mode, (40, 30), 3 if mode == "P" else (10, 200, 30, 5)[:len(mode)]).save(out, fmt)
    return out.getvalue()


BAD_SAMPLES = {
    "bomb": ({"png": _bomb_png(), "txt": b"a bomb"}, r"30000.*30000|decompression"),
    "truncated image": ({"png": make_image(random.Random(1))[:200], "txt": b"cut"}, r"bad image '00000\d\.png'"),
    "not an image": ({"png": b"this is text, not a PNG" * 10, "txt": b"text"}, r"bad image '00000\d\.png'"),
    "no caption": ({"png": make_image(random.Random(2))}, r"has no caption member 'txt'"),
    "no image": ({"txt": b"a caption alone"}, r"has no image member"),
    "empty caption": ({"png": make_image(random.Random(3)), "txt": b"  "}, r"empty caption"),
}


def _shard_with(tmp_path: Path, bad: dict[str, bytes], n: int = 8) -> Path:
    rng = random.Random(5)
    samples = [(f"{i:06d}", {"png": make_image(rng), "txt": f"caption {i}".encode()}) for i in range(n)]
    samples[n // 2] = (f"{n // 2:06d}", bad)
    root = tmp_path / "bad"
    write_tar_shards(samples, root, prefix="bad")
    return root


def _one_source(config: Config, root: Path, **changes: object) -> Config:
    src = msgspec.structs.replace(config.sources[0], uri=f"file://{root}/")
    return config.replace(sources=[src], lanes=1, global_batch_size=1, max_epochs=1, **changes)


def _run(cfg: Config, backend: str = "threads") -> tuple[int, int]:
    loader = Loader(cfg, backend=backend)
    images = sum(sum(d["images"] for d in sample_digests(b)) for b in loader)
    return images, loader.statistics().skipped_records


@pytest.mark.parametrize("case", sorted(BAD_SAMPLES))
def test_bad_sample_is_an_error_naming_shard_and_member_or_a_counted_skip(vision_config, tmp_path, case):
    members, message = BAD_SAMPLES[case]
    root = _shard_with(tmp_path, members)
    with pytest.raises(DataError, match=message) as info:
        _run(_one_source(vision_config, root))
    assert "bad-00000.tar" in str(info.value) and info.value.key.endswith("bad-00000.tar")
    assert info.value.offset >= 0
    assert _run(_one_source(vision_config, root, on_bad_record="skip")) == (7, 1)


@pytest.mark.parametrize("text_field", ["txt", "json:caption"])
def test_a_deeply_nested_json_member_is_a_bad_sample_not_a_crash(vision_config, tmp_path, text_field):
    """A JSON member nested 1,000 deep raised RecursionError (from msgspec, in the error's hint of a
    sample without its caption, or in the caption's own decode), which ended a run in skip mode."""
    deep = b'{"a":' * 1000 + b'"x"' + b"}" * 1000
    rng = random.Random(6)
    samples = [(f"{i:06d}", {"png": make_image(rng), "json": msgspec.json.encode({"caption": f"c {i}"}),
                             "txt": b"t"}) for i in range(5)]
    samples[2] = ("000002", {"png": make_image(rng), "json": deep})
    write_tar_shards(samples, tmp_path / "deep", prefix="d")
    cfg = _one_source(vision_config, tmp_path / "deep")
    cfg = cfg.replace(sources=[msgspec.structs.replace(cfg.sources[0], text_field=text_field)])
    with pytest.raises(DataError, match=r"sample '000002' of 'd-00000.tar'"):
        _run(cfg)
    assert _run(cfg.replace(on_bad_record="skip")) == (4, 1)


def test_a_source_that_skips_says_so_once(vision_config, tmp_path, caplog):
    """Skip mode with a too-narrow image_field dropped 6 of a trial's 9 samples with no word but a
    count (and nothing at all under --digests): the first skip of each source is logged."""
    rng = random.Random(4)
    samples = [(f"{i:06d}", {"png" if i % 3 == 0 else "jpg": make_image(rng), "txt": b"c"}) for i in range(9)]
    write_tar_shards(samples, tmp_path / "narrow", prefix="n")
    cfg = _one_source(vision_config, tmp_path / "narrow", on_bad_record="skip")
    cfg = cfg.replace(sources=[msgspec.structs.replace(cfg.sources[0], image_field="png")])
    with caplog.at_level("WARNING", logger="zephon_stream.loader"):
        assert _run(cfg) == (3, 6)
    said = [r.getMessage() for r in caplog.records if getattr(r, "event", None) == "skipping"]
    assert len(said) == 1, said
    assert re.match(rf"source {cfg.sources[0].name!r} skips bad records \(on_bad_record = \"skip\"\); the first: "
                    r"sample '\d+' of 'n-00000.tar' at byte \d+ has no image member .* give image_field = "
                    r"'png;jpg'\)\. Each is counted in statistics\(\).skipped_records$", said[0]), said[0]


def test_a_caption_from_a_json_member_by_key_or_dotted_path(vision_config, tmp_path):
    """`text_field = "json:caption"` (webdataset's metadata member), or a dotted path into it."""
    rng = random.Random(8)
    meta = [{"caption": f"flat {i}"} if i % 2 else {"meta": {"caption": f"nested {i}"}} for i in range(6)]
    samples = [(f"{i:06d}", {"png": make_image(rng), "json": msgspec.json.encode(m)}) for i, m in enumerate(meta)]
    write_tar_shards(samples, tmp_path / "json", prefix="j")
    cfg = _one_source(vision_config, tmp_path / "json")
    flat = cfg.replace(sources=[msgspec.structs.replace(cfg.sources[0], text_field="json:caption")],
                       on_bad_record="skip")
    assert _run(flat) == (3, 3)
    nested = flat.replace(sources=[msgspec.structs.replace(cfg.sources[0], text_field="json:meta.caption")])
    assert _run(nested) == (3, 3)
    with pytest.raises(DataError, match=r"its 'json' member has no field 'meta.caption' \(text_field 'json:meta"):
        _run(nested.replace(on_bad_record="error"))


def _tiny_splits(config: Config, root: Path, **changes: object) -> Config:
    """One lane over splits of a sample or two, decode calls of up to 8 images."""
    vision = msgspec.structs.replace(config.vision, decode_batch=8, decode_ahead=8)
    return _one_source(config, root, vision=vision, split_bytes=1024).replace(**changes)


def test_an_image_source_whose_images_are_all_bad_is_an_error_not_a_spin(vision_config, tmp_path):
    """Every image is bad and skipped (in the decode calls, after parsing): the lane counts each
    split as empty all the same and checks the source, as for text, instead of reading forever."""
    samples = [(f"{i:06d}", {"png": b"this is text, not a PNG" * 10, "txt": b"text"}) for i in range(24)]
    write_tar_shards(samples, tmp_path / "allbad", prefix="allbad")
    cfg = _tiny_splits(vision_config, tmp_path / "allbad", on_bad_record="skip", max_epochs=0)

    async def first_batch():
        with anyio.fail_after(60):  # a producer that never counted a split as empty: no batch, no error
            async with Loader(cfg, backend="threads").open() as stream:
                return await stream.__anext__()

    with pytest.raises(DataError, match=r"source 'img' .* yields no document in a whole epoch .*: all 24 of its "
                                        r"records are bad and skipped"):
        anyio.run(first_batch)


@pytest.mark.parametrize(("mode", "fmt"), [("CMYK", "JPEG"), ("P", "PNG"), ("LA", "PNG"), ("L", "JPEG")])
def test_cmyk_palette_and_gray_images_are_converted(vision_config, tmp_path, mode, fmt):
    root = _shard_with(tmp_path, {"jpg" if fmt == "JPEG" else "png": _encoded(mode, fmt), "txt": b"converted"})
    assert _run(_one_source(vision_config, root)) == (8, 0)


def _tar_bytes(root: Path) -> bytes:
    return next(root.glob("*.tar")).read_bytes()


def test_truncated_tar_is_an_error_or_keeps_the_samples_before(vision_config, tmp_path):
    root = _shard_with(tmp_path, {"png": make_image(random.Random(4)), "txt": b"fine"})
    data = _tar_bytes(root)
    with tarfile.open(next(root.glob("*.tar"))) as tf:
        cut = tf.getmembers()[-2].offset_data + 100  # inside the last sample's image
    (root / "bad-00000.tar").write_bytes(data[:cut])
    with pytest.raises(DataError, match=r"bad-00000.tar"):
        _run(_one_source(vision_config, root))
    assert _run(_one_source(vision_config, root, on_bad_record="skip")) == (7, 1)


def test_member_over_max_record_bytes(vision_config, tmp_path):
    big = np.random.default_rng(0).integers(0, 256, (200, 200, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(big).save(out, "PNG")
    root = _shard_with(tmp_path, {"png": out.getvalue(), "txt": b"large"})
    limit = len(out.getvalue()) - 1
    with pytest.raises(DataError, match=rf"tar shard 'bad-00000.tar': member '000004.png' at byte \d+ of "
                                        rf"'bad-00000.tar' holds [\d,]+ bytes, more than max_record_bytes = "
                                        rf"{limit:,}: raise max_record_bytes"):
        _run(_one_source(vision_config, root, max_record_bytes=limit))
    images, skipped = _run(_one_source(vision_config, root, max_record_bytes=limit, on_bad_record="skip"))
    assert skipped == 1 and images == 7  # that sample alone (the index stopped there: the 3 after it were lost)
    two = _one_source(vision_config, root, max_record_bytes=limit, on_bad_record="skip").replace(max_epochs=2)
    assert _run(two) == (14, 2)  # once an epoch


def test_image_larger_than_the_decode_limit_is_refused_before_decoding(vision_config, tmp_path):
    cfg = vision_config.replace(vision=msgspec.structs.replace(vision_config.vision, max_decoded_pixels=100))
    root = _shard_with(tmp_path, {"png": make_image(random.Random(6)), "txt": b"x"})
    with pytest.raises(DataError, match=r"bad image"):
        _run(_one_source(cfg, root))


def test_vision_config_validation():
    with pytest.raises(ConfigError, match="vision.min_pixels"):
        VisionConfig(min_pixels=10_000, max_pixels=5_000)
    with pytest.raises(ConfigError, match=r"vision.max_pixels .* must hold one merged patch"):
        VisionConfig(min_pixels=10, max_pixels=100)


# ---- the command line and real data --------------------------------------------------------------

def test_cli_digests_carry_images_and_pixel_digests(vision_config, tmp_path, capsys):
    from zephon_stream.cli.main import main

    path = tmp_path / "v.toml"
    path.write_text(vision_config.to_toml())
    assert main(["stream", str(path), "--steps", "2", "--digests", "--backend", "inline"]) == 0
    lines = [msgspec.json.decode(line) for line in capsys.readouterr().out.splitlines()]
    expected = []
    for b, batch in enumerate(Loader(vision_config, backend="inline")):
        expected += sample_digests(batch)
        if b == 1:
            break
    keys = ("step", "slot", "lane", "tokens", "sha256", "images", "pixels_sha256")
    assert len(lines) == 2 * vision_config.global_batch_size
    assert [{k: d[k] for k in keys} for d in lines] == [{k: d[k] for k in keys} for d in expected]
    assert any(d["images"] > 0 for d in lines) and all((d["images"] > 0) == bool(d["pixels_sha256"]) for d in lines)


@pytest.fixture(scope="module")
def stamps(tmp_path_factory):
    """Tux Paint's stamps (real images with human-written captions) as tar shards, or a skip."""
    from tools.vlm import build_vlm_demo

    paths = build_vlm_demo(tmp_path_factory.mktemp("vlm"))
    if paths is None:
        pytest.skip("Tux Paint's stamps could not be fetched (apt-get download tuxpaint-stamps-default)")
    return paths


def test_real_stamps_stream_and_match_the_reference_processor(stamps):
    from transformers import Qwen2VLImageProcessorPil

    from tools.stamps import ensure_stamps, stamp_samples

    vision = VisionConfig(vision_start_token="<|vision_start|>", vision_end_token="<|vision_end|>",
                          max_pixels=28 * 28 * 64)
    source = SourceConfig(name="stamps", uri=f"file://{stamps.shards}/", image_field="png", text_field="txt")
    cfg = Config(seed=3, lanes=4, seq_len=512, global_batch_size=4, tokenizer=stamps.tokenizer, shuffle_window=0,
                 max_epochs=1, vision=vision, sources=[source])
    pngs = [m["png"] for _, m in stamp_samples(ensure_stamps())]
    ref = Qwen2VLImageProcessorPil(min_pixels=vision.min_pixels, max_pixels=vision.max_pixels,
                                   do_rescale=False, do_normalize=False)
    expected = set()
    for data in pngs[::20]:  # the reference's grid and pixels for every 20th real image
        out = ref(Image.open(io.BytesIO(data)), return_tensors="np")
        expected.add((tuple(out["image_grid_thw"][0].tolist()), out["pixel_values"].astype(np.uint8).tobytes()))
    images, found = 0, set()
    for batch in Loader(cfg, backend="threads"):
        sizes = batch["image_grid_thw"].prod(dim=1).tolist()
        starts = np.cumsum([0, *sizes])
        for i, grid in enumerate(batch["image_grid_thw"].tolist()):
            found.add((tuple(grid), batch["pixel_values"][starts[i]:starts[i + 1]].numpy().tobytes()))
        images += len(sizes)
    assert images == len(pngs) == stamps.images
    assert expected <= found  # each reference image is in the stream, with its grid, byte for byte


def test_inspect_marks_each_image_with_its_size_and_grid(vision_config, tmp_path, capsys):
    from zephon_stream.cli.main import main

    path = tmp_path / "v.toml"
    cfg = vision_config.replace(sources=[vision_config.sources[0]])
    path.write_text(cfg.to_toml())
    assert main(["inspect", str(path), "--step", "1", "--backend", "inline"]) == 0
    out = capsys.readouterr().out
    batch = list(zip(range(2), Loader(cfg, backend="inline")))[1][1]
    for t, h, w in batch["image_grid_thw"].tolist():
        assert f"px, grid {t}x{h}x{w}, {t * h * w // 4} tokens⟧" in out
    assert out.count("⟦image ") == len(batch["image_grid_thw"]) and "<|image_pad|>" not in out


@pytest.mark.parametrize("backend", ["threads", "processes"])
def test_pillow_s_load_truncated_images_is_refused_not_obeyed(vision_config, tmp_path, monkeypatch, backend):
    # with the flag (set in the trainer's main(), as LLaVA-style code does) a truncated image was
    # decoded into made-up pixels on threads, and a bad record on processes (workers without it)
    from PIL import ImageFile

    from zephon_stream.vision.image import load_image

    root = _shard_with(tmp_path, BAD_SAMPLES["truncated image"][0])
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    with pytest.raises(ConfigError, match=r"PIL\.ImageFile\.LOAD_TRUNCATED_IMAGES is True in this process: .* set it "
                                          r"back to False"):
        next(iter(Loader(_one_source(vision_config, root, on_bad_record="skip"), backend=backend)))
    with pytest.raises(ConfigError, match="LOAD_TRUNCATED_IMAGES"):
        load_image(make_image(random.Random(1)), vision_config.vision.image_spec())


# Pillow's PNG text limits as a trainer raises them for data with large text chunks (defaults 1 MiB, 64 MiB)
RAISED_PNG_TEXT_LIMITS = (8 << 20, 64 << 20)


def png_text_config(vision_config: Config, root: Path) -> Config:
    """One source of 8 images, one a PNG with 3 MB of text (a few KB compressed): past Pillow's
    default MAX_TEXT_CHUNK, a bad image, skipped; under `RAISED_PNG_TEXT_LIMITS`, decoded (the Ray
    child's case too)."""
    from PIL import PngImagePlugin

    info = PngImagePlugin.PngInfo()
    info.add_text("comment", "x" * (3 << 20), zip=True)
    png = io.BytesIO()
    Image.new("RGB", (64, 48), (10, 20, 30)).save(png, "PNG", pnginfo=info)
    return _one_source(vision_config, _shard_with(root, {"png": png.getvalue(), "txt": b"a caption"}),
                       on_bad_record="skip")


@pytest.mark.parametrize("backend", ["threads", "processes"])
def test_pillow_s_png_text_limits_are_the_trainer_s_on_every_backend(vision_config, tmp_path, monkeypatch, backend):
    # the trainer raised the limits: the image decoded on threads (in its process), and was a bad image
    # on processes, whose lane workers decoded under Pillow's defaults (Ray's: test_ray.py)
    from PIL import PngImagePlugin

    cfg = png_text_config(vision_config, tmp_path)
    assert _run(cfg, backend) == (7, 1)
    monkeypatch.setattr(PngImagePlugin, "MAX_TEXT_CHUNK", RAISED_PNG_TEXT_LIMITS[0])
    monkeypatch.setattr(PngImagePlugin, "MAX_TEXT_MEMORY", RAISED_PNG_TEXT_LIMITS[1])
    assert _run(cfg, backend) == (8, 0)


def test_text_that_holds_a_vision_token_s_text_is_a_bad_record(vision_config, tmp_path):
    # "<|image_pad|>" in a caption or a text document became the image token's id: a placeholder
    # without an image, which a Qwen2-VL model counts against the image's features
    root = _shard_with(tmp_path, {"png": make_image(random.Random(4)), "txt": b"look <|image_pad|> here"})
    with pytest.raises(DataError, match=r"bad caption of sample '000004' in 'bad-00000.tar' at byte \d+: its text "
                                        r"holds '<\|image_pad\|>', which only an image span may"):
        _run(_one_source(vision_config, root))
    assert _run(_one_source(vision_config, root, on_bad_record="skip")) == (7, 1)
    (tmp_path / "text").mkdir()
    lines = [{"text": "plain words"}, {"text": "a <|vision_start|> b <|image_pad|> c"}, {"text": "more plain words"}]
    (tmp_path / "text" / "t.jsonl").write_bytes(b"".join(msgspec.json.encode(r) + b"\n" for r in lines))
    text = SourceConfig(name="t", uri=f"file://{tmp_path}/text/")
    cfg = vision_config.replace(sources=[text], lanes=1, global_batch_size=1, max_epochs=1)
    with pytest.raises(DataError, match=r"bad document in 't.jsonl' at byte 23: its text holds '<\|image_pad\|>', "
                                        r"'<\|vision_start\|>'"):
        list(Loader(cfg, backend="threads"))
    loader = Loader(cfg.replace(on_bad_record="skip"), backend="threads")
    ids = np.concatenate([b["input_ids"].flatten().numpy() for b in loader])
    vision_ids = [loader.tokenizer.token_id(t, t) for t in ("<|image_pad|>", "<|vision_start|>")]
    assert loader.statistics().skipped_records == 1 and not np.isin(ids, vision_ids).any()


def test_image_source_mistakes_say_what_to_change(vision_config, dataset, tmp_path):
    text_root, _ = dataset
    on_text = msgspec.structs.replace(vision_config.sources[0], uri=f"file://{text_root}/a/")
    with pytest.raises(ConfigError, match=r"no \*\.tar or \*\.parquet objects under .* \(it holds \*\.jsonl: 3\); "
                                          r"image_field makes it an image\+text source: remove image_field to read it "
                                          r"as text"):
        next(iter(Loader(vision_config.replace(sources=[on_text]), backend="inline")))
    # compressed tar shards: named, with the command that makes them readable
    (tmp_path / "gz").mkdir()
    (tmp_path / "gz" / "s-0.tar.gz").write_bytes(b"\x1f\x8b not read")
    on_gz = msgspec.structs.replace(vision_config.sources[0], uri=f"file://{tmp_path}/gz/")
    with pytest.raises(ConfigError, match=r"\(it holds \*\.tar\.gz: 1\); image shards are read as plain tar .*: "
                                          r"decompress them, e\.g\. `gunzip \*\.tar\.gz`"):
        next(iter(Loader(vision_config.replace(sources=[on_gz]), backend="inline")))
    # members of two samples interleaved: each sample then lacks a member, which the tar holds
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in [("a.png", make_image(random.Random(1))), ("b.png", make_image(random.Random(2))),
                           ("a.txt", b"first"), ("b.txt", b"second")]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "m.tar").write_bytes(buf.getvalue())
    with pytest.raises(DataError, match=r"sample '[ab]' .* has no caption member 'txt' \(it has png; a sample's "
                                        r"members follow one another in the tar"):
        _run(_one_source(vision_config, tmp_path / "mixed"))


@pytest.mark.parametrize(("members", "fields", "fix"), [
    ({"jpg": "image", "txt": b"a jpeg"}, {"image_field": "png"},
     r"has no image member \(looked for png; it has jpg, txt: to read its jpg too, give image_field = 'png;jpg'\)"),
    ({"png": "image", "json": b'{"url": "u", "caption": "a cat", "n": 3}'}, {},
     r"has no caption member 'txt' \(it has json, png: for a field of its json member, give text_field = "
     r"'json:caption' \(its string fields: url, caption\)\)"),
    ({"png": "image", "txt": b"a caption"}, {"text_field": "text"},
     r"has no caption member 'text' \(it has png, txt: give text_field = 'txt' to read its txt member\)"),
])
def test_a_missing_member_names_the_setting_that_reads_what_the_sample_has(vision_config, tmp_path, members,
                                                                          fields, fix):
    """A new user's own shards: JPEGs under image_field = "png", a JSON caption, `.txt` captions
    under the default text_field. The error listed the members and said they must follow one
    another in the tar, which was not the cause; it names the setting now."""
    sample = {k: make_image(random.Random(1)) if v == "image" else v for k, v in members.items()}
    write_tar_shards([("000000", sample)], tmp_path / "own", prefix="own")
    cfg = _one_source(vision_config, tmp_path / "own")
    cfg = cfg.replace(sources=[msgspec.structs.replace(cfg.sources[0], **fields)])
    with pytest.raises(DataError, match=fix):
        _run(cfg)


def test_vision_tokens_of_their_own_and_a_json_caption_field_with_a_name(vision_config):
    # each was accepted: a start token equal to the image token gave one more placeholder than the image has
    with pytest.raises(ConfigError, match=r"vision.vision_start_token = '<\|image_pad\|>': is the image_token"):
        msgspec.structs.replace(vision_config.vision, vision_start_token="<|image_pad|>")
    with pytest.raises(ConfigError, match=r"vision.vision_end_token = '<\|vision_start\|>': is the vision_start_token"):
        msgspec.structs.replace(vision_config.vision, vision_start_token="<|vision_start|>",
                                vision_end_token="<|vision_start|>")
    with pytest.raises(ConfigError, match=r"text_field = 'json:': names the caption member"):
        msgspec.structs.replace(vision_config.sources[0], text_field="json:")


def test_a_sample_key_ends_at_the_first_dot_of_the_member_name():
    from zephon_stream.operators.images import _sample_key

    assert _sample_key("000004.png") == "000004"
    assert _sample_key("000004.0.png") == "000004"  # the extension "0.png", as the tar reader cuts it
    assert _sample_key("a.b/c/000004.seg.png") == "a.b/c/000004"
