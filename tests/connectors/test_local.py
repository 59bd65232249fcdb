"""LocalStore keeps every key inside its root, symlinks included, on reads and on the other calls."""

from __future__ import annotations

import functools
import os

import anyio
import pytest

from zephon_stream import AccessDenied
from zephon_stream.connectors.local import LocalStore


@pytest.fixture
def tree(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "d").mkdir(parents=True)
    outside.mkdir()
    (root / "d" / "a.txt").write_bytes(b"inside")
    (outside / "secret.txt").write_bytes(b"secret")
    (root / "in-link").symlink_to(root / "d" / "a.txt")
    (root / "out-link").symlink_to(outside / "secret.txt")
    (root / "out-dir").symlink_to(outside)
    return root


def test_reads_inside_the_root_and_through_links_that_stay_inside(tree):
    store = LocalStore(tree)
    assert anyio.run(store.read, "d/a.txt") == b"inside"
    assert anyio.run(store.read, "in-link", 1, 4) == b"nsi"


@pytest.mark.parametrize("key", ["out-link", "out-dir/secret.txt"])
def test_a_symlink_out_of_the_root_is_refused_on_read_and_head(tree, key):
    store = LocalStore(tree)
    with pytest.raises(AccessDenied, match=f"key '{key}' resolves to .*outside.*, outside the store root"):
        anyio.run(store.read, key)
    with pytest.raises(AccessDenied, match="outside the store root"):
        anyio.run(store.head, key)


@pytest.mark.parametrize("key", ["../outside/secret.txt", "/etc/passwd", "d\\a.txt", ""])
def test_keys_that_leave_the_root_by_name_are_refused(tree, key):
    with pytest.raises(AccessDenied, match="is not a relative path inside"):
        anyio.run(LocalStore(tree).read, key)


def test_a_root_that_is_a_prefix_of_a_sibling_does_not_admit_the_sibling(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data2").mkdir()
    (tmp_path / "data2" / "x").write_bytes(b"x")
    (tmp_path / "data" / "link").symlink_to(tmp_path / "data2" / "x")
    with pytest.raises(AccessDenied, match="outside the store root"):
        anyio.run(LocalStore(tmp_path / "data").read, "link")


def test_which_stores_overlap_the_ranged_reads_of_a_split(tmp_path):
    """Local files and memory are read one part at a time; S3, latency wrappers and stores that
    do not say keep `read_ahead` reads in flight; a plain wrapper says what its inner store says."""
    from zephon_stream.connectors.base import overlaps_reads
    from zephon_stream.connectors.memory import MemoryStore
    from zephon_stream.connectors.s3 import S3Store
    from zephon_stream.testing.stores import LatencyStore, WrappedStore

    local = LocalStore(tmp_path)
    assert not overlaps_reads(local) and not overlaps_reads(MemoryStore())
    assert not overlaps_reads(WrappedStore(local)) and overlaps_reads(WrappedStore(LatencyStore(local)))
    assert overlaps_reads(LatencyStore(local)) and overlaps_reads(S3Store) and overlaps_reads(object())


def test_delete_takes_the_folders_it_empties_not_the_root_or_others(tmp_path):
    """As on S3, where a folder is only a key's prefix: refit retention left an empty `vN/` folder
    for every version it removed."""
    root = tmp_path / "root"
    store = LocalStore(root)

    async def go() -> None:
        for key in ("v1/MANIFEST", "v1/c/0", "v2/MANIFEST", "LATEST"):
            await store.put(key, b"x")
        await store.delete("v1/c/0")
        assert not (root / "v1" / "c").exists() and (root / "v1").is_dir()  # v1 still holds its MANIFEST
        await store.delete("v1/MANIFEST")
        assert not (root / "v1").exists() and (root / "v2").is_dir()
        await store.delete("v2/MANIFEST")
        await store.delete("LATEST")
        assert root.is_dir() and list(root.iterdir()) == []  # the root stays
        await store.delete("v9/none")  # nothing there: nothing to do
        await store.put("v1/MANIFEST", b"y")  # a folder taken can come back
        assert await store.read("v1/MANIFEST") == b"y"

    anyio.run(go)


@pytest.mark.parametrize("errno_name", ["ENOSPC", "EROFS", "EPERM"])
def test_a_full_disk_is_a_connector_error_and_leaves_no_partial_file(tmp_path, monkeypatch, errno_name):
    """`zephon relay` to a full file:// child died with a traceback (OSError is no ZephonError, which
    it retries), and its partial temporary files kept the disk full. On a read-only mount even the
    cleanup's unlink fails (EROFS, not ENOENT); without hard links the conditional put's link does."""
    import errno
    import pathlib

    from zephon_stream import ConnectorError

    code = getattr(errno, errno_name)
    real_write, real_unlink = pathlib.Path.write_bytes, pathlib.Path.unlink

    def full(self, data):
        real_write(self, bytes(data)[: len(data) // 2])  # half written, then the disk is full
        raise OSError(code, os.strerror(code))

    def read_only(self, missing_ok=False):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    def no_links(src, dst):
        raise OSError(errno.EPERM, os.strerror(errno.EPERM))

    store = LocalStore(tmp_path)
    if errno_name == "EPERM":
        monkeypatch.setattr(os, "link", no_links)
    else:
        monkeypatch.setattr(pathlib.Path, "write_bytes", full)
    if errno_name == "EROFS":
        monkeypatch.setattr(pathlib.Path, "unlink", read_only)
    with pytest.raises(ConnectorError, match=rf"cannot write 'v6/chunk-1' under .*: {os.strerror(code)} "
                                             r"\(1,000 bytes\)"):
        anyio.run(functools.partial(store.put, "v6/chunk-1", b"x" * 1000, if_none_match=True))
    monkeypatch.undo()
    assert [p.name for p in tmp_path.rglob("*") if p.is_file()] == ([] if errno_name != "EROFS" else
                                                                    [p.name for p in tmp_path.rglob("*.tmp")])
    for p in tmp_path.rglob("*.tmp"):
        real_unlink(p)
    anyio.run(store.put, "v6/chunk-1", b"x" * 1000)  # space again: the next try writes it
    assert (tmp_path / "v6" / "chunk-1").read_bytes() == b"x" * 1000


def test_a_killed_writer_s_temporary_files_go_with_the_folder(tmp_path):
    """A relay killed mid-put left `.chunk.<pid>.<id>.tmp` files; retention deletes only the keys a
    version names, so a collected version's folder stayed, holding them, for good."""
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    store = LocalStore(tmp_path)
    anyio.run(store.put, "v1/chunk-0", b"data")
    (tmp_path / "v1" / f".chunk-1.{dead}.7f3a9c.tmp").write_bytes(b"partial")
    anyio.run(store.delete, "v1/chunk-0")
    assert not (tmp_path / "v1").exists()
    anyio.run(store.put, "v2/chunk-0", b"data")
    mine = tmp_path / "v2" / f".chunk-1.{os.getpid()}.7f3a9c.tmp"  # a live writer's: kept
    mine.write_bytes(b"being written")
    anyio.run(store.delete, "v2/chunk-0")
    assert mine.exists()
