"""The vision-language demo data: Tux Paint's stamps as image+caption tar shards.

This is a tool of the repository, not part of the installed package: it runs ``apt-get download``.

The Debian package ``tuxpaint-stamps-default`` (GPL-2, about 160 MB) holds clip-art stamps under
``usr/share/tuxpaint/stamps/<category>/.../<name>.png``, each described by ``<name>.txt``: a
human-written English sentence on the first line, then translations as ``<locale>.utf8=<text>``
lines. ``ensure_stamps`` fetches the package once into ``<cache>/tuxpaint-stamps`` (the cache of
``tools.corpus``) and keeps only the PNGs, their descriptions and the copyright file.
``stamp_samples`` pairs each PNG with the first line of its description, sorted by path;
PNGs without a description (pre-mirrored ``*_mirror.png`` variants) and descriptions without a
PNG (stamps shipped only as SVG, which Pillow cannot decode) are left out and counted
(``find_stamps``). ``build_stamp_shards`` writes WebDataset-style tar shards with
``zephon_stream.formats.write_tar_shards``: sample ``animals/birds/penguin`` holds ``penguin.png``
(the package's bytes, never re-encoded) and ``penguin.txt`` (``A penguin.``).

The data is GPL-2: nothing derived from it is committed; it lives in the cache and in OUT_DIR.

Command line (from the repository root): ``python -m tools.stamps OUT_DIR [--shard-mb N]``.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

from tools.corpus import _apt_download, _locked, _run, cache_dir, debian_download_bytes
from zephon_stream.formats.tar import write_tar_shards

__all__ = ["STAMPS_PACKAGE", "Stamps", "build_stamp_shards", "ensure_stamps", "find_stamps", "stamp_samples"]

log = logging.getLogger("zephon_stream.datasets")

STAMPS_PACKAGE = "tuxpaint-stamps-default"
STAMPS_DIR = Path("usr", "share", "tuxpaint", "stamps")  # inside the unpacked package
_COPYRIGHT = Path("usr", "share", "doc", STAMPS_PACKAGE, "copyright")
_MARKER = ".zephon-stamps-v1"  # bump when the selection of kept files changes
_SIZE_GUESS = 160_880_444  # the .deb in Debian 12, when apt-cache cannot say


def _root() -> Path:
    return cache_dir() / "tuxpaint-stamps"


def ensure_stamps() -> Path | None:
    """The unpacked stamps package, fetched (``apt-get download``) and unpacked (``dpkg-deb -x``) into
    ``<cache>/tuxpaint-stamps`` the first time; None, after logging one line, when it cannot be had.

    Only the stamp PNGs, their ``.txt`` descriptions and the copyright file are kept (not the
    sounds, SVGs and settings: about 230 MB unpacked, a fraction of that kept).
    """
    try:
        return _ensure_stamps()
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("%s unavailable (%s)", STAMPS_PACKAGE, exc)
        return None


def _ensure_stamps() -> Path | None:
    root = _root()
    if (root / _MARKER).is_file():
        return root
    with _locked(root.with_name("tuxpaint-stamps.lock")):
        if (root / _MARKER).is_file():  # another process finished while this one waited
            return root
        apt, dpkg = shutil.which("apt-get"), shutil.which("dpkg-deb")
        if not apt or not dpkg:
            log.warning("%s unavailable: no apt-get/dpkg-deb on this machine", STAMPS_PACKAGE)
            return None
        t0 = time.monotonic()
        root.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="tuxpaint-stamps-", dir=root.parent) as tmp:
            debs, tree = Path(tmp, "debs"), Path(tmp, "tree")
            debs.mkdir()
            debs.chmod(0o777)  # apt's sandbox user must be able to write there, or apt warns
            print(f"fetching {STAMPS_PACKAGE} (~{_package_size() / 1e6:.0f} MB) into {root}", file=sys.stderr)
            got = _apt_download(apt, STAMPS_PACKAGE, debs)
            unpacked = [d.name for d in sorted(debs.glob("*.deb")) if _run([dpkg, "-x", str(d), str(tree)], debs)]
            if not got or not unpacked or not (tree / STAMPS_DIR).is_dir():
                log.warning("%s unavailable: apt-get download / dpkg-deb -x failed", STAMPS_PACKAGE)
                return None
            _prune(tree)
            (tree / _MARKER).write_text("\n".join(unpacked) + "\n", encoding="utf-8")
            if root.exists():
                shutil.rmtree(root)
            os.replace(tree, root)
        log.info("%s unpacked to %s in %.1f s", STAMPS_PACKAGE, root, time.monotonic() - t0)
        return root


def _package_size() -> int:
    """The .deb's size in bytes as apt says (a Debian 12 figure if it cannot)."""
    return debian_download_bytes([STAMPS_PACKAGE]).get(STAMPS_PACKAGE, _SIZE_GUESS)


def _prune(tree: Path) -> None:
    """Delete every file of the unpacked package but the stamps' PNGs and descriptions and the copyright."""
    stamps = tree / STAMPS_DIR
    for p in sorted(tree.rglob("*"), reverse=True):  # children before their directory
        keep = p == tree / _COPYRIGHT or (stamps in p.parents and p.suffix in (".png", ".txt"))
        if p.is_symlink() or (p.is_file() and not keep):
            p.unlink()
        elif p.is_dir() and not any(p.iterdir()):
            p.rmdir()


class Stamps(NamedTuple):
    """What the package holds: described PNG stamps, and those left out (paths relative to the stamps)."""

    described: list[tuple[Path, str]]  # (PNG, the English first line of its description)
    undescribed: list[Path]  # PNGs without a .txt, or with an empty or non-UTF-8 first line
    no_png: list[Path]  # descriptions without a PNG: SVG-only stamps (Pillow cannot decode SVG), two sounds


def find_stamps(root: Path) -> Stamps:
    """Sort the stamps of an unpacked package (``ensure_stamps()``) by whether they can be a sample."""
    stamps = root / STAMPS_DIR
    pngs = sorted((p.relative_to(stamps) for p in stamps.rglob("*.png") if p.is_file()), key=_key)
    described, undescribed = [], []
    for png in pngs:
        caption = _caption(stamps / png.with_suffix(".txt"))
        if caption:
            described.append((png, caption))
        else:
            undescribed.append(png)
    have = {png.with_suffix("") for png in pngs}
    texts = sorted(p.relative_to(stamps) for p in stamps.rglob("*.txt") if p.is_file())
    return Stamps(described, undescribed, [t for t in texts if t.with_suffix("") not in have])


def _key(png: Path) -> str:
    """A stamp's sample key: its path under the stamps directory, without the extension."""
    return png.with_suffix("").as_posix()


def _caption(txt: Path) -> str | None:
    """The first line of a stamp description (English: translations follow as ``xx.utf8=`` lines)."""
    try:
        first = txt.read_bytes().decode("utf-8-sig").split("\n", 1)[0].strip()
    except (OSError, UnicodeDecodeError):
        return None
    return first or None


def stamp_samples(root: Path) -> Iterator[tuple[str, dict[str, bytes]]]:
    """``(key, {"png": image bytes, "txt": English caption})`` for each described PNG stamp, sorted by
    key: the stamp's path under the stamps directory without its extension."""
    stamps = root / STAMPS_DIR
    for png, caption in find_stamps(root).described:
        yield _key(png), {"png": (stamps / png).read_bytes(), "txt": caption.encode()}


def build_stamp_shards(out_dir: str | os.PathLike[str], shard_bytes: int = 64 << 20) -> list[Path]:
    """Write the stamps as ``stamps-0000N.tar`` shards in ``out_dir`` (replacing any written before).

    Raises RuntimeError when the package cannot be had (no apt-get, or no network).
    """
    root = ensure_stamps()
    if root is None:
        raise RuntimeError(f"{STAMPS_PACKAGE} is unavailable (needs apt-get and a Debian mirror): see the log")
    out = Path(out_dir)
    for old in out.glob("stamps-*.tar"):  # a shard from an earlier run with more shards would stay behind
        old.unlink()
    return write_tar_shards(stamp_samples(root), out, shard_bytes=shard_bytes, prefix="stamps")


# ----------------------------------------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.stamps", description=build_stamp_shards.__doc__)
    parser.add_argument("out_dir")
    parser.add_argument("--shard-mb", type=float, default=64.0, help="shard size in MiB (default 64)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    t0 = time.monotonic()
    try:
        paths = build_stamp_shards(args.out_dir, int(args.shard_mb * (1 << 20)))
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return 1
    found = find_stamps(_root())
    size = sum(p.stat().st_size for p in paths)
    print(f"{len(found.described)} stamps in {len(paths)} shards, {size / 1e6:.1f} MB, in {args.out_dir} "
          f"({time.monotonic() - t0:.1f} s); left out: {len(found.undescribed)} PNGs without a description, "
          f"{len(found.no_png)} descriptions without a PNG (SVG-only stamps)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
