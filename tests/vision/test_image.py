"""zephon_stream.vision.image against Hugging Face's Qwen2VLImageProcessorPil, and on bad input.

The reference is `transformers` (a test-only dependency; no weights, no torchvision). For real
images (Debian's documentation PNGs, see conftest) and generated ones (odd sizes, every colour
mode the decoder meets), under several settings:

- `patchify(load_image(b))` equals the processor's `pixel_values` with do_rescale=False and
  do_normalize=False (which are the uint8 values, in float32): exactly;
- `grid` equals `image_grid_thw[1:]`, `image_tokens` equals prod(grid) // merge_size**2;
- `normalize(patchify(...))` equals the processor's default (normalised float32) output with
  tolerance 0: the same bits.
"""

from __future__ import annotations

import concurrent.futures
import functools
import io
import struct
import subprocess
import sys
import time
import warnings
import zlib
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from zephon_stream.errors import ConfigError
from zephon_stream.vision import (
    FORMATS,
    BadImage,
    ImageSpec,
    grid,
    image_size,
    image_tokens,
    load_image,
    normalize,
    patchify,
)

qwen2_vl = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")

SPECS = {
    "default": ImageSpec(),
    "small-max": ImageSpec(max_pixels=28 * 28 * 16),
    "min-upscales": ImageSpec(min_pixels=448 * 448, max_pixels=448 * 448 * 2),
    "merge-1": ImageSpec(merge_size=1, min_pixels=14 * 14 * 4, max_pixels=14 * 14 * 300),
    "patch-16": ImageSpec(patch_size=16, temporal_patch_size=2, min_pixels=32 * 32 * 4, max_pixels=32 * 32 * 256),
    "temporal-1": ImageSpec(temporal_patch_size=1, max_pixels=28 * 28 * 64),
}


# ------------------------------------------------------------------------------ image makers


def encode(im: Image.Image, fmt: str, **params: object) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **params)
    return buf.getvalue()


def gradient(width: int, height: int, seed: int = 0) -> np.ndarray:
    """uint8 [H, W, 3]: smooth ramps plus noise, so that resampling has something to get wrong."""
    y, x = np.mgrid[0:height, 0:width]
    noise = np.random.default_rng(seed).integers(0, 40, (height, width, 3))
    ramps = np.stack([x * 255 // max(width - 1, 1), y * 255 // max(height - 1, 1), (x + y) % 256], axis=-1)
    return np.clip(ramps + noise, 0, 255).astype(np.uint8)


def generated_images() -> dict[str, bytes]:
    """Every colour mode and a spread of sizes; each must come out as the reference makes it."""
    rgb = Image.fromarray(gradient(500, 375))
    alpha = Image.fromarray(gradient(64, 48, 1)[..., 0])
    rgba = Image.fromarray(gradient(64, 48, 2)).convert("RGBA")
    rgba.putalpha(alpha)
    sixteen = Image.fromarray((np.arange(120 * 90, dtype=np.uint16).reshape(90, 120) * 7))  # I;16, > 255
    palette = rgb.quantize(16)
    transparent = palette.copy()
    transparent.info["transparency"] = 3
    return {
        "rgb-png-500x375": encode(rgb, "PNG"),
        "noise-png-37x1001": encode(Image.fromarray(gradient(37, 1001, 3)), "PNG"),
        "tiny-png-5x5": encode(Image.fromarray(gradient(5, 5, 4)), "PNG"),
        "rgba-png": encode(rgba, "PNG"),
        "la-png": encode(Image.merge("LA", [alpha, alpha.transpose(Image.Transpose.FLIP_LEFT_RIGHT)]), "PNG"),
        "palette-png": encode(palette, "PNG"),
        "palette-transparent-png": encode(transparent, "PNG", transparency=3),
        "gray-jpeg": encode(rgb.convert("L"), "JPEG", quality=90),
        "rgb-jpeg-640x480": encode(Image.fromarray(gradient(640, 480, 5)), "JPEG", quality=85),
        "cmyk-jpeg": encode(Image.fromarray(gradient(90, 70, 6)).convert("CMYK"), "JPEG", quality=95),
        "i16-png": encode(sixteen, "PNG"),
        "gif": encode(palette, "GIF"),
        "webp-lossless": encode(Image.fromarray(gradient(123, 77, 7)), "WEBP", lossless=True),
        "bmp": encode(Image.fromarray(gradient(61, 59, 8)), "BMP"),
        "jpeg-exif": encode(Image.fromarray(gradient(64, 48, 9)), "JPEG", exif=exif()),
        "apng-2-frames": encode(Image.fromarray(gradient(40, 30, 12)), "PNG", save_all=True,
                                append_images=[Image.fromarray(gradient(40, 30, 13))]),
        "mpo-2-frames": encode(Image.fromarray(gradient(96, 64, 10)), "MPO", save_all=True,
                               append_images=[Image.fromarray(gradient(96, 64, 11))]),
    }


def exif() -> Image.Exif:
    """Orientation 6 (not applied, as by the reference), a maker, and a resolution Pillow reads when
    the JFIF header has none."""
    tags = Image.Exif()
    tags[0x0112], tags[0x010F], tags[0x011A], tags[0x0128] = 6, "Camera", 72.0, 2
    return tags


GENERATED = generated_images()


@functools.cache
def processor(spec: ImageSpec) -> object:
    return qwen2_vl.Qwen2VLImageProcessorPil(
        patch_size=spec.patch_size, merge_size=spec.merge_size, temporal_patch_size=spec.temporal_patch_size,
        min_pixels=spec.min_pixels, max_pixels=spec.max_pixels,
    )


def reference(data: bytes, spec: ImageSpec, *, raw: bool) -> tuple[np.ndarray, tuple[int, int, int]]:
    """The processor's (pixel_values, image_grid_thw) for the image Pillow opens from data."""
    kwargs = {"do_rescale": False, "do_normalize": False} if raw else {}
    with Image.open(io.BytesIO(data)) as im:
        out = processor(spec)(images=[im], **kwargs)
    (thw,) = out["image_grid_thw"].tolist()
    return np.asarray(out["pixel_values"]), tuple(thw)


def reference_pixels(height: int, width: int, spec: ImageSpec) -> int:
    """The pixel count of HF's own smart_resize."""
    h, w = qwen2_vl.smart_resize(height, width, factor=spec.factor, min_pixels=spec.min_pixels,
                                 max_pixels=spec.max_pixels)
    return h * w


def assert_matches_reference(data: bytes, spec: ImageSpec) -> None:
    height, width = image_size(data, spec)
    ref_pixels, (t, gh, gw) = reference(data, spec, raw=True)
    if reference_pixels(height, width, spec) > spec.max_pixels:  # the one place we refuse what HF takes
        with pytest.raises(BadImage, match="above vision.max_pixels"):
            load_image(data, spec)
        return
    ours = patchify(load_image(data, spec), spec)
    assert (t, ours.dtype) == (1, np.uint8)
    assert grid(height, width, spec) == (gh, gw)
    assert image_tokens(height, width, spec) == gh * gw // spec.merge_size ** 2
    assert ours.shape == ref_pixels.shape == (gh * gw, spec.row_size)
    np.testing.assert_array_equal(ours.astype(np.float32), ref_pixels)


# ------------------------------------------------------------------------- reference equality


@pytest.mark.parametrize("setting", SPECS)
@pytest.mark.parametrize("name", GENERATED)
def test_generated_images_match_the_hf_processor(name: str, setting: str) -> None:
    assert_matches_reference(GENERATED[name], SPECS[setting])


@pytest.mark.parametrize("setting", SPECS)
def test_real_images_match_the_hf_processor(real_images: list[Path], setting: str) -> None:
    for path in real_images:
        assert_matches_reference(path.read_bytes(), SPECS[setting])


@pytest.mark.parametrize("setting", ["default", "patch-16", "temporal-1"])
@pytest.mark.parametrize("name", ["rgb-png-500x375", "rgba-png", "cmyk-jpeg", "tiny-png-5x5"])
def test_normalize_is_bit_identical_to_the_hf_processor(name: str, setting: str) -> None:
    spec = SPECS[setting]
    expected, _ = reference(GENERATED[name], spec, raw=False)
    got = normalize(torch.from_numpy(patchify(load_image(GENERATED[name], spec), spec)))
    assert got.dtype == torch.float32
    assert torch.equal(got, torch.from_numpy(expected))  # tolerance 0


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")),
])
def test_normalize_covers_every_byte_value_of_every_channel(device: str) -> None:
    """All 3 x 256 (channel, value) pairs, against transformers' own rescale and normalize: an output
    value depends on nothing else, so this proves bit-equality on the device for any image."""
    from transformers.image_transforms import normalize as hf_normalize
    from transformers.image_transforms import rescale as hf_rescale
    from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, ChannelDimension

    values = np.broadcast_to(np.arange(256, dtype=np.uint8), (3, 256)).copy()  # [C, 256]: a 1 x 256 image
    expected = hf_normalize(hf_rescale(values[:, None, :], 1 / 255), OPENAI_CLIP_MEAN, OPENAI_CLIP_STD,
                            input_data_format=ChannelDimension.FIRST)[:, 0, :]
    got = normalize(torch.from_numpy(values.reshape(1, 3 * 256)).to(device))
    assert got.device.type == device
    assert torch.equal(got.cpu().view(3, 256), torch.from_numpy(expected))


def test_normalize_refuses_what_is_not_uint8_rows() -> None:
    with pytest.raises(ValueError, match="uint8 patch rows"):
        normalize(torch.zeros((4, 1176), dtype=torch.float32))
    with pytest.raises(ValueError, match="uint8 patch rows"):
        normalize(torch.zeros((4, 1175), dtype=torch.uint8))
    with pytest.raises(ValueError, match="3 means"):
        normalize(torch.zeros((1, 6), dtype=torch.uint8), mean=(0.5,), std=(0.5,))


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 4000), st.integers(1, 4000), st.sampled_from(list(SPECS)))
def test_grid_is_hf_smart_resize_or_a_refusal_with_the_reason(height: int, width: int, setting: str) -> None:
    spec = SPECS[setting]
    if max(height, width) / min(height, width) > 200:
        with pytest.raises(BadImage, match="aspect ratio"):
            grid(height, width, spec)
        return
    h, w = qwen2_vl.smart_resize(height, width, factor=spec.factor, min_pixels=spec.min_pixels,
                                 max_pixels=spec.max_pixels)
    if h * w > spec.max_pixels:
        with pytest.raises(BadImage, match="above vision.max_pixels"):
            grid(height, width, spec)
        return
    gh, gw = grid(height, width, spec)
    assert (gh * spec.patch_size, gw * spec.patch_size) == (h, w)
    assert gh % spec.merge_size == 0 and gw % spec.merge_size == 0
    assert image_tokens(height, width, spec) <= spec.max_pixels // spec.factor ** 2  # the config's bound


def test_the_max_pixels_refusal_is_reachable_and_hf_goes_over() -> None:
    """Under a small max_pixels, an extreme aspect ratio makes HF exceed max_pixels; we refuse it."""
    spec = SPECS["small-max"]
    assert reference_pixels(37, 1001, spec) > spec.max_pixels
    with pytest.raises(BadImage, match=r"1001x37 would be resized to .* above vision.max_pixels = 12544"):
        grid(37, 1001, spec)


def test_patch_rows_follow_the_merge_order() -> None:
    """Without the reference: pixel values that encode their position land where Qwen2-VL reads them."""
    spec = ImageSpec(patch_size=2, merge_size=2, temporal_patch_size=2, min_pixels=16, max_pixels=64)
    y, x = np.mgrid[0:4, 0:8]
    image = np.stack([y * 10 + x, y * 10 + x + 100, np.full_like(x, 200)], axis=-1).astype(np.uint8)
    rows = patchify(image, spec)
    assert rows.shape == (8, 3 * 2 * 2 * 2)
    # row 1 is the second patch of the first 2x2 merge block: image rows 0-1, columns 2-3
    np.testing.assert_array_equal(rows[1, :8].reshape(2, 2, 2), [[[2, 3], [12, 13]]] * 2)
    # row 4 starts the second merge block: image rows 0-1, columns 4-5; its green channel after red
    np.testing.assert_array_equal(rows[4, 8:16].reshape(2, 2, 2), [[[104, 105], [114, 115]]] * 2)
    np.testing.assert_array_equal(rows[:, 16:], 200)


def test_patchify_refuses_an_image_that_load_image_did_not_make() -> None:
    with pytest.raises(ValueError, match="multiples of 28"):
        patchify(np.zeros((30, 28, 3), np.uint8), ImageSpec())
    with pytest.raises(ValueError, match="uint8"):
        patchify(np.zeros((28, 28, 3), np.float32), ImageSpec())


# --------------------------------------------------------------------------- colour modes


def test_palette_image_is_converted_to_its_colours() -> None:
    palette = Image.new("P", (56, 56))
    palette.putpalette([255, 0, 0, 0, 255, 0, 0, 0, 255] + [0] * (256 * 3 - 9))
    palette.paste(1, (28, 0, 56, 56))
    palette.paste(2, (0, 28, 28, 56))
    out = load_image(encode(palette, "PNG"), ImageSpec(min_pixels=56 * 56, max_pixels=56 * 56))
    assert out.shape == (56, 56, 3)
    np.testing.assert_array_equal(out[0, 0], [255, 0, 0])
    np.testing.assert_array_equal(out[0, 55], [0, 255, 0])
    np.testing.assert_array_equal(out[55, 0], [0, 0, 255])


@pytest.mark.parametrize("mode", ["RGBA", "LA", "PA"])
def test_transparency_onto_white_equals_the_reference_for_every_value_and_alpha(mode: str) -> None:
    """`_to_rgb` pastes through the alpha mask instead of the reference's `alpha_composite`: over
    opaque white a byte depends only on (value, alpha), so all 65,536 pairs prove them equal."""
    from transformers.image_transforms import convert_to_rgb

    from zephon_stream.vision.image import _to_rgb

    value, alpha = np.meshgrid(np.arange(256, dtype=np.uint8), np.arange(256, dtype=np.uint8))
    bands = {"RGBA": [value, 255 - value, value // 2, alpha], "LA": [value, alpha], "PA": [value, alpha]}[mode]
    im = Image.fromarray(np.stack(bands, -1), "RGBA" if mode == "RGBA" else "LA")
    if mode == "PA":
        im = Image.merge("PA", [Image.fromarray(value, "L").convert("P"), Image.fromarray(alpha, "L")])
        im.putpalette([x for i in range(256) for x in (i, 255 - i, i // 3)])
    ours = _to_rgb(im)
    assert ours.mode == "RGB"
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(convert_to_rgb(im)))


def test_a_transparent_palette_index_becomes_white() -> None:
    palette = Image.new("P", (28, 28))
    palette.putpalette([10, 20, 30, 200, 100, 50] + [0] * (256 * 3 - 6))
    palette.paste(1, (0, 0, 28, 14))
    out = load_image(encode(palette, "PNG", transparency=1), ImageSpec(min_pixels=28 * 28, max_pixels=28 * 28))
    np.testing.assert_array_equal(out[0, 0], [255, 255, 255])  # the transparent index, onto white
    np.testing.assert_array_equal(out[27, 0], [10, 20, 30])


@pytest.mark.parametrize(("cmyk", "rgb"), [((0, 0, 0, 0), (255, 255, 255)), ((255, 0, 0, 0), (0, 255, 255)),
                                           ((0, 255, 0, 0), (255, 0, 255)), ((0, 0, 0, 255), (0, 0, 0))])
def test_cmyk_image_is_converted_to_rgb(cmyk: tuple[int, ...], rgb: tuple[int, ...]) -> None:
    data = encode(Image.new("CMYK", (56, 56), cmyk), "JPEG", quality=100)
    assert Image.open(io.BytesIO(data)).mode == "CMYK"
    out = load_image(data, ImageSpec(min_pixels=56 * 56, max_pixels=56 * 56))
    assert np.abs(out.astype(int) - rgb).max() <= 2  # JPEG is lossy, even on a flat colour


def test_sixteen_bit_values_are_clipped_as_the_reference_clips_them() -> None:
    spec = ImageSpec(min_pixels=28 * 28, max_pixels=28 * 28)
    data = encode(Image.fromarray(np.full((28, 28), 1000, np.uint16)), "PNG")
    assert Image.open(io.BytesIO(data)).mode == "I;16"
    np.testing.assert_array_equal(load_image(data, spec), 255)


# ------------------------------------------------------------------------------- bad input


def _png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


@functools.cache
def png_bomb(side: int = 30_000) -> bytes:
    """A valid 1-bit PNG of side x side pixels, all zero: ~110 KB that decode to side^2 pixels."""
    z = zlib.compressobj(9)
    rows = bytes((1 + (side + 7) // 8) * 1000)  # a filter byte and the packed bits, 1000 rows at a time
    body = b"".join(z.compress(rows) for _ in range(side // 1000)) + z.flush()
    header = struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", header) + _png_chunk(b"IDAT", body) + _png_chunk(b"IEND", b"")


def gif_header(screen: tuple[int, int], frame: tuple[int, int]) -> bytes:
    """A GIF whose first frame may overflow its screen (Pillow grows the canvas to the frame)."""
    return (b"GIF89a" + struct.pack("<HHBBB", *screen, 0, 0, 0) + b"!\xfe\x03abc\x00"  # a comment extension
            + b"," + struct.pack("<HHHHB", 0, 0, *frame, 0) + b"\x02\x02\x44\x01\x00;")


@pytest.mark.parametrize("what", [image_size, load_image])
@pytest.mark.parametrize("bomb", ["png-30000x30000", "gif-screen-65535", "gif-frame-20000", "gif-frame-10000"])
def test_a_decompression_bomb_is_refused_from_its_header(what: object, bomb: str) -> None:
    data = {"png-30000x30000": png_bomb(), "gif-screen-65535": gif_header((65535, 65535), (1, 1)),
            "gif-frame-20000": gif_header((1, 1), (20000, 20000)),
            "gif-frame-10000": gif_header((1, 1), (10000, 10000))}[bomb]
    assert len(data) < 120_000
    load_image(GENERATED["tiny-png-5x5"], ImageSpec())  # Pillow's plugins loaded: their one-off allocations done
    allocated = Image.core.get_stats()["new_count"]
    start = time.perf_counter()
    with pytest.raises(BadImage, match=r"more than vision\.max_decoded_pixels = 33554432; refused before decoding"):
        what(data, ImageSpec())
    assert time.perf_counter() - start < 1.0
    assert Image.core.get_stats()["new_count"] == allocated  # Pillow made no image memory at all


def test_the_bomb_limit_is_ours_not_pillows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pillow's process-wide limit neither refuses what vision.max_decoded_pixels allows nor warns
    (the suite turns warnings into errors), whatever it was set to."""
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    assert image_size(png_bomb(10_000), ImageSpec(max_decoded_pixels=10_000 ** 2)) == (10_000, 10_000)
    assert Image.MAX_IMAGE_PIXELS == 10_000 ** 2  # raised to ours, so its checks inside decoders stay quiet
    assert image_size(gif_header((1, 1), (9000, 9000)), ImageSpec(max_decoded_pixels=10_000 ** 2)) == (9000, 9000)
    with pytest.raises(BadImage, match="max_decoded_pixels = 99999999"):
        image_size(png_bomb(10_000), ImageSpec(max_decoded_pixels=10_000 ** 2 - 1))
    assert Image.MAX_IMAGE_PIXELS == 10_000 ** 2  # never lowered
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", None)  # switched off by the application: left off
    image_size(GENERATED["bmp"], ImageSpec())
    assert Image.MAX_IMAGE_PIXELS is None


def test_a_truncated_png_has_a_size_but_does_not_decode() -> None:
    data = GENERATED["rgb-png-500x375"]
    cut = data[: len(data) // 2]
    assert image_size(cut, ImageSpec()) == (375, 500)  # the header is intact
    with pytest.raises(BadImage, match=r"cannot decode the PNG image \(RGB 500x375\): .*truncated"):
        load_image(cut, ImageSpec())


def test_a_truncated_jpeg_does_not_decode() -> None:
    data = GENERATED["rgb-jpeg-640x480"]
    with pytest.raises(BadImage, match=r"cannot decode the JPEG image .*truncated"):
        load_image(data[: len(data) * 2 // 3], ImageSpec())


def test_a_corrupt_jpeg_is_refused_with_pillows_reason() -> None:
    data = bytearray(GENERATED["rgb-jpeg-640x480"])
    sof = data.index(b"\xff\xc0")
    data[sof + 5: sof + 9] = b"\x00\x00\x00\x00"  # height and width 0 in the frame header
    with pytest.raises(BadImage, match="JPEG"):
        load_image(bytes(data), ImageSpec())
    huffman = GENERATED["rgb-jpeg-640x480"].index(b"\xff\xc4")
    broken = bytearray(GENERATED["rgb-jpeg-640x480"])
    broken[huffman + 5: huffman + 21] = b"\xff" * 16  # the Huffman table's 16 code counts: an impossible table
    with pytest.raises(BadImage, match="cannot decode the JPEG image"):
        load_image(bytes(broken), ImageSpec())


def test_a_jpeg_with_damaged_exif_decodes_without_a_warning() -> None:
    data = bytearray(GENERATED["jpeg-exif"])
    ifd0 = data.index(b"Exif\0\0") + 6 + 8
    data[ifd0: ifd0 + 2] = b"\xff\xff"  # 65535 entries in the first directory
    with pytest.warns(UserWarning, match="Corrupt EXIF data"):  # what Pillow alone makes of it
        Image.open(io.BytesIO(bytes(data)))
    np.testing.assert_array_equal(load_image(bytes(data), ImageSpec()), load_image(GENERATED["jpeg-exif"], ImageSpec()))


def test_a_png_with_a_damaged_animation_control_decodes_its_default_image_without_a_warning() -> None:
    data = bytearray(GENERATED["apng-2-frames"])
    actl = data.index(b"acTL")
    data[actl + 4: actl + 8] = bytes(4)  # 0 frames
    data[actl + 12: actl + 16] = struct.pack(">I", zlib.crc32(bytes(data[actl: actl + 12])))
    with pytest.warns(UserWarning, match="Invalid APNG"):  # what Pillow alone makes of it
        Image.open(io.BytesIO(bytes(data)))
    with Image.open(io.BytesIO(GENERATED["apng-2-frames"])) as first:
        assert first.n_frames == 2
        expected = np.asarray(first.convert("RGB"))
    spec = ImageSpec(min_pixels=28 * 28, max_pixels=56 * 28)  # 40x30 becomes 28x28
    np.testing.assert_array_equal(load_image(bytes(data), spec), np.asarray(
        Image.fromarray(expected).resize((28, 28), Image.Resampling.BICUBIC)))


def test_a_png_with_a_bad_checksum_is_refused() -> None:
    data = bytearray(GENERATED["rgb-png-500x375"])
    idat = data.index(b"IDAT")
    data[idat + 100] ^= 0xFF
    with pytest.raises(BadImage, match="PNG"):
        load_image(bytes(data), ImageSpec())


@pytest.mark.parametrize(("data", "reason"), [
    (b"", "empty"),
    (b"hello, world: this is a caption, not an image\n" * 3, "not an image of a known format"),
    (b"%PDF-1.4\n%\xe2\xe3\xcf\xd3\n", "not an image of a known format"),
    (b"\x89PNG\r\n\x1a\n", "unreadable PNG header"),
    (b"GIF89a\x01\x00", "unreadable GIF header"),
])
def test_non_image_bytes_are_refused(data: bytes, reason: str) -> None:
    for what in (image_size, load_image):
        with pytest.raises(BadImage, match=reason):
            what(data, ImageSpec())


@pytest.mark.parametrize("fmt", ["ICO", "PPM", "TGA", "TIFF"])
def test_formats_outside_the_list_are_refused_though_pillow_reads_them(fmt: str) -> None:
    assert fmt not in FORMATS
    data = encode(Image.fromarray(gradient(32, 32)), fmt)
    Image.open(io.BytesIO(data)).load()  # Pillow would take it
    with pytest.raises(BadImage, match="not an image of a known format"):
        load_image(data, ImageSpec())


def test_an_aspect_ratio_qwen_refuses_is_refused_before_decoding() -> None:
    data = encode(Image.new("RGB", (2010, 10)), "PNG")
    load_image(GENERATED["tiny-png-5x5"], ImageSpec())  # Pillow's plugins loaded
    allocated = Image.core.get_stats()["new_count"]
    with pytest.raises(BadImage, match="aspect ratio of 201.0, above the 200"):
        load_image(data, ImageSpec())
    assert Image.core.get_stats()["new_count"] == allocated


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["rgb-png-500x375", "gif", "rgb-jpeg-640x480", "webp-lossless", "bmp", "jpeg-exif",
                        "mpo-2-frames", "apng-2-frames", "palette-transparent-png", "cmyk-jpeg"]),
       st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 255)), min_size=1, max_size=8),
       st.booleans(), st.floats(0.05, 1))
def test_damaged_bytes_give_an_image_or_bad_image_and_nothing_else(
    name: str, edits: list, in_header: bool, keep: float,
) -> None:
    """Not a warning either (the suite makes warnings errors): what a file gives must not depend on
    the process's warning filters."""
    data = bytearray(GENERATED[name])
    span = min(len(data), 600) if in_header else len(data)  # the headers and metadata, or anywhere
    for where, value in edits:
        data[int(where * span)] = value
    data = data[: max(1, int(len(data) * keep))]
    spec = SPECS["small-max"]
    try:
        out = load_image(bytes(data), spec)
    except BadImage:
        return
    assert out.dtype == np.uint8 and out.ndim == 3 and out.shape[2] == 3
    assert out.shape[0] % spec.factor == 0 and out.shape[1] % spec.factor == 0
    assert out.shape[0] * out.shape[1] <= spec.max_pixels


def test_no_pillow_warning_escapes_on_any_generated_image() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for data in GENERATED.values():
            load_image(data, ImageSpec())


# ----------------------------------------------------------------------------- the spec


@pytest.mark.parametrize("field", ImageSpec.__struct_fields__)
@pytest.mark.parametrize("value", [0, -3, True, 2.0])
def test_every_spec_field_must_be_a_whole_number_from_one(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=rf"config vision\.{field} = {value!r}: must be a whole number >= 1"):
        ImageSpec(**{field: value})


def test_min_pixels_must_not_exceed_max_pixels() -> None:
    with pytest.raises(ConfigError, match=r"vision\.min_pixels = 5000: must be <= vision\.max_pixels = 4000"):
        ImageSpec(min_pixels=5000, max_pixels=4000)


def test_max_pixels_must_hold_one_merged_patch() -> None:
    with pytest.raises(ConfigError, match=r"vision\.max_pixels = 1000: must hold one merged patch.* = 1024"):
        ImageSpec(patch_size=16, min_pixels=1, max_pixels=1000)
    assert ImageSpec(patch_size=16, min_pixels=1, max_pixels=1024).factor == 32


def test_the_spec_is_frozen_strict_plain_data() -> None:
    spec = msgspec.convert({"patch_size": 16, "max_pixels": 1 << 20}, ImageSpec)
    assert (spec.patch_size, spec.factor, spec.row_size) == (16, 32, 3 * 2 * 16 * 16)
    with pytest.raises(msgspec.ValidationError, match="unknown field"):
        msgspec.convert({"patch": 16}, ImageSpec)
    with pytest.raises(AttributeError):
        setattr(spec, "patch_size", 14)  # noqa: B010 (the point is the assignment)
    with pytest.raises(msgspec.ValidationError, match="max_pixels = 100"):
        msgspec.convert({"max_pixels": 100}, ImageSpec)


def test_lane_side_functions_load_neither_torch_nor_pillow_at_import() -> None:
    """A lane worker decodes and patchifies without torch (its processes must stay free of it); the
    package itself imports neither, so a config that only names [vision] costs nothing."""
    code = (
        "import sys\n"
        "import zephon_stream.vision as v\n"
        "assert 'torch' not in sys.modules and 'PIL' not in sys.modules, 'imported at import time'\n"
        "spec = v.ImageSpec()\n"
        f"rows = v.patchify(v.load_image({GENERATED['tiny-png-5x5']!r}, spec), spec)\n"
        "assert rows.shape == (16, 1176), rows.shape  # 5x5 upscaled to min_pixels: 56x56\n"
        "assert 'torch' not in sys.modules, 'load_image or patchify imported torch'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).parents[2], check=False)
    assert proc.returncode == 0, proc.stderr


def test_decoding_in_threads_gives_the_sequential_bytes() -> None:
    """Lanes decode in worker threads: no shared state may leak between concurrent decodes."""
    spec = SPECS["small-max"]
    names = [n for n in GENERATED if n != "noise-png-37x1001"] * 3  # that one is refused under small-max
    expected = {n: patchify(load_image(GENERATED[n], spec), spec).tobytes() for n in set(names)}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda n: patchify(load_image(GENERATED[n], spec), spec).tobytes(), names))
    assert got == [expected[n] for n in names]


def test_pixels_are_a_view_of_the_image_that_outlives_it() -> None:
    """`pixels` reads an RGB image's memory in place (Arrow's C data interface) instead of copying
    it under the GIL: the same bytes as `np.asarray`, read-only, valid after the image is gone and
    its memory could be reused; an image Pillow keeps in more than one block is copied."""
    import gc

    from zephon_stream.vision.image import pixels

    rng = np.random.default_rng(0)
    views, copies = [], []
    for i in range(40):
        im = Image.fromarray(rng.integers(0, 256, (14 * (1 + i % 5), 28 * (1 + i % 3), 3), dtype=np.uint8))
        view = pixels(im)
        assert isinstance(view.base, np.ndarray) and not view.flags.writeable
        copies.append(np.asarray(im).copy())
        del im
        gc.collect()
        [Image.new("RGB", (64, 64), (i, i, i)) for _ in range(4)]  # allocations that may take the freed memory
        views.append(view)
    assert all(v.shape == c.shape and (v == c).all() for v, c in zip(views, copies))
    large = Image.new("RGB", (3000, 2000), (1, 2, 3))  # 24 MB in Pillow's 16 MiB blocks: not one piece
    out = pixels(large)
    assert out.shape == (2000, 3000, 3) and (out == (1, 2, 3)).all()
    assert pixels(Image.new("L", (28, 28))).shape == (28, 28)  # not RGB: as np.asarray gives it
