"""Images for vision-language training: decode, resize and patchify as Qwen2-VL's processor does.

Importing this package imports numpy, not Pillow or torch: Pillow is imported on the first
image, torch only by `normalize`, which runs where the batch is consumed.
"""

from zephon_stream.vision.image import (
    FORMATS,
    IMAGE_MEAN,
    IMAGE_STD,
    MAX_ASPECT_RATIO,
    BadImage,
    ImageSpec,
    grid,
    image_size,
    image_tokens,
    load_image,
    normalize,
    patch_frame,
    patch_rows,
    patchify,
)

__all__ = [
    "FORMATS",
    "IMAGE_MEAN",
    "IMAGE_STD",
    "MAX_ASPECT_RATIO",
    "BadImage",
    "ImageSpec",
    "grid",
    "image_size",
    "image_tokens",
    "load_image",
    "normalize",
    "patch_frame",
    "patch_rows",
    "patchify",
]
