"""The compiled digest kernels (zephon_stream/refit/_digest.c); everything else is in pyproject.toml.

The extension is optional: where it cannot be built (no compiler), the package installs without
it and zephon_stream.refit.hashing uses its numpy reference code (same digests, about 4x slower).
No -march flag: the C code picks its AVX2 or plain loops when the module loads (target_clones).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "zephon_stream.refit._digest",
            sources=["zephon_stream/refit/_digest.c"],
            optional=True,
            extra_compile_args=["-O3"],
        )
    ]
)
