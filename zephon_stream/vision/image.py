"""One image from bytes to patch rows, exactly as Qwen2-VL's Hugging Face processor makes them.

```
bytes ──image_size──▶ (H, W) from the header; refused above max_decoded_pixels (a bomb), before decoding
      ──load_image──▶ uint8 [H', W', 3] RGB, H' and W' multiples of factor = patch_size * merge_size
      ──patchify────▶ uint8 [grid_h * grid_w, 3 * temporal_patch_size * patch_size²]
      (on the device) ──normalize──▶ float32, (x / 255 - mean) / std, the CLIP constants
```

Worked example with the defaults (patch 14, merge 2, temporal 2, so factor 28): a 500 x 375
(W x H) photo rounds to 504 x 364, inside [min_pixels, max_pixels] = [3136, 200704], so
`grid(375, 500) == (26, 36)`: 936 patch rows of 3 * 2 * 14 * 14 = 1176 values, and
`image_tokens == 936 // 2**2 == 234` placeholders in the text. The rows come in merge order,
each 2 x 2 block of neighbouring patches consecutive, which is what Qwen2-VL's merger expects.

What is matched, and how (`transformers` 5.x, `Qwen2VLImageProcessorPil`, checked by
tests/vision/test_image.py for equality):

- RGB conversion as `transformers.image_transforms.convert_to_rgb`: an image with an alpha band
  or a `transparency` entry (RGBA, LA, PA, P with a transparent index) is composited onto white;
  every other mode (L, P, CMYK, I;16, I, F, YCbCr) goes through Pillow's `convert("RGB")`. So
  16-bit and float images are clipped to [0, 255] as the reference clips them, and CMYK uses
  Pillow's colour-profile-free conversion. The EXIF orientation is not applied (the reference
  does not apply it to an image it is handed). Of a multi-frame file (GIF, APNG, WebP) the first
  frame is used.
- The size is `smart_resize` to the letter (Python's round-half-even included), and the resize
  is Pillow's BICUBIC with no `reducing_gap`, from the uint8 RGB image.
- The patch order is the reference's transpose `(gh, gw, mh, mw, C, T, ph, pw)`.

Two refusals the reference does not make, both so that the loader's bounds hold: a source
image above `max_decoded_pixels` (the reference would decode it), and a size that
`smart_resize` pushes above `max_pixels` (it can, when the short side floors to zero for an
extreme aspect ratio under a small `max_pixels`). With the second, `max_pixels // factor**2`
is a true upper bound on one image's placeholders, which the config checks against `seq_len`.

Design choice: pixels stay uint8 through the loader and are normalised on the device. A
uint8 row is a quarter of the float32 row, so the bounded buffers hold four times the images
for the same memory, the lanes' inter-process hand-off and the host-to-device copy move a
quarter of the bytes, and the batch's `pixels_sha256` digests are over the decoded bytes, not
over floats. Normalising on the device (`normalize`) is three elementwise operations, which
cost nothing next to the vision encoder; they are done in the reference's own float
arithmetic, so the result is bit-identical to the processor's float32 output, not just close.

Bad input raises `BadImage` (a `ValueError`) with the reason and no location: the caller knows
the shard, member and offset and wraps it into a `DataError`. Only the formats in `FORMATS`
are opened, so Pillow's rarer parsers (EPS runs Ghostscript, ICO can hide a larger PNG than
its directory says, TIFF meets damaged tags with warnings) never see the loader's data.
Likewise a JPEG's Exif, XMP and MPF segments and an APNG's animation chunks are dropped
before Pillow opens the file: they do not change the first frame's pixels, and damage in them
would come out as a warning, whose effect depends on the process's warning filters (the MPF
also makes a file an MPO, whose first frame is the JPEG).

Pillow's own decompression-bomb check (`PIL.Image.MAX_IMAGE_PIXELS`, a warning above it, an
error above twice it) is process-wide. Here the header is parsed by the format's plugin
directly (a GIF's first frame, which can grow the canvas, is read first), and
`max_decoded_pixels` decides; Pillow's limit is raised to at least the largest
`max_decoded_pixels` in use (never lowered, never disabled), so its checks inside decoders stay
as a second line that cannot fire on an image this module accepted.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import io
import math
import struct
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from zephon_stream.engine.forks import ForkLock
from zephon_stream.errors import ConfigError

if TYPE_CHECKING:
    from PIL import Image as PILImage

__all__ = [
    "FORMATS",
    "IMAGE_MEAN",
    "IMAGE_STD",
    "MAX_ASPECT_RATIO",
    "BadImage",
    "ImageSpec",
    "check_pillow_settings",
    "grid",
    "image_size",
    "image_tokens",
    "load_image",
    "normalize",
    "patch_frame",
    "patch_rows",
    "patchify",
    "pixels",
]

#: OpenAI CLIP's per-channel mean and std (transformers' OPENAI_CLIP_MEAN / OPENAI_CLIP_STD), as Qwen2-VL uses.
IMAGE_MEAN: tuple[float, float, float] = (0.48145466, 0.4578275, 0.40821073)
IMAGE_STD: tuple[float, float, float] = (0.26862954, 0.26130258, 0.27577711)

#: The image formats that are opened (Pillow's format names), tried in this order.
FORMATS: tuple[str, ...] = ("PNG", "JPEG", "WEBP", "GIF", "BMP")

#: Qwen2-VL's smart_resize refuses images whose long side exceeds this multiple of the short side.
MAX_ASPECT_RATIO = 200

# Errors Pillow raises for data it cannot parse or decode (an unrecognised header is SyntaxError).
_PILLOW_DATA_ERRORS: tuple[type[BaseException], ...] = (
    SyntaxError, OSError, ValueError, EOFError, IndexError, TypeError, struct.error,
)


class BadImage(ValueError):
    """The bytes are not an image this loader can take. The message says why, without location:
    the caller names the shard, member and offset."""


class ImageSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How images are sized and cut (Qwen2-VL conventions); the `[vision]` settings that shape pixels."""

    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 3136
    max_pixels: int = 200704
    max_decoded_pixels: int = 1 << 25  # source width x height (33.5 Mpx), checked from the header before decoding

    def __post_init__(self) -> None:
        for name in ImageSpec.__struct_fields__:  # a subclass (the loader's VisionConfig) checks its own fields
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                _refuse(name, value, "must be a whole number >= 1")
        if self.min_pixels > self.max_pixels:
            _refuse("min_pixels", self.min_pixels, f"must be <= vision.max_pixels = {self.max_pixels}: "
                    "lower min_pixels or raise max_pixels")
        if self.max_pixels < self.factor ** 2:
            _refuse("max_pixels", self.max_pixels, "must hold one merged patch, (patch_size * merge_size)^2 = "
                    f"{self.factor ** 2}: raise max_pixels or lower patch_size or merge_size")

    @property
    def factor(self) -> int:
        """Resized sides are multiples of this: the side of one merged patch."""
        return self.patch_size * self.merge_size

    @property
    def row_size(self) -> int:
        """Values in one patch row of `patchify`: 3 * temporal_patch_size * patch_size^2."""
        return 3 * self.temporal_patch_size * self.patch_size ** 2


def _refuse(name: str, value: object, why: str) -> None:
    raise ConfigError(f"config vision.{name} = {value!r}: {why}")


# ------------------------------------------------------------------------------------ header


def image_size(data: bytes, spec: ImageSpec) -> tuple[int, int]:
    """(height, width) of the image in `data`, read from its header only; refuses a bomb.

    Raises `BadImage` for bytes that no format in `FORMATS` recognises, a header Pillow cannot
    parse, or a source larger than `spec.max_decoded_pixels` pixels.
    """
    with contextlib.closing(_open(data, spec)) as im:
        return im.size[1], im.size[0]


def check_pillow_settings() -> None:
    """Refuse Pillow's `ImageFile.LOAD_TRUNCATED_IMAGES = True` (a process-wide setting that
    LLaVA-style training code often sets): Pillow then decodes a truncated or corrupt image into
    made-up pixels (and skips checksums in PNG headers), where this module makes it a bad image.
    Which images are bad would then depend on a global outside the config, and differ between
    the threads backend (decoding in the trainer's process) and processes (in workers that
    may not have it set)."""
    from PIL import ImageFile

    if ImageFile.LOAD_TRUNCATED_IMAGES:
        raise ConfigError(
            "PIL.ImageFile.LOAD_TRUNCATED_IMAGES is True in this process: Pillow would decode a truncated or "
            "corrupt image into made-up pixels, where the loader makes it a bad record (a DataError, or a "
            "counted skip with on_bad_record = \"skip\"), and the batches would depend on a setting outside the "
            "config; set it back to False before streaming images (`from PIL import ImageFile; "
            "ImageFile.LOAD_TRUNCATED_IMAGES = False`)")


def png_text_limits() -> tuple[int, int]:
    """Pillow's process-wide PNG text limits here (`PngImagePlugin.MAX_TEXT_CHUNK`, `MAX_TEXT_MEMORY`).

    A PNG whose text chunks pass them is a bad image; trainers raise them for data with large
    text chunks. A decode in another process (decode workers, the processes backend's and Ray's
    lane workers) runs under the trainer's limits, taken with `png_text_limits` and set there
    with `use_png_text_limits`: an image is bad in every backend or in none."""
    from PIL import PngImagePlugin

    return PngImagePlugin.MAX_TEXT_CHUNK, PngImagePlugin.MAX_TEXT_MEMORY


def use_png_text_limits(limits: tuple[int, int]) -> None:
    """Set this process's PNG text limits to another process's `png_text_limits()`."""
    from PIL import PngImagePlugin

    PngImagePlugin.MAX_TEXT_CHUNK, PngImagePlugin.MAX_TEXT_MEMORY = limits


def _open(data: bytes, spec: ImageSpec) -> PILImage.Image:
    """Parse the header with the plugin of the first format in `FORMATS` that accepts the bytes.

    This is `PIL.Image.open` without its process-wide bomb check: `_check_size` decides instead.
    """
    image = _pil()
    check_pillow_settings()
    _raise_pillow_limit(spec.max_decoded_pixels)
    if not isinstance(data, (bytes, bytearray)):
        raise TypeError(f"image data must be bytes, got {type(data).__name__}")
    prefix = bytes(data[:16])
    if not prefix:
        raise BadImage("the image is empty (0 bytes)")
    for fmt in FORMATS:
        factory, accept = image.OPEN[fmt]
        accepted = accept is None or accept(prefix)
        if not accepted or isinstance(accepted, str):  # a str is Pillow's "nearly, but not this format"
            continue
        if fmt == "GIF":
            _check_pixels(*_gif_canvas(data), fmt, spec)
        if fmt == "JPEG":
            data = _jpeg_without_metadata(data)
        elif fmt == "PNG":
            data = _png_without_animation(data)
        try:
            im = factory(io.BytesIO(data), "")
        except image.DecompressionBombError as exc:  # a plugin's own check, the second line
            raise BadImage(f"{fmt} image refused as a decompression bomb: {exc}") from exc
        except _PILLOW_DATA_ERRORS as exc:
            raise BadImage(f"unreadable {fmt} header: {_reason(exc)}") from exc
        _check_size(im, fmt, spec)
        return im
    raise BadImage(f"not an image of a known format ({', '.join(FORMATS)}): it starts with {prefix[:8]!r}")


def _check_size(im: PILImage.Image, fmt: str, spec: ImageSpec) -> None:
    try:
        _check_pixels(*im.size, fmt, spec)
    except BadImage:
        im.close()
        raise


def _check_pixels(width: int, height: int, fmt: str, spec: ImageSpec) -> None:
    if width < 1 or height < 1:
        raise BadImage(f"{fmt} image of size {width}x{height} has no pixels")
    if width * height > spec.max_decoded_pixels:
        raise BadImage(
            f"{fmt} image is {width}x{height} = {width * height} pixels, more than vision.max_decoded_pixels "
            f"= {spec.max_decoded_pixels}; refused before decoding as a possible decompression bomb (raise "
            "vision.max_decoded_pixels if images this large are meant)"
        )


def _gif_canvas(data: bytes) -> tuple[int, int]:
    """The canvas Pillow makes for a GIF's first frame: the screen, grown to a frame that overflows it.

    Pillow grows it while parsing the header, and checks the grown size against its own
    process-wide limit only, so this reads the same blocks first (an unreadable GIF gives the
    screen size, and Pillow's parser says what is wrong with it).
    """
    if len(data) < 13:
        return 1, 1  # no screen to check: Pillow refuses the header
    width, height, flags = struct.unpack_from("<HHB", data, 6)
    try:
        pos = 13 + (3 << ((flags & 7) + 1) if flags & 0x80 else 0)  # after the global colour table
        while pos < len(data) and data[pos] != 0x3B:  # ';' ends the file
            if data[pos] == 0x21:  # '!' extension: label, then sub-blocks up to an empty one
                pos += 2
                while pos < len(data) and data[pos]:
                    pos += data[pos] + 1
                pos += 1
            elif data[pos] == 0x2C:  # ',' the first frame: left, top, width, height
                left, top, w, h = struct.unpack_from("<HHHH", data, pos + 1)
                return max(width, left + w), max(height, top + h)
            else:  # Pillow skips a stray byte
                pos += 1
    except struct.error:
        pass
    return width, height


def _jpeg_without_metadata(data: bytes) -> bytes:
    """The JPEG without its APP1 (Exif, XMP) and MPF (APP2 "MPF") segments, which decoding never reads.

    Pillow parses them while opening (the Exif for a resolution, the MPF to tell an MPO) and
    meets damage in them with a Python warning, not an error: the same file would then decode
    or fail as the process's warning filters say, and differ between lanes run as threads and
    as processes. Without them the first frame decodes to the same pixels, warning-free. An
    unreadable segment ends the walk; what follows is left for Pillow's decoder to judge.
    """
    kept, pos = [data[:2]], 2
    while pos + 4 <= len(data) and data[pos] == 0xFF:
        marker = data[pos + 1]
        if marker == 0xFF:  # a fill byte before a marker
            kept.append(data[pos:pos + 1])
            pos += 1
            continue
        if marker == 0xDA or marker in (0x01, 0xD8, 0xD9) or 0xD0 <= marker <= 0xD7:  # scan, or no length
            break
        end = pos + 2 + int.from_bytes(data[pos + 2:pos + 4], "big")
        if end > len(data):
            break
        if not (marker == 0xE1 or (marker == 0xE2 and data[pos + 4:pos + 8] == b"MPF\0")):
            kept.append(data[pos:end])
        pos = end
    kept.append(data[pos:])
    return b"".join(kept)


_APNG_CHUNKS = (b"acTL", b"fcTL", b"fdAT")


def _png_without_animation(data: bytes) -> bytes:
    """An animated PNG without its animation chunks: the still PNG whose image is the default one.

    The default image (IDAT) is the first frame Pillow shows, so the pixels are the same; but
    Pillow meets a damaged `acTL` with a warning (see `_jpeg_without_metadata` for why that
    matters). A PNG without `acTL` before its first IDAT is returned as it is, uncopied.
    """
    first_idat = data.find(b"IDAT")
    if first_idat < 0 or data.find(b"acTL", 0, first_idat) < 0:
        return data
    kept, pos = [data[:8]], 8
    while pos + 12 <= len(data):
        end = pos + 12 + int.from_bytes(data[pos:pos + 4], "big")
        if end > len(data):  # a cut chunk: left for Pillow to judge
            break
        if data[pos + 4:pos + 8] not in _APNG_CHUNKS:
            kept.append(data[pos:end])
        pos = end
    kept.append(data[pos:])
    return b"".join(kept)


_pillow_limit_lock = ForkLock()


def _raise_pillow_limit(limit: int) -> None:
    """Keep Pillow's process-wide bomb limit at or above ours, so that only ours refuses."""
    image = _pil()
    current = image.MAX_IMAGE_PIXELS
    if current is None or current >= limit:
        return
    with _pillow_limit_lock:  # two specs raising at once must not lower it
        if image.MAX_IMAGE_PIXELS is not None and image.MAX_IMAGE_PIXELS < limit:
            image.MAX_IMAGE_PIXELS = limit


def _pil() -> Any:
    """The `PIL.Image` module with every plugin registered (imported on first use, not with this module)."""
    from PIL import Image

    if not all(fmt in Image.OPEN for fmt in FORMATS):
        Image.init()
    return Image


def _reason(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


# -------------------------------------------------------------------------------------- size


def grid(height: int, width: int, spec: ImageSpec) -> tuple[int, int]:
    """(grid_h, grid_w): the patches down and across of an image of this source size, resized.

    The resized size is Qwen2-VL's `smart_resize` (same rounding as `transformers`): sides are
    multiples of `spec.factor`, the pixel count in [min_pixels, max_pixels], the aspect ratio
    kept as closely as that allows. Raises `BadImage` for an aspect ratio above 200 (as Qwen2-VL)
    and for one that the rounding would push above `max_pixels` (see the module docstring).
    """
    if height < 1 or width < 1:
        raise BadImage(f"image of size {width}x{height} has no pixels")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise BadImage(f"image of {width}x{height} has an aspect ratio of {max(height, width) / min(height, width):.1f}"
                       f", above the {MAX_ASPECT_RATIO} that Qwen2-VL accepts")
    h_bar, w_bar = _smart_resize(height, width, spec)
    if h_bar * w_bar > spec.max_pixels:
        raise BadImage(f"image of {width}x{height} would be resized to {w_bar}x{h_bar} = {h_bar * w_bar} pixels, above "
                       f"vision.max_pixels = {spec.max_pixels} (its short side is under one merged patch of "
                       f"{spec.factor}): raise vision.max_pixels to take such extreme aspect ratios")
    return h_bar // spec.patch_size, w_bar // spec.patch_size


def _smart_resize(height: int, width: int, spec: ImageSpec) -> tuple[int, int]:
    """`transformers.models.qwen2_vl.image_processing_qwen2_vl.smart_resize`, line for line."""
    factor = spec.factor
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > spec.max_pixels:
        beta = math.sqrt((height * width) / spec.max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < spec.min_pixels:
        beta = math.sqrt(spec.min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def image_tokens(height: int, width: int, spec: ImageSpec) -> int:
    """The placeholder tokens an image of this source size takes in the text: one per merged patch."""
    grid_h, grid_w = grid(height, width, spec)
    return grid_h * grid_w // spec.merge_size ** 2


# ------------------------------------------------------------------------------------ pixels


def load_image(data: bytes, spec: ImageSpec) -> np.ndarray:
    """The image in `data` as uint8 RGB [H', W', 3] (read-only), resized to `grid(...) * patch_size`.

    The header is checked (`image_size`, then `grid`) before anything is decoded. Raises
    `BadImage` for a truncated or corrupt image, with Pillow's reason.
    """
    image = _pil()
    with contextlib.closing(_open(data, spec)) as im:
        grid_h, grid_w = grid(im.height, im.width, spec)
        fmt = im.format or "image"
        try:
            im.load()
            rgb = _to_rgb(im)
        except image.DecompressionBombError as exc:
            raise BadImage(f"{fmt} image refused as a decompression bomb while decoding: {exc}") from exc
        except _PILLOW_DATA_ERRORS as exc:
            raise BadImage(f"cannot decode the {fmt} image ({im.mode} {im.width}x{im.height}): "
                           f"{_reason(exc)}") from exc
        size = (grid_w * spec.patch_size, grid_h * spec.patch_size)  # Pillow sizes are (width, height)
        return pixels(rgb.resize(size, image.Resampling.BICUBIC, reducing_gap=None))


def pixels(im: PILImage.Image) -> np.ndarray:
    """An RGB image's pixels as uint8 [H, W, 3] (read-only), without copying them where Pillow allows.

    `np.asarray(im)` copies the pixels twice while holding the GIL (`Image.tobytes` in chunks, then
    their join): about 110 us for a 448 x 336 image. Pillow (>= 11.2) exports an image's memory
    through the Arrow C data interface instead: a view of its RGBX rows (4 bytes a pixel) that
    lives as long as the returned array, in about 3 us. `load_image` + `patchify` of 600 x 450
    PNGs on 2 threads: +2.5-3% images/s; the stamps (about 200 x 200) gain nothing measurable.
    An image Pillow cannot export in one piece (larger than its 16 MiB blocks, say) or an export of
    another layout is copied with `np.asarray` as before.
    """
    view = _arrow_view(im) if im.mode == "RGB" else None
    return np.asarray(im) if view is None else view


class _ArrowSchema(ctypes.Structure):
    pass


class _ArrowArray(ctypes.Structure):
    pass


# The Arrow C data interface's two structs (https://arrow.apache.org/docs/format/CDataInterface.html): a stable ABI.
_ArrowSchema._fields_ = [
    ("format", ctypes.c_char_p), ("name", ctypes.c_char_p), ("metadata", ctypes.c_char_p), ("flags", ctypes.c_int64),
    ("n_children", ctypes.c_int64), ("children", ctypes.POINTER(ctypes.POINTER(_ArrowSchema))),
    ("dictionary", ctypes.c_void_p), ("release", ctypes.c_void_p), ("private_data", ctypes.c_void_p)]
_ArrowArray._fields_ = [
    ("length", ctypes.c_int64), ("null_count", ctypes.c_int64), ("offset", ctypes.c_int64),
    ("n_buffers", ctypes.c_int64), ("n_children", ctypes.c_int64), ("buffers", ctypes.POINTER(ctypes.c_void_p)),
    ("children", ctypes.POINTER(ctypes.POINTER(_ArrowArray))), ("dictionary", ctypes.c_void_p),
    ("release", ctypes.c_void_p), ("private_data", ctypes.c_void_p)]
# a prototype of its own: setting restype on `ctypes.pythonapi.PyCapsule_GetPointer` would change it for everyone
_capsule_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi))


def _arrow_view(im: PILImage.Image) -> np.ndarray | None:
    """`im`'s pixels [H, W, 3] as a view of its memory exported through the Arrow C data interface
    (fixed-size lists of 4 uint8, RGBX), or None where Pillow or the layout does not allow it."""
    export = getattr(im, "__arrow_c_array__", None)
    if export is None or not im.width or not im.height:
        return None
    try:
        schema_capsule, array_capsule = export()
    except ValueError:  # not in one block of Pillow's memory
        return None
    schema = _ArrowSchema.from_address(_capsule_pointer(schema_capsule, b"arrow_schema"))
    array = _ArrowArray.from_address(_capsule_pointer(array_capsule, b"arrow_array"))
    n = im.width * im.height
    if (schema.format != b"+w:4" or schema.n_children != 1 or schema.children[0].contents.format != b"C"
            or array.length != n or array.offset or array.n_children != 1):
        return None
    values = array.children[0].contents
    if values.length != 4 * n or values.offset or values.n_buffers != 2 or not values.buffers[1]:
        return None
    memory = (ctypes.c_uint8 * (4 * n)).from_address(values.buffers[1])
    memory._export = array_capsule  # the view keeps the export, and through it the image's memory, alive
    out = np.frombuffer(memory, np.uint8).reshape(im.height, im.width, 4)[:, :, :3]
    out.flags.writeable = False
    return out


def _to_rgb(im: PILImage.Image) -> PILImage.Image:
    """`transformers.image_transforms.convert_to_rgb` for a PIL image: transparency onto white.

    The reference composites with `alpha_composite` onto opaque white, then converts to RGB.
    Over an opaque background each output byte depends only on the source's (value, alpha), and
    a masked `paste` onto white RGB gives the same byte for all 65,536 pairs
    (tests/vision/test_image.py checks them all), in half the time and mostly outside the GIL
    (`alpha_composite` and the RGBA copies hold it: the loader's decode threads queued on them).
    RGBA and LA paste as they are; P, PA and the rest go through RGBA first, as in the reference.
    """
    image = _pil()
    if "A" in im.getbands() or im.info.get("transparency") is not None:
        src = im if im.mode in ("RGBA", "LA") else im.convert("RGBA")
        out = image.new("RGB", src.size, (255, 255, 255))
        out.paste(src, mask=src)  # the mask is src's alpha band
        return out
    return im if im.mode == "RGB" else im.convert("RGB")


def patchify(image: np.ndarray, spec: ImageSpec, out: np.ndarray | None = None) -> np.ndarray:
    """uint8 [H', W', 3] (from `load_image`) to patch rows uint8 [grid_h * grid_w, spec.row_size].

    Row order: merge blocks left to right, top to bottom; inside a block its merge_size^2 patches
    row-major. A row is channel-major, then the frame repeated temporal_patch_size times, then
    the patch's pixels row-major: the layout of Qwen2-VL's processor for a still image.

    With `out` (C-contiguous uint8 of that shape, say an image's rows of a batch's
    `pixel_values`), the rows are written there and `out` is returned: a batch is assembled
    without a copy per image. `patch_rows(patch_frame(image))` gives the same rows in two steps.
    """
    blocks = _blocks(image, spec)
    n, t = _patches(blocks), spec.temporal_patch_size
    out = _rows_out(out, (n, spec.row_size))
    # Gather the first frame (a byte-strided copy, the costly part), then copy it to the others in
    # runs of p * p bytes: about half the time of gathering every frame from the image.
    first = out.reshape(*blocks.shape[:5], t, *blocks.shape[5:])
    first[:, :, :, :, :, 0] = blocks
    _repeat_frame(out.reshape(n, 3, t, -1))
    return out


def patch_frame(image: np.ndarray, spec: ImageSpec, out: np.ndarray | None = None) -> np.ndarray:
    """uint8 [H', W', 3] to its patches, one frame: uint8 [grid_h * grid_w, 3, patch_size^2].

    The byte-strided gather of `patchify` alone, in its row order, without the temporal copies:
    as many bytes as the image. The loader does it where the image is decoded, while its bytes
    are still in the cache, and `patch_rows` makes the batch's rows from it later. With `out`
    (writable C-contiguous uint8 of that shape: a decode process's shared memory), the frame is
    written there and `out` is returned.
    """
    blocks = _blocks(image, spec)
    shape = (_patches(blocks), 3, spec.patch_size ** 2)
    if out is None:
        out = np.empty(shape, np.uint8)
    elif out.shape != shape or out.dtype != np.uint8 or not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError(f"patch_frame writes into writable C-contiguous uint8 {list(shape)}, got {out.dtype} "
                         f"{list(out.shape)}")
    out.reshape(blocks.shape)[...] = blocks
    return out


def patch_rows(frame: np.ndarray, spec: ImageSpec, out: np.ndarray | None = None) -> np.ndarray:
    """`patch_frame`'s output to patch rows uint8 [n, spec.row_size], the bytes `patchify` gives;
    into `out` as `patchify` does. Copies runs of patch_size^2 bytes only."""
    n, p2 = len(frame), spec.patch_size ** 2
    if frame.dtype != np.uint8 or frame.shape != (n, 3, p2):
        raise ValueError(f"patch_rows takes uint8 [N, 3, {p2}] (from patch_frame), got {frame.dtype} "
                         f"{list(frame.shape)}")
    out = _rows_out(out, (n, spec.row_size))
    # one broadcast pass, the frame read once for all its copies: 40% faster than copy-then-repeat
    out.reshape(n, 3, spec.temporal_patch_size, p2)[...] = frame[:, :, None, :]
    return out


def _blocks(image: np.ndarray, spec: ImageSpec) -> np.ndarray:
    """The image's patches as a strided view (gh/m, gw/m, m, m, C, p, p): row order, then the row's bytes."""
    p, m = spec.patch_size, spec.merge_size
    if image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:
        raise ValueError(f"patchify takes uint8 [H, W, 3], got {image.dtype} {list(image.shape)}")
    height, width = image.shape[:2]
    if height % spec.factor or width % spec.factor or not height or not width:
        raise ValueError(f"patchify takes sides that are multiples of {spec.factor}, got {width}x{height}: "
                         "pass the output of load_image")
    gh, gw = height // p, width // p
    blocks = image.reshape(gh // m, m, p, gw // m, m, p, 3)
    return blocks.transpose(0, 3, 1, 4, 6, 2, 5)  # (gh/m, gw/m, mh, mw, C, ph, pw)


def _patches(blocks: np.ndarray) -> int:
    return blocks.shape[0] * blocks.shape[1] * blocks.shape[2] * blocks.shape[3]


def _repeat_frame(frames: np.ndarray) -> None:
    """frames [n, 3, t, p*p]: copy frame 0 to frames 1..t-1."""
    for k in range(1, frames.shape[2]):
        frames[:, :, k] = frames[:, :, 0]


def _rows_out(out: np.ndarray | None, shape: tuple[int, int]) -> np.ndarray:
    if out is None:
        return np.empty(shape, np.uint8)
    if out.shape != shape or out.dtype != np.uint8 or not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError(f"patchify writes rows into writable C-contiguous uint8 {list(shape)}, got {out.dtype} "
                         f"{list(out.shape)}" + ("" if out.flags.c_contiguous else ", not contiguous"))
    return out


# ------------------------------------------------------------------------------- normalising


def normalize(pixel_values: Any, mean: tuple[float, ...] = IMAGE_MEAN, std: tuple[float, ...] = IMAGE_STD) -> Any:
    """uint8 patch rows (a torch tensor, on any device) to float32 `(x / 255 - mean) / std`.

    The arithmetic is the processor's own (transformers' `rescale` multiplies by 1/255 in
    float64 and rounds to float32, `normalize` subtracts and divides in float32), so the result
    equals its float32 output bit for bit: every value depends only on (channel, byte), and
    tests/vision checks all 3 x 256 of them. The channel of a column is `column // (row_size / 3)`.
    """
    import torch

    if pixel_values.dtype != torch.uint8 or pixel_values.ndim != 2 or pixel_values.shape[1] % 3:
        raise ValueError("normalize takes uint8 patch rows [N, 3 * T * P * P], got "
                         f"{pixel_values.dtype} {list(pixel_values.shape)}")
    mean_t, std_t = _constants(tuple(mean), tuple(std), str(pixel_values.device))
    rows, width = pixel_values.shape
    scaled = pixel_values.view(rows, 3, width // 3).to(torch.float64).mul_(1 / 255).to(torch.float32)
    return scaled.sub_(mean_t).div_(std_t).view(rows, width)


@functools.lru_cache(maxsize=16)
def _constants(mean: tuple[float, ...], std: tuple[float, ...], device: str) -> tuple[Any, Any]:
    """mean and std as float32 [1, 3, 1] tensors on the device (rounded to float32 as transformers does)."""
    import torch

    if len(mean) != 3 or len(std) != 3:
        raise ValueError(f"normalize takes 3 means and 3 stds (RGB), got {mean} and {std}")
    return tuple(torch.tensor(v, dtype=torch.float32, device=device).view(1, 3, 1) for v in (mean, std))
