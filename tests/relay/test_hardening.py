"""Relay hardening: a child never overlaps its parent or another child however it is spelled,
retention deletes only what the relay wrote, a bad MANIFEST stops the copy where a bad object
does, children in missing directories are created, and no MANIFEST is read whole before its size
is known."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest

from tests.relay._helpers import assert_same, committed, model, snapshot, step, zeros_like
from zephon_stream import ConfigError, DataError, DigestMismatch, RefitError
from zephon_stream.cli.relay import add_subparser
from zephon_stream.connectors import LocalStore, MemoryStore, memory_store
from zephon_stream.connectors.base import Store
from zephon_stream.refit import Publisher, Subscriber, manifest
from zephon_stream.relay import Prefix, Relay

EP = "http://127.0.0.1:8333"


def _p(uri: str, **options: object) -> Prefix:
    return Prefix(uri, **options)


def _s3(uri: str, endpoint_url: str = EP, **options: object) -> Prefix:
    return Prefix(uri, endpoint_url=endpoint_url, **options)


# -- one location, many spellings -------------------------------------------------------------

# each: (parent, child) as functions of a scratch directory d; both name the same place
SAME: dict[str, tuple[Callable[[str], Prefix], Callable[[str], Prefix]]] = {
    "file-trailing-slash": (lambda d: _p(f"file://{d}/P"), lambda d: _p(f"file://{d}/P/")),
    "file-double-slash": (lambda d: _p(f"file://{d}/P/"), lambda d: _p(f"file://{d}//P/")),
    "file-dotdot": (lambda d: _p(f"file://{d}/P/"), lambda d: _p(f"file://{d}/Q/../P/")),
    "file-dot": (lambda d: _p(f"file://{d}/P/"), lambda d: _p(f"file://{d}/./P/.")),
    "file-localhost": (lambda d: _p(f"file://{d}/P/"), lambda d: _p(f"file://localhost{d}/P/")),
    "file-symlink": (lambda d: _p(f"file://{d}/P/"), lambda d: _p(f"file://{d}/link/")),
    "file-local-store": (lambda d: _p(f"file://{d}/P/"), lambda d: Prefix("P/", store=LocalStore(d))),
    "s3-double-slash": (lambda d: _s3("s3://b/p/"), lambda d: _s3("s3://b//p/")),
    "s3-inner-slashes": (lambda d: _s3("s3://b/p/q/"), lambda d: _s3("s3://b/p//q/")),
    "s3-dotdot": (lambda d: _s3("s3://b/p/"), lambda d: _s3("s3://b/x/../p/")),
    "s3-endpoint-spelling": (lambda d: _s3("s3://b/p/"), lambda d: _s3("s3://b/p/", "HTTP://127.0.0.1:8333/")),
    "s3-default-port": (lambda d: _s3("s3://b/p/", "http://h.example"),
                        lambda d: _s3("s3://b/p/", "http://H.example:80")),
    "s3-other-credentials": (lambda d: _s3("s3://b/p/", access_key_id="a", secret_access_key="x"),
                             lambda d: _s3("s3://b/p/", access_key_id="b", secret_access_key="y")),
    "memory-double-slash": (lambda d: _p("memory://hard-m/p/"), lambda d: _p("memory://hard-m//p/")),
    "memory-given-store": (lambda d: _p("memory://hard-m/p/"),
                           lambda d: Prefix("p/", store=memory_store("hard-m"))),
}


@pytest.fixture
def scratch(tmp_path: Path) -> str:
    (tmp_path / "P").mkdir()
    (tmp_path / "Q").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "P")
    return str(tmp_path)


@pytest.mark.parametrize("swap", [False, True], ids=["as-child", "as-parent"])
@pytest.mark.parametrize("case", sorted(SAME))
def test_parent_spelled_again_as_child_refused(case: str, swap: bool, scratch: str) -> None:
    first, second = (f(scratch) for f in SAME[case])
    parent, child = (second, first) if swap else (first, second)
    with pytest.raises(ConfigError, match="is its parent") as err:
        Relay(parent, [Prefix("memory://hard-other/c/"), child])
    assert parent.name in str(err.value) and child.name in str(err.value)


@pytest.mark.parametrize(("parent", "child", "relation"), [
    ("file://{d}/P/v2/", "file://{d}/P/", "contains"),  # the data loss: --from X/v2/ --to X/
    ("file://{d}/P/", "file://{d}/P/v2/", "lies inside"),
    ("file://{d}/P/", "file://{d}/link/sub/", "lies inside"),
    ("file://{d}/Q/../P/v2", "file://localhost{d}//P", "contains"),
    ("s3://b/p/", "s3://b/p/child/", "lies inside"),
    ("s3://b//p/child/", "s3://b/p/", "contains"),
    ("s3://b/p/", "s3://b/", "contains"),
])
def test_child_containing_or_inside_parent_refused(parent: str, child: str, relation: str,
                                                   scratch: str) -> None:
    opts = {"endpoint_url": EP} if parent.startswith("s3") else {}
    p, c = _p(parent.format(d=scratch), **opts), _p(child.format(d=scratch), **opts)
    with pytest.raises(ConfigError, match=f"{relation} its parent"):
        Relay(p, [c])


@pytest.mark.parametrize(("a", "b"), [
    ("file://{d}/Q/a/", "file://{d}/Q//a"),
    ("file://{d}/Q/", "file://{d}/Q/a/"),
    ("file://{d}/Q/a/", "file://{d}/Q/"),
    ("s3://b/c/", "s3://b//c/d/"),
])
def test_child_overlapping_another_child_refused(a: str, b: str, scratch: str) -> None:
    opts = {"endpoint_url": EP} if a.startswith("s3") else {}
    with pytest.raises(ConfigError, match="another child") as err:
        Relay(_p(f"file://{scratch}/P/"), [_p(a.format(d=scratch), **opts), _p(b.format(d=scratch), **opts)])
    assert a.format(d=scratch) in str(err.value) and b.format(d=scratch) in str(err.value)


@pytest.mark.parametrize(("parent", "children"), [
    ("file://{d}/P/", ["file://{d}/Q/", "file://{d}/Pa/", "file://{d}/Q2/"]),  # siblings, one a name's prefix
    ("s3://b/p/", ["s3://b/p2/", "s3://other/p/"]),
])
def test_disjoint_children_accepted(parent: str, children: list[str], scratch: str) -> None:
    opts = {"endpoint_url": EP} if parent.startswith("s3") else {}
    Relay(_p(parent.format(d=scratch), **opts), [_p(c.format(d=scratch), **opts) for c in children])
    # the same bucket and key behind another endpoint is another region's copy, not the parent
    Relay(_p("s3://b/p/", endpoint_url=EP), [_p("s3://b/p/", endpoint_url="http://127.0.0.2:8333")])


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="zephon")
    add_subparser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["relay", *argv])


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(("src", "dst"), [("{d}/v2/", "{d}/"), ("{d}", "{d}/"), ("{d}/", "localhost{d}//")])
def test_cli_refuses_and_parent_keeps_every_file(src: str, dst: str, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "X"

    async def publish() -> None:
        async with Publisher(f"file://{root}/", chunk_bytes=256, keyframe_every=1, keep_versions=10) as pub:
            w = model(21)
            for v in (1, 2, 3):
                w = step(w, v)
                await pub.publish(w)

    anyio.run(publish)
    before = _files(root)
    args = _parse("--from", "file://" + src.format(d=root), "--to", "file://" + dst.format(d=root),
                  "--keep-versions", "1", "--once", "--log-format", "text")
    assert args.func(args) == 2
    assert "must not overlap the parent" in capsys.readouterr().err
    assert _files(root) == before


# -- retention deletes only what the relay wrote -----------------------------------------------

# keys under a child that a listing finds but the relay never wrote (the layout's near misses)
FOREIGN = ["v1/notes.txt", "v1/sub/chunk-0.0123456789abcdef", "v01/chunk-0.0123456789abcdef", "vendor/readme",
           "v1/MANIFEST.bak", "v1/chunk-0.0123456789ABCDEF", "v1/part-0.0123456789abcdef",
           "v4/chunk-x.0123456789abcdef", "v4/key-0.0123456789abcdef.tmp", "other/v1/MANIFEST", "LATEST.old"]


def _child_store(kind: str, tmp_path: Path) -> tuple[Store, str]:
    return (MemoryStore(), "c/") if kind == "memory" else (LocalStore(tmp_path / "child"), "")


@pytest.mark.parametrize("kind", ["memory", "local"])
def test_retention_at_a_child_spares_foreign_objects(kind: str, tmp_path: Path) -> None:
    async def main() -> None:
        parent = MemoryStore()
        child, key = _child_store(kind, tmp_path)
        for rel in FOREIGN:
            await child.put(key + rel, b"not the relay's")
        pub = Publisher("p/", store=parent, chunk_bytes=256, keyframe_every=1, keep_versions=100)
        async with pub, Relay(Prefix("p/", store=parent), [Prefix(key, store=child)], keep_versions=1) as relay:
            w = model(22)
            for v in range(1, 4):
                w = step(w, v)
                await pub.publish(w)
            assert (await relay.sync()).ok  # first collection: a sweep by listing
            assert await committed(child, key) == [3]
            for v in range(4, 7):
                w = step(w, v)
                await pub.publish(w)
            assert (await relay.sync()).ok  # then version by version (v3..v5)
            assert await committed(child, key) == [6]
            assert relay.statistics().children[0].versions_collected == 5
        left = {o.key[len(key):] for o in await child.list(key)}
        assert set(FOREIGN) <= left  # every foreign object is still there, with its bytes
        assert all([await child.read(key + rel) == b"not the relay's" for rel in FOREIGN])
        relayed = left - set(FOREIGN) - {"LATEST"}
        assert relayed and all(k.startswith("v6/") for k in relayed)  # and nothing of v1..v5 the relay wrote

    anyio.run(main)


# -- a bad MANIFEST stops the copy where a bad object does --------------------------------------

def _spoil(parent: MemoryStore, what: str) -> None:
    if what == "manifest":
        parent.objects["p/v3/MANIFEST"] = b"\x81\xa7version\x03"  # not a manifest
    elif what == "oversized manifest":
        parent.objects["p/v3/MANIFEST"] = bytes(manifest.MAX_MANIFEST_BYTES + 1)
    elif what == "wrong version manifest":
        parent.objects["p/v3/MANIFEST"] = parent.objects["p/v2/MANIFEST"]
    else:
        key = next(k for k in sorted(parent.objects) if k.startswith("p/v3/") and "MANIFEST" not in k)
        parent.objects[key] = bytes([parent.objects[key][0] ^ 1]) + parent.objects[key][1:]


@pytest.mark.parametrize(("what", "error"), [("object", DigestMismatch), ("manifest", DataError),
                                             ("wrong version manifest", DataError),
                                             ("oversized manifest", RefitError)])
@pytest.mark.parametrize("child_at", [0, 1])
def test_bad_version_commits_the_good_ones_before_it(what: str, error: type, child_at: int,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(manifest, "MAX_MANIFEST_BYTES", 1 << 16)

    async def main() -> None:
        parent, child = MemoryStore(), MemoryStore()
        models = {}
        async with Publisher("p/", store=parent, chunk_bytes=256, keep_versions=100) as pub:
            w = model(23)
            for v in range(1, 5):
                w = step(w, v, frac=0.2)
                models[v] = snapshot(w)
                await pub.publish(w)
        async with Relay(Prefix("p/", store=parent), [Prefix("c/", store=child)]) as relay:
            if child_at:  # a child at version 1 (v2..v4 relayed, then removed)
                assert (await relay.sync()).ok and await committed(child, "c/") == [1, 2, 3, 4]
                for k in [k for k in child.objects if k.startswith(("c/v2/", "c/v3/", "c/v4/"))]:
                    await child.delete(k)
                await child.put("c/LATEST", b'{"version": 1}')
                relay.forget()
            good = dict(parent.objects)
            _spoil(parent, what)
            report = await relay.sync()
            assert report.committed == {"c/": [2] if child_at else [1, 2]}
            assert await committed(child, "c/") == [1, 2]
            assert not report.ok and isinstance(report.errors[0], error), report.errors
            assert "p/v3/" in str(report.errors[0])
            parent.objects.update(good)  # repaired: the rest follows
            assert (await relay.sync()).committed == {"c/": [3, 4]}
        replica = zeros_like(models[4])
        assert await Subscriber("c/", store=child).pull(replica) == 4
        assert_same(models[4], replica)

    anyio.run(main)


def test_bad_newest_manifest_past_the_parents_collection() -> None:
    """A child behind the parent's collection restarts at the newest keyframe below a bad MANIFEST."""
    async def main() -> None:
        parent, child = MemoryStore(), MemoryStore()
        async with Publisher("p/", store=parent, chunk_bytes=256, keyframe_every=3, keep_versions=2) as pub:
            w = model(24)
            for v in range(1, 10):  # keyframes 1, 4, 7; the parent keeps 7..9
                w = step(w, v)
                await pub.publish(w)
        parent.objects["p/v9/MANIFEST"] = b"garbage"
        async with Relay(Prefix("p/", store=parent), [Prefix("c/", store=child)]) as relay:
            report = await relay.sync()
        assert report.committed == {"c/": [7, 8]}
        assert isinstance(report.errors[0], DataError) and "p/v9/MANIFEST" in str(report.errors[0])

    anyio.run(main)


# -- missing directories -----------------------------------------------------------------------

def test_relay_child_and_publisher_in_missing_directories(tmp_path: Path) -> None:
    parent_dir, child_dir = tmp_path / "no" / "such" / "parent", tmp_path / "missing" / "deep" / "child"

    async def main() -> None:
        w = model(25)
        async with Publisher(f"file://{parent_dir}/", chunk_bytes=256) as pub:
            assert (await pub.publish(w)).version == 1
        async with Relay(f"file://{parent_dir}/", [f"file://{child_dir}/"]) as relay:
            report = await relay.sync()
        assert report.ok and report.committed == {f"file://{child_dir}/": [1]}, report.errors
        replica = zeros_like(w)
        async with Subscriber(f"file://{child_dir}/") as sub:
            assert await sub.pull(replica) == 1
        assert_same(w, replica)

    anyio.run(main)


def test_local_store_root_that_is_a_file_still_refused(tmp_path: Path) -> None:
    """At once, as a ConfigError: a read of a key under it was a NotADirectoryError traceback
    (refit status, publish and relay, in a new-user trial)."""
    (tmp_path / "f").write_bytes(b"x")
    with pytest.raises(ConfigError, match=r"file://\S+/f/ is a file, not a folder: a file:// store or prefix names"):
        LocalStore(tmp_path / "f")
    assert anyio.run(LocalStore(tmp_path / "absent").list) == []


# -- no MANIFEST read whole before its size is known --------------------------------------------

class _Ranges:
    """A store that records every read as (key, start, end, bytes returned)."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.reads: list[tuple[str, int, int | None, int]] = []

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    async def read(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        data = await self.inner.read(key, start, end)
        self.reads.append((key, start, end, len(data)))
        return data


@pytest.mark.parametrize("side", ["parent", "child"])
def test_oversized_manifest_never_read_whole(side: str, monkeypatch: pytest.MonkeyPatch) -> None:
    limit = 1 << 16
    monkeypatch.setattr(manifest, "MAX_MANIFEST_BYTES", limit)

    async def main() -> None:
        parent, child = MemoryStore(), MemoryStore()
        async with Publisher("p/", store=parent, chunk_bytes=256) as pub:
            await pub.publish(model(26))
        async with Relay(Prefix("p/", store=parent), [Prefix("c/", store=child)]) as relay:
            assert (await relay.sync()).ok
        big = os.urandom(limit) * 20
        spoiled, key = (parent, "p/v1/MANIFEST") if side == "parent" else (child, "c/v1/MANIFEST")
        spoiled.objects[key] = big
        parent.objects["p/LATEST"] = child.objects["c/LATEST"] = b" " * len(big)  # a hint, ignored
        watched_parent, watched_child = _Ranges(parent), _Ranges(child)
        async with Relay(Prefix("p/", store=watched_parent), [Prefix("c/", store=watched_child)]) as relay:
            report = await relay.sync()
        assert not report.ok and isinstance(report.errors[0], RefitError), report.errors
        assert key in str(report.errors[0]) and str(len(big)) in str(report.errors[0])
        reads = [r for r in watched_parent.reads + watched_child.reads if r[0].endswith(("MANIFEST", "LATEST"))]
        assert {r[0] for r in reads} >= {key, "p/LATEST", "c/LATEST"}
        assert all(end is not None and end <= limit + 1 and got <= limit + 1 for _, _, end, got in reads), \
            reads

    anyio.run(main)


def test_a_parent_started_again_is_named_as_the_likely_cause() -> None:
    """A trainer restarted on a wiped parent prefix: the child is ahead of it, then holds other
    versions of the same numbers. The error blamed only 'another tree'."""
    async def main() -> None:
        parent, child = MemoryStore(), MemoryStore()
        w = model(8)

        async def publish(n: int) -> None:
            nonlocal w
            async with Publisher("p/", store=parent, chunk_bytes=256) as pub:
                for v in range(n):
                    w = step(w, 50 + v)
                    await pub.publish(w)

        await publish(3)
        async with Relay(Prefix("p/", store=parent), [Prefix("c/", store=child)]) as relay:
            assert (await relay.sync()).ok
        for info in await parent.list("p/"):
            await parent.delete(info.key)
        await publish(1)
        for expect in ("is at version 3, ahead of its parent", "version 3 at child"):
            async with Relay(Prefix("p/", store=parent), [Prefix("c/", store=child)]) as relay:
                report = await relay.sync()
            assert not report.ok and expect in str(report.errors[0])
            assert "the parent was started again (a trainer restarted on a wiped prefix)" in str(report.errors[0])
            assert "empty the child prefix" in str(report.errors[0])
            await publish(2)  # the new run reaches the child's version: another model of the same number

    anyio.run(main)
