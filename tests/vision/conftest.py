"""Real images for the reference tests: the PNG/JPEG/GIF files that Debian's documentation ships.

Looked for first in the unpacked Debian docs of `tools.corpus` (`<cache>/debian-docs`; its text
corpus prunes images today, so usually none are there), else taken from the `python3.11-doc`
package (`apt-get download`, about 13 MB, once) into `<cache>/debian-doc-images`. The tests
that need them skip, saying why, where apt-get or dpkg-deb is missing or the download fails.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

import pytest

from tools.corpus import cache_dir

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".gif")
IMAGE_PACKAGE = "python3.11-doc"
MIN_BYTES = 1024  # smaller files are 16x16 icons: real, but they test nothing the generated ones do not
_MARKER = ".zephon-images-v1"


def find_images(root: Path) -> list[Path]:
    """Image files (by suffix) under root of at least MIN_BYTES, sorted; no symlinks."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file()
                  and not p.is_symlink() and p.stat().st_size >= MIN_BYTES)


def _unpack_images(deb: Path, dest: Path) -> None:
    """The package's image members (regular files), from `dpkg-deb --fsys-tarfile`, flattened into dest."""
    proc = subprocess.run(["dpkg-deb", "--fsys-tarfile", str(deb)], capture_output=True, check=True, timeout=300)
    with tempfile.TemporaryFile() as fh:
        fh.write(proc.stdout)
        fh.seek(0)
        with tarfile.open(fileobj=fh) as tar:
            for member in tar:
                if member.isfile() and Path(member.name).suffix.lower() in IMAGE_SUFFIXES:
                    source = tar.extractfile(member)
                    assert source is not None
                    (dest / member.name.removeprefix("./").replace("/", "__")).write_bytes(source.read())


def _download_images(root: Path) -> str | None:
    """Fill root from IMAGE_PACKAGE; the reason it failed, or None."""
    apt, dpkg = shutil.which("apt-get"), shutil.which("dpkg-deb")
    if not apt or not dpkg:
        return "apt-get or dpkg-deb is not installed"
    root.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="doc-images-", dir=root.parent) as tmp:
        debs, tree = Path(tmp, "debs"), Path(tmp, "tree")
        debs.mkdir()
        tree.mkdir()
        debs.chmod(0o777)  # apt's sandbox user writes there
        got = subprocess.run([apt, "download", IMAGE_PACKAGE], cwd=debs, capture_output=True, text=True,
                             timeout=600, check=False)
        found = sorted(debs.glob("*.deb"))
        if got.returncode != 0 or not found:
            return f"apt-get download {IMAGE_PACKAGE} failed: {got.stderr.strip()[-300:]}"
        _unpack_images(found[0], tree)
        (tree / _MARKER).write_text(found[0].name + "\n")
        try:
            os.replace(tree, root)
        except OSError:  # another process put it there first
            if not (root / _MARKER).is_file():
                raise
    return None


@pytest.fixture(scope="session")
def real_images() -> list[Path]:
    """Real image files (at least one), or the test skips with the reason."""
    found = find_images(cache_dir() / "debian-docs")
    if found:
        return found
    root = cache_dir() / "debian-doc-images"
    if not (root / _MARKER).is_file():
        reason = _download_images(root)
        if reason:
            pytest.skip(f"no real images: {reason}")
    found = find_images(root)
    if not found:
        pytest.skip(f"no real images: {IMAGE_PACKAGE} in {root} has no image of {MIN_BYTES} bytes or more")
    return found
