"""The vision-language demo data: Tux Paint's stamps (fetched into the cache with apt-get download)
as image+caption samples and tar shards. Skipped, with the reason, where the package cannot be had."""

from __future__ import annotations

import io
import re
import shutil
from pathlib import Path

import anyio
import pytest

from tools.stamps import STAMPS_DIR, build_stamp_shards, ensure_stamps, find_stamps, stamp_samples
from zephon_stream.connectors import LocalStore
from zephon_stream.formats.tar import parse_samples, tar_index

PIL = pytest.importorskip("PIL.Image", reason="Pillow (the vision extra) is not installed")

_LOCALE_LINE = re.compile(r"^[a-z]{2,3}(_[A-Z]{2})?(@\w+)?\.utf8=")  # a translation line, not the English one


@pytest.fixture(scope="module")
def root() -> Path:
    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        pytest.skip("apt-get/dpkg-deb unavailable: cannot fetch tuxpaint-stamps-default")
    found = ensure_stamps()
    if found is None:
        pytest.skip("apt-get download tuxpaint-stamps-default failed (no Debian mirror reachable?)")
    return found


def test_each_described_png_is_paired_with_the_english_first_line(root: Path) -> None:
    stamps = find_stamps(root)
    samples = list(stamp_samples(root))
    assert len(samples) == len(stamps.described) >= 750
    keys = [k for k, _ in samples]
    assert keys == sorted(keys) and len(set(keys)) == len(keys)
    captions = dict((k, m["txt"].decode()) for k, m in samples)
    assert captions["animals/birds/penguin"] == "A penguin."
    assert all(c and c == c.strip() and "\n" not in c and not _LOCALE_LINE.match(c) for c in captions.values())
    every_png = sorted(p.relative_to(root / STAMPS_DIR) for p in (root / STAMPS_DIR).rglob("*.png"))
    assert sorted([p for p, _ in stamps.described] + stamps.undescribed) == every_png  # each PNG counted once
    assert stamps.undescribed and all(p.stem.endswith("_mirror") for p in stamps.undescribed)
    assert all(not (root / STAMPS_DIR / p).with_suffix(".png").exists() for p in stamps.no_png)


def test_every_image_is_a_png_that_pillow_decodes(root: Path) -> None:
    for key, members in stamp_samples(root):
        with PIL.open(io.BytesIO(members["png"])) as image:
            assert image.format == "PNG", key
            image.load()  # the whole image decodes, not just its header
            assert min(image.size) > 0, key
        assert members["png"] == (root / STAMPS_DIR / f"{key}.png").read_bytes()  # never re-encoded


def test_the_shards_hold_every_sample_and_index_back(root: Path, tmp_path: Path) -> None:
    stale = tmp_path / "stamps-00099.tar"
    stale.write_bytes(b"from an earlier run")
    paths = build_stamp_shards(tmp_path, shard_bytes=8 << 20)
    assert len(paths) > 1 and not stale.exists()
    store = LocalStore(tmp_path)
    back = []
    for path in paths:
        data = path.read_bytes()
        idx = anyio.run(tar_index, store, path.name, len(data), 4 << 20)
        assert idx.bad_tail is None and idx.ignored == 0
        back += parse_samples(data[idx.starts[0]:idx.starts[-1]], idx.starts[0], path.name, 4 << 20)
    assert [(s.key, s.members) for s in back] == list(stamp_samples(root))
