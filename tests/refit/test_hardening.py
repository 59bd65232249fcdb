"""Hostile and mistaken use of refit: a stale local record, settings and LATEST hints that would
make a prefix unusable, a corrupt head version, oversized MANIFESTs, malformed safetensors files.
Each ends in the right bytes or a one-line error, never success with other weights."""

from __future__ import annotations

import argparse
import functools
import json
import os
import struct
from pathlib import Path

import anyio
import msgspec
import pytest
import torch

from tests.refit._helpers import assert_same, model, step, zeros_like
from zephon_stream import ConfigError, DataError, ObjectNotFound, RefitError
from zephon_stream.cli.refit import add_subparser
from zephon_stream.connectors import MemoryStore
from zephon_stream.connectors.location import location
from zephon_stream.refit import Publisher, Sharding, Subscriber, safetensors
from zephon_stream.refit import local as local_mod
from zephon_stream.refit import manifest as manifest_mod
from zephon_stream.refit.manifest import encode_manifest
from zephon_stream.refit.versions import find_latest
from zephon_stream.testing.stores import WrappedStore


def run(fn, *args):
    async def main():
        with anyio.fail_after(60):
            return await fn(*args)

    return anyio.run(main)


def zephon(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="zephon")
    add_subparser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


async def publish(prefix: str, states: list[dict[str, torch.Tensor]], store: MemoryStore | None = None,
                  **options: object) -> list[int]:
    """Publish each state as the next version; the model digests, in order."""
    options = {"chunk_bytes": 256, "keyframe_every": 100, **options}
    async with Publisher(prefix, store=store, **options) as pub:
        return [(await pub.publish(s)).model_digest for s in states]


def loaded(path: Path) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in safetensors.load(path).items()}


def count_digests(monkeypatch) -> list[int]:
    """From now on, the chunks hashed (a one-item list, counting up): a trusted file hashes none."""
    hashed = [0]
    real = local_mod.ChunkPlan.digest

    def counting(self, words):
        hashed[0] += 1
        return real(self, words)

    monkeypatch.setattr(local_mod.ChunkPlan, "digest", counting)
    return hashed


# -- bug 4: a local record is bound to its weights file and its prefix ----------------------------

@pytest.fixture
def two_prefixes(tmp_path: Path) -> dict[str, object]:
    """Prefixes A and B with two versions each of different weights in the same layout, and a
    weights file pulled to A's version 2 with its record beside it."""
    a = [model(1), step(model(1), 2, frac=0.3)]
    b = [model(7), step(model(7), 8, frac=0.3)]
    pa, pb = f"file://{tmp_path}/a/", f"file://{tmp_path}/b/"
    digests = {"a": run(publish, pa, a), "b": run(publish, pb, b)}
    weights = tmp_path / "w.safetensors"
    safetensors.save(weights, zeros_like(a[0]))
    assert zephon("refit", "pull", "--prefix", pa, "--weights", str(weights)) == 0
    assert_same(a[1], loaded(weights))
    return {"a": a, "b": b, "pa": pa, "pb": pb, "weights": weights, "digests": digests}


async def pull_file(prefix: str, weights: Path, **options: object) -> tuple[int, int]:
    """Pull `weights` in place through the Python API, its record beside it: (version, digest)."""
    state = safetensors.load(weights, writable=True)
    async with Subscriber(prefix, record=f"{weights}.refit", weights=weights, **options) as sub:
        version = await sub.pull(state, sync=state.flush)
    return version, sub.record.model_digest


@pytest.mark.parametrize("via", ["api", "cli"])
def test_older_bytes_swapped_in_are_reverified(two_prefixes, via: str, capsys) -> None:
    t = two_prefixes
    safetensors.save(t["weights"], t["a"][0])  # version 1's bytes, the record still says 2
    if via == "api":
        assert run(pull_file, t["pa"], t["weights"]) == (2, t["digests"]["a"][1])
    else:
        capsys.readouterr()
        assert zephon("refit", "pull", "--prefix", t["pa"], "--weights", str(t["weights"])) == 0
        assert capsys.readouterr().out.split() == ["version", "2", "digest", f"{t['digests']['a'][1]:016x}"]
    assert_same(t["a"][1], loaded(t["weights"]))


def test_file_rewritten_in_place_is_reverified(two_prefixes) -> None:
    t = two_prefixes
    other = t["weights"].with_name("old.safetensors")
    safetensors.save(other, t["a"][0])
    before = os.stat(t["weights"])
    with open(t["weights"], "r+b") as f:  # same inode, same size: only the times tell
        f.write(other.read_bytes())
    os.utime(t["weights"], ns=(before.st_atime_ns, before.st_mtime_ns + 10**9))
    assert run(pull_file, t["pa"], t["weights"])[0] == 2
    assert_same(t["a"][1], loaded(t["weights"]))


@pytest.mark.parametrize("via", ["api", "cli"])
def test_same_version_from_another_prefix_is_pulled(two_prefixes, via: str) -> None:
    t = two_prefixes
    for prefix, want in ((t["pb"], t["b"][1]), (t["pa"], t["a"][1])):  # both at version 2, one record
        if via == "api":
            assert run(pull_file, prefix, t["weights"])[0] == 2
        else:
            assert zephon("refit", "pull", "--prefix", prefix, "--weights", str(t["weights"])) == 0
        assert_same(want, loaded(t["weights"]))


def test_reverify_that_cannot_complete_refuses_and_leaves_the_file(two_prefixes, capsys) -> None:
    t = two_prefixes
    root = Path(t["pa"].removeprefix("file://"))
    for key in root.glob("v1/key-*"):  # the only keyframe: a chunk not at version 2 has no route left
        data = bytearray(key.read_bytes())
        data[-1] ^= 0xFF
        key.write_bytes(bytes(data))
    safetensors.save(t["weights"], t["a"][0])
    swapped = t["weights"].read_bytes()
    capsys.readouterr()
    assert zephon("refit", "pull", "--prefix", t["pa"], "--weights", str(t["weights"])) == 1
    err = capsys.readouterr().err
    assert "weights file or prefix changed" in err and "nothing was applied" in err
    assert t["weights"].read_bytes() == swapped


def test_own_writes_keep_the_record_bound(two_prefixes, monkeypatch) -> None:
    """After a pull the record holds the file's identity as our own writes left it: the next
    process trusts it without re-hashing a single chunk."""
    t = two_prefixes
    run(publish, t["pa"], [step(t["a"][1], 3)])
    assert run(pull_file, t["pa"], t["weights"])[0] == 3  # a delta applied in place
    hashed = count_digests(monkeypatch)
    assert run(pull_file, t["pa"], t["weights"])[0] == 3
    assert hashed == [0]


def test_record_loaded_without_weights_file_is_verified_once(tmp_path: Path) -> None:
    store, states = MemoryStore(), [model(3), step(model(3), 4, frac=0.3)]

    async def go() -> None:
        await publish("p/", states, store)
        replica = zeros_like(states[0])
        assert await Subscriber("p/", store=store, record=tmp_path / "rec").pull(replica) == 2
        other = zeros_like(states[0])  # not what the record describes
        assert await Subscriber("p/", store=store, record=tmp_path / "rec").pull(other) == 2
        assert_same(states[1], other)

    run(go)


def test_a_record_the_state_does_not_hold_is_not_its_version_when_the_pull_cannot_rebuild(tmp_path: Path) -> None:
    # a restarted rollout process: fresh weights, the old record file (version 3), and the keyframe gone.
    # The pull failed saying "the state stays at version 3", and subscriber.version said 3 over random weights
    store, states = MemoryStore(), [model(3), step(model(3), 4, frac=0.3), step(model(3), 5, frac=0.3)]

    async def go() -> None:
        await publish("p/", states, store)
        assert await Subscriber("p/", store=store, record=tmp_path / "rec").pull(zeros_like(states[0])) == 3
        for key in [k for k in store.objects if k.startswith("p/v1/key-0.")]:
            del store.objects[key]
        sub = Subscriber("p/", store=store, record=tmp_path / "rec")
        assert sub.version == 3  # the record's claim, not checked yet
        fresh = {k: torch.rand_like(v.float()).to(v.dtype) for k, v in states[0].items()}
        with pytest.raises(Exception) as err:
            await sub.pull(fresh)
        notes = " ".join(getattr(err.value, "__notes__", []))
        assert "holds none of the versions it could build on" in notes and "stays at version 3" not in notes
        assert sub.version == 0
        with pytest.raises(Exception, match="would have digest"):
            await sub.pull(fresh)  # the record stays (its chunks that match still save a joiner's whole read)
        assert sub.version == 0
        with pytest.raises(ObjectNotFound) as err:  # a joiner names what is gone
            await Subscriber("p/", store=store).pull(zeros_like(states[0]))
        assert "deleted by hand" in " ".join(err.value.__notes__)
        sub2 = Subscriber("p/", store=store, record=tmp_path / "rec")
        assert await sub2.pull(states[2]) == 3 and sub2.version == 3  # the state it names: trusted again

    run(go)


def test_record_with_wrong_chunk_count_is_not_trusted(tmp_path: Path) -> None:
    store, states = MemoryStore(), [model(3), step(model(3), 4, frac=0.3)]

    async def go() -> None:
        await publish("p/", states, store)
        replica = zeros_like(states[0])
        sub = Subscriber("p/", store=store, record=tmp_path / "rec")
        assert await sub.pull(replica) == 2
        rec = msgspec.structs.replace(sub.record, version=1, digests=[5])  # hand-edited: one digest
        (tmp_path / "rec").write_bytes(msgspec.msgpack.encode(rec))
        replica = zeros_like(states[0])
        assert await Subscriber("p/", store=store, record=tmp_path / "rec").pull(replica) == 2
        assert_same(states[1], replica)

    run(go)


def test_record_naming_another_model_is_rebuilt_not_refused(tmp_path: Path) -> None:
    """A record whose model digest does not chain into the next version is not proof of a forked
    prefix when the record itself is in doubt: the state is rebuilt from the keyframe."""
    store, states = MemoryStore(), [model(3), step(model(3), 4, frac=0.3)]

    async def go() -> None:
        await publish("p/", states[:1], store)
        sub = Subscriber("p/", store=store, record=tmp_path / "rec")
        assert await sub.pull(zeros_like(states[0])) == 1
        (tmp_path / "rec").write_bytes(msgspec.msgpack.encode(msgspec.structs.replace(sub.record, model_digest=5)))
        await publish("p/", states[1:], store)
        replica = zeros_like(states[0])
        assert await Subscriber("p/", store=store, record=tmp_path / "rec").pull(replica) == 2
        assert_same(states[1], replica)

    run(go)


def test_record_location_is_canonical(tmp_path: Path) -> None:
    def prefix_identity(prefix: str, store: MemoryStore | None = None) -> str:  # what a record is bound to
        return str(location(prefix, store=store))

    (tmp_path / "d").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "d")
    same = [f"file://{tmp_path}/d", f"file://{tmp_path}/d/", f"file://{tmp_path}//d/", f"file://{tmp_path}/x/../d/",
            f"file://localhost{tmp_path}/d/", f"file://{tmp_path}/link/"]
    assert len({prefix_identity(p) for p in same}) == 1
    assert prefix_identity(f"file://{tmp_path}/e/") != prefix_identity(same[0])
    assert prefix_identity("s3://b/p") == prefix_identity("s3://b/p/") != prefix_identity("s3://c/p/")
    store = MemoryStore()
    assert prefix_identity("p/", store) == prefix_identity("p/", store) != prefix_identity("p/", MemoryStore())


@pytest.mark.parametrize("bad", [b"\x00" * 10, msgspec.msgpack.encode({"version": -1}),
                                 msgspec.msgpack.encode({"digests": ["x"]}), b"\x81\xa7version\xcb\x00"])
def test_bad_record_is_one_data_error(tmp_path: Path, bad: bytes) -> None:
    (tmp_path / "rec").write_bytes(bad)
    with pytest.raises(DataError, match="unreadable local version record"):
        Subscriber("memory://x/", record=tmp_path / "rec")


def test_record_path_mistakes_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="is a directory"):
        Subscriber("memory://x/", record=tmp_path)
    with pytest.raises(ConfigError, match="does not exist"):
        Subscriber("memory://x/", record=tmp_path / "nope" / "rec")


# -- bug 6: nothing makes a prefix unusable -------------------------------------------------------

@pytest.mark.parametrize(("option", "value"), [
    ("chunk_bytes", 1 << 31), ("chunk_bytes", 0), ("chunk_bytes", 12), ("chunk_bytes", 4.5), ("chunk_bytes", True),
    ("keyframe_every", 0), ("keep_versions", -1), ("workers", 0), ("threads", 0), ("level", 23), ("level", "1"),
    ("session", "xyz"), ("session", "ABCDEF0123"),
])
def test_bad_publisher_setting_refused_before_anything_is_written(option: str, value: object) -> None:
    store = MemoryStore()
    with pytest.raises(ConfigError) as exc:
        Publisher("p/", store=store, **{option: value})
    assert repr(value) in str(exc.value) or str(value) in str(exc.value)
    assert store.objects == {}


def test_a_value_that_is_not_a_tensor_is_refused_before_anything_is_written() -> None:
    store = MemoryStore()

    async def go() -> None:
        async with Publisher("p/", store=store) as pub:
            with pytest.raises(ConfigError, match=r"state_dict\['step'\] is int, not a tensor: a refit version holds"):
                await pub.publish({"w": torch.zeros(4), "step": 3})  # an AttributeError on `.shape`, before

    anyio.run(go)
    assert store.objects == {}


def test_bad_subscriber_setting_refused() -> None:
    for option, value in (("workers", 0), ("staged_bytes", -1), ("threads", 0)):
        with pytest.raises(ConfigError, match=option):
            Subscriber("memory://x/", **{option: value})


def _meta(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.empty(shape, device="meta")


@pytest.mark.parametrize(("make", "says"), [
    (_meta, "on the meta device and holds no data"),
    (lambda shape: torch.zeros(shape).to_sparse(), "is sparse_coo: a refit moves dense tensors"),
    (lambda shape: torch.zeros(shape[::-1]).t(), "is not contiguous"),
])
def test_a_tensor_with_no_dense_data_is_refused_at_publish_and_at_pull(make, says: str) -> None:
    """A meta tensor (a model built under torch.device("meta") and not yet allocated) was
    published through a task group's error, and a pull into one said it had applied the
    version while writing nowhere."""
    store = MemoryStore()
    with pytest.raises(ConfigError, match=says):
        run(publish, "bad/", [{"weight": make((4, 8))}], store)
    assert store.objects == {}
    run(publish, "good/", [{"weight": torch.randn(4, 8)}], store)

    async def pull(state: dict[str, torch.Tensor] | None, module: torch.nn.Module | None = None) -> int:
        async with Subscriber("good/", store=store, module=module) as sub:
            return await sub.pull(state)

    with pytest.raises(ConfigError, match=says):
        run(pull, {"weight": make((4, 8))})
    if make is _meta:
        with torch.device("meta"):
            module = torch.nn.Linear(8, 4, bias=False)
        with pytest.raises(ConfigError, match=says):
            run(pull, None, module)


def test_cli_chunk_bytes_over_the_limit_exits_2_and_writes_nothing(tmp_path: Path, capsys) -> None:
    weights = tmp_path / "w.safetensors"
    safetensors.save(weights, model(1))
    (tmp_path / "p").mkdir()
    assert zephon("refit", "publish", "--prefix", f"file://{tmp_path}/p/", "--weights", str(weights),
                  "--chunk-bytes", "2147483648") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--chunk-bytes 2147483648 is out of range" in err[0] and "multiple of 8" not in err[0]
    assert list((tmp_path / "p").iterdir()) == []
    assert zephon("refit", "publish", "--prefix", f"file://{tmp_path}/p/", "--weights", str(weights),
                  "--chunk-bytes", "2GiB") == 2  # a size, as --max-shard-size takes (an int only, before)
    assert "--chunk-bytes 2147483648" in capsys.readouterr().err  # the flag, not the setting (chunk_bytes=...)
    for flag in ("--keyframe-every", "--keep-versions", "--workers"):
        assert zephon("refit", "publish", "--prefix", f"file://{tmp_path}/p/", "--weights", str(weights), flag,
                      "0") == 2
        assert capsys.readouterr().err == f"zephon refit publish: error: {flag} 0 must be an int >= 1\n"
    assert zephon("refit", "publish", "--prefix", f"file://{tmp_path}/p/", "--weights", str(weights),
                  "--chunk-bytes", "64KiB") == 0


def test_layout_no_reader_accepts_is_refused_before_writing(monkeypatch) -> None:
    store = MemoryStore()

    async def go(state: dict[str, torch.Tensor], **options: object) -> None:
        async with Publisher("p/", store=store, **{"chunk_bytes": 8, **options}) as pub:
            await pub.publish(state)

    with pytest.raises(ConfigError, match="at most 16 dims"):
        run(go, {"w": torch.zeros((1,) * 17)})
    with pytest.raises(ConfigError, match=r"splits tensors \['nope'\]"):
        run(functools.partial(go, sharding=Sharding(0, 2, {"nope": 0}), session="ab" * 4), {"w": torch.zeros(4)})
    monkeypatch.setattr(manifest_mod, "MAX_MANIFEST_BYTES", 64 << 10)
    with pytest.raises(ConfigError, match="raise chunk_bytes"):
        run(go, {"w": torch.zeros(1 << 16)})  # 32768 chunks of 8 bytes
    assert store.objects == {}


@pytest.mark.parametrize("latest", [b'{"version": -5}', b'{"version": 0}', b'{"version": "2"}', b"\xff\x00",
                                    b'{"version": 99}', b'{"version": 1e400}', b" " * 10_000 + b'{"version": 1}'])
def test_latest_is_only_a_hint(latest: bytes) -> None:
    store, states = MemoryStore(), [model(1), step(model(1), 2), step(model(1), 3)]

    async def go() -> None:
        await publish("p/", states[:2], store)
        await store.put("p/LATEST", latest)
        assert await find_latest(store, "p/") == 2
        replica = zeros_like(states[0])
        assert await Subscriber("p/", store=store).pull(replica) == 2
        assert_same(states[1], replica)
        await publish("p/", states[2:], store)
        assert await find_latest(store, "p/") == 3
        kept = ("p/v1/", "p/v2/", "p/v3/", "p/LATEST")
        assert not [o.key for o in await store.list("p/") if not o.key.startswith(kept)]

    run(go)


async def _corrupt_manifest(store: MemoryStore, key: str) -> None:
    await store.put(key, b"\x93not a manifest")


async def _oversized_chunk_bytes(store: MemoryStore, key: str) -> None:
    """A head committed by a publisher that did not check chunk_bytes (as before this fix)."""
    m, _ = manifest_mod.decode_manifest(await store.read(key), key)
    await store.put(key, encode_manifest(msgspec.structs.replace(m, chunk_bytes=1 << 31)))


async def _corrupt_objects(store: MemoryStore, key: str) -> None:
    for o in await store.list(key.removesuffix("MANIFEST")):
        if not o.key.endswith("MANIFEST"):
            await store.put(o.key, b"junk")


async def _missing_objects(store: MemoryStore, key: str) -> None:
    for o in await store.list(key.removesuffix("MANIFEST")):
        if not o.key.endswith("MANIFEST"):
            await store.delete(o.key)


async def _too_large(store: MemoryStore, key: str) -> None:
    await store.put(key, b"\x00" * (manifest_mod.MAX_MANIFEST_BYTES + 1))


_MANIFEST_DAMAGE = [_corrupt_manifest, _oversized_chunk_bytes, _too_large]


@pytest.mark.parametrize("damage", [*_MANIFEST_DAMAGE, _corrupt_objects, _missing_objects])
def test_publisher_publishes_a_keyframe_past_a_corrupt_head(damage, monkeypatch) -> None:
    """A new publisher must rebuild its shadow from the head, so any damage to it is found; one
    whose shadow is already at the head reads only the head's MANIFEST."""
    monkeypatch.setattr(manifest_mod, "MAX_MANIFEST_BYTES", 1 << 20)
    store, states = MemoryStore(), [model(1), step(model(1), 2), step(model(1), 3), step(model(1), 4)]

    async def go() -> None:
        await publish("p/", states[:2], store)
        await damage(store, "p/v2/MANIFEST")
        for publisher in ("fresh", "same") if damage in _MANIFEST_DAMAGE else ("fresh",):
            async with Publisher("p/", store=store, chunk_bytes=256, keyframe_every=100) as pub:
                if publisher == "same":
                    head = await pub.publish(states[1])
                    await damage(store, f"p/v{head.version}/MANIFEST")
                info = await pub.publish(states[2])
                assert info.keyframe and info.base_version is None
                assert (await pub.publish(states[3])).base_version == info.version  # deltas go on from it
            replica = zeros_like(states[0])
            assert await Subscriber("p/", store=store).pull(replica) == info.version + 1
            assert_same(states[3], replica)

    run(go)


def test_status_reports_a_bad_version_and_goes_on(tmp_path: Path, capsys) -> None:
    prefix = f"file://{tmp_path}/p/"
    run(publish, prefix, [model(1), step(model(1), 2), step(model(1), 3)])
    (tmp_path / "p" / "v2" / "MANIFEST").write_bytes(b"garbage")
    capsys.readouterr()
    assert zephon("refit", "status", "--prefix", prefix) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "latest 3"
    assert [ln.split()[:2] for ln in lines[2:]] == [["1", "-"], ["2", "unusable:"], ["3", "2"]]
    assert "v2/MANIFEST" in lines[3]


def test_a_delta_manifest_without_its_base_digest_is_unusable(tmp_path: Path, capsys) -> None:
    """A MANIFEST whose `base_model_digest` key is damaged (the field then absent) was taken as
    valid, and the pull's chain check formatted None: a TypeError traceback (a new-user trial
    flipped each byte of a MANIFEST; 34 of 1,828 flips, all in that key, crashed)."""
    prefix = f"file://{tmp_path}/p/"
    run(publish, prefix, [model(1), step(model(1), 2)])
    path = tmp_path / "p" / "v2" / "MANIFEST"
    data = path.read_bytes()
    at = data.index(b"base_model_digest")
    path.write_bytes(data[:at + 2] + bytes([data[at + 2] ^ 1]) + data[at + 3:])
    with pytest.raises(DataError, match="invalid manifest for version 2: base_version and base_model_digest come "
                                        "together"):
        manifest_mod.decode_manifest(path.read_bytes(), "v2/MANIFEST")
    capsys.readouterr()
    assert zephon("refit", "status", "--prefix", prefix) == 0
    assert [ln.split()[:2] for ln in capsys.readouterr().out.splitlines()[2:]] == [["1", "-"], ["2", "unusable:"]]
    weights = tmp_path / "w.safetensors"
    assert zephon("refit", "pull", "--prefix", prefix, "--weights", str(weights)) != 0
    err = capsys.readouterr().err
    assert "Traceback" not in err and "base_version and base_model_digest come together" in err, err


def test_a_prefix_may_be_a_local_folder_path(tmp_path: Path, monkeypatch, capsys) -> None:
    """As a loader source's path may (it said: unsupported URI scheme ... use file://)."""
    import torch
    from safetensors.torch import save_file

    monkeypatch.chdir(tmp_path)
    save_file({"a": torch.arange(8, dtype=torch.float32)}, "m.safetensors")
    assert zephon("refit", "publish", "--prefix", "versions", "--weights", "m.safetensors") == 0
    assert (tmp_path / "versions" / "v1" / "MANIFEST").is_file()
    capsys.readouterr()
    assert zephon("refit", "status", "--prefix", "./versions/") == 0
    assert capsys.readouterr().out.splitlines()[0] == "latest 1"
    assert zephon("refit", "pull", "--prefix", f"{tmp_path}/versions", "--weights", "copy.safetensors") == 0
    assert (tmp_path / "copy.safetensors").read_bytes() == (tmp_path / "m.safetensors").read_bytes()
    capsys.readouterr()
    assert zephon("refit", "publish", "--prefix", "memory://cli-note/", "--weights", "m.safetensors") == 0
    assert capsys.readouterr().err == ("zephon refit publish: note: memory://cli-note/ is in this process's memory: "
                                       "the version is gone when the command exits (file:// or s3:// keep it)\n")


def test_a_pull_into_another_model_names_the_file_and_the_prefix(tmp_path: Path, monkeypatch, capsys) -> None:
    from safetensors.torch import save_file

    monkeypatch.chdir(tmp_path)
    save_file({"a": torch.arange(8, dtype=torch.float32)}, "m.safetensors")
    save_file({"b": torch.arange(8, dtype=torch.float32)}, "other.safetensors")
    assert zephon("refit", "publish", "--prefix", "versions", "--weights", "m.safetensors") == 0
    capsys.readouterr()
    assert zephon("refit", "pull", "--prefix", "versions", "--weights", "other.safetensors") == 2
    assert capsys.readouterr().err == (  # it said only "state_dict does not match the tensor table: ..."
        f"zephon refit pull: error: --weights other.safetensors against the versions under "
        f"file://{tmp_path}/versions/: state_dict does not match the tensor table: missing ['a'], unexpected ['b']\n"
        "  if the published model's layout changed (names, shapes, dtypes), delete other.safetensors and its record "
        "other.safetensors.refit to pull the new layout whole\n")


def test_a_failed_pull_into_a_new_file_leaves_no_record(tmp_path: Path, monkeypatch, capsys) -> None:
    """The file is not made, and neither is its record (a `new.safetensors.refit` stayed behind)."""
    from safetensors.torch import save_file

    monkeypatch.chdir(tmp_path)
    save_file({"a": torch.arange(8, dtype=torch.float32)}, "m.safetensors")
    assert zephon("refit", "publish", "--prefix", "versions", "--weights", "m.safetensors") == 0
    key = next(p for p in (tmp_path / "versions" / "v1").iterdir() if p.name.startswith("key-"))
    data = bytearray(key.read_bytes())
    data[len(data) // 2] ^= 1
    key.write_bytes(bytes(data))
    assert zephon("refit", "pull", "--prefix", "versions", "--weights", "new.safetensors") == 1
    assert "corrupt object" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors", "versions"]


def test_status_of_an_empty_or_missing_prefix_says_so(tmp_path: Path, capsys) -> None:
    """A typo in --prefix printed `latest 0` and an empty table, as a healthy store does."""
    (tmp_path / "empty").mkdir()
    for name, note in (("nope", " (its folder does not exist)"), ("empty", "")):
        assert zephon("refit", "status", "--prefix", f"file://{tmp_path}/{name}/") == 0
        out, err = capsys.readouterr()
        assert out.splitlines()[0] == "latest 0" and len(out.splitlines()) == 2
        assert err == f"no version is published under file://{tmp_path}/{name}/{note}\n", err


def test_a_prefix_that_is_a_file_is_one_line(tmp_path: Path, capsys) -> None:
    (tmp_path / "w.safetensors").write_bytes(b"x" * 16)
    for argv in (["status", "--prefix", f"file://{tmp_path}/w.safetensors"],
                 ["pull", "--prefix", f"file://{tmp_path}/w.safetensors/", "--weights", str(tmp_path / "new")]):
        assert zephon("refit", *argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "w.safetensors/ is a file, not a folder" in err, err


def test_manifest_chunk_bytes_messages_name_the_real_fault() -> None:
    store = MemoryStore()

    async def go() -> None:
        await publish("p/", [model(1)], store)
        m, _ = manifest_mod.decode_manifest(await store.read("p/v1/MANIFEST"), "k")
        for cb, want in ((1 << 31, "over the limit of 1073741824"), (1020, "not a multiple of 8")):
            with pytest.raises(DataError, match=want):
                manifest_mod.decode_manifest(encode_manifest(msgspec.structs.replace(m, chunk_bytes=cb)), "k")

    run(go)


# -- a MANIFEST is read at most to its size limit + 1 byte -----------------------------------------

class RecordingStore(WrappedStore):
    """A MemoryStore that records each read's (key, start, end)."""

    def __init__(self, inner: MemoryStore) -> None:
        super().__init__(inner)
        self.reads: list[tuple[str, int, int | None]] = []

    async def read(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        self.reads.append((key, start, end))
        return await self.inner.read(key, start, end)

    async def aclose(self) -> None:
        pass


def test_oversized_manifest_is_refused_after_limit_plus_one_bytes(monkeypatch) -> None:
    limit = 4096
    inner = MemoryStore()
    store = RecordingStore(inner)

    async def go() -> None:
        await publish("p/", [model(1)], inner)
        monkeypatch.setattr(manifest_mod, "MAX_MANIFEST_BYTES", limit)
        await inner.put("p/v2/MANIFEST", b"\x00" * (3 * limit))
        with pytest.raises(RefitError, match=r"p/v2/MANIFEST is 12288 bytes, over the 4096-byte limit"):
            await Subscriber("p/", store=store).pull(zeros_like(model(1)))
        with pytest.raises(RefitError, match="12288 bytes"):
            await manifest_mod.read_bounded(store, "p/v2/MANIFEST")

    run(go)
    manifests = [(s, e) for k, s, e in store.reads if k.endswith("MANIFEST")]
    assert manifests and all(s == 0 and e is not None and e - s <= limit + 1 for s, e in manifests)


def test_read_bounded_passes_small_objects_and_missing_keys() -> None:
    store = MemoryStore()

    async def go() -> None:
        await store.put("k", b"x" * 10)
        assert await manifest_mod.read_bounded(store, "k", 10) == b"x" * 10
        with pytest.raises(RefitError, match="k is 10 bytes, over the 9-byte limit"):
            await manifest_mod.read_bounded(store, "k", 9)
        with pytest.raises(ObjectNotFound):
            await manifest_mod.read_bounded(store, "missing")

    run(go)


# -- safetensors: bad headers are one-line errors ---------------------------------------------------

def _file(header: object, data: bytes = b"\x00" * 16, raw: bytes | None = None) -> bytes:
    text = raw if raw is not None else json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


_T = {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}
BAD_SAFETENSORS = {
    "huge header length": struct.pack("<Q", 1 << 62) + b"{}",
    "header past the file": struct.pack("<Q", 100) + b"{}",
    "not json": _file(None, raw=b"{nope"),
    "not utf-8": _file(None, raw=b'{"\xff": 1}'),
    "deep nesting": _file(None, raw=b"[" * 100_000 + b"]" * 100_000),
    "5000-digit int": _file(None, raw=b'{"x": {"dtype": "F32", "shape": [' + b"9" * 5000
                            + b'], "data_offsets": [0, 16]}}'),
    "a list": _file([1, 2]),
    "entry not an object": _file({"x": [1]}),
    "missing key": _file({"x": {"dtype": "F32", "shape": [4]}}),
    "extra key": _file({"x": {**_T, "more": 1}}),
    "unknown dtype": _file({"x": {**_T, "dtype": "F128"}}),
    "shape a string": _file({"x": {**_T, "shape": "4"}}),
    "float dim": _file({"x": {**_T, "shape": [4.0]}}),
    "bool dim": _file({"x": {**_T, "shape": [True, 4]}}),
    "negative dim": _file({"x": {**_T, "shape": [-4]}}),
    "too many dims": _file({"x": {**_T, "shape": [1] * 65 + [4]}}),
    "offsets string": _file({"x": {**_T, "data_offsets": ["0", "16"]}}),
    "three offsets": _file({"x": {**_T, "data_offsets": [0, 8, 16]}}),
    "begin after end": _file({"x": {**_T, "shape": [0], "data_offsets": [16, 0]}}),
    "end past the data": _file({"x": {**_T, "data_offsets": [8, 24]}}),
    "negative offset": _file({"x": {**_T, "data_offsets": [-16, 0]}}),
    "shape disagrees": _file({"x": {**_T, "shape": [3]}}),
    "overlap": _file({"x": {**_T, "shape": [2], "data_offsets": [0, 8]},
                      "y": {**_T, "shape": [2], "data_offsets": [4, 12]}}),
    "duplicate name": _file(None, raw=b'{"x": ' + json.dumps(_T).encode() + b', "x": '
                            + json.dumps(_T).encode() + b"}"),
}


@pytest.mark.parametrize("name", sorted(BAD_SAFETENSORS))
def test_bad_safetensors_is_one_line_data_error(tmp_path: Path, name: str) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(BAD_SAFETENSORS[name])
    for writable in (False, True):
        with pytest.raises(DataError) as exc:
            safetensors.load(path, writable=writable)
        assert "\n" not in str(exc.value) and str(path) in str(exc.value) and len(str(exc.value)) < 400


@pytest.mark.parametrize("name", ["overlap", "shape disagrees", "end past the data"])
def test_cli_bad_safetensors_exits_2_with_one_line(tmp_path: Path, name: str, capsys) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(BAD_SAFETENSORS[name])
    for command in ("publish", "pull"):
        assert zephon("refit", command, "--prefix", f"file://{tmp_path}/p/", "--weights", str(path)) == 2
        assert len(capsys.readouterr().err.strip().splitlines()) == 1


@pytest.mark.parametrize("what", ["missing", "directory"])
def test_cli_missing_or_directory_weights_exit_2(tmp_path: Path, what: str, capsys) -> None:
    path = tmp_path / "w.safetensors"
    if what == "directory":
        path.mkdir()
    commands = ("publish", "pull") if what == "directory" else ("publish",)  # pull creates a missing file
    for command in commands:
        assert zephon("refit", command, "--prefix", f"file://{tmp_path}/p/", "--weights", str(path)) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and str(path) in err[0] and ("no such file" in err[0] or "is a directory" in err[0])


def test_cli_pull_creates_a_missing_weights_file_whole_and_bound(tmp_path: Path, monkeypatch, capsys) -> None:
    """A new rollout worker has no weights file yet: `pull` makes one from the newest version's
    tensor table, fills it under another name and gives it the name once it is whole. The
    record is bound to it, so the next pull trusts it without re-hashing."""
    states = [model(5), step(model(5), 6, frac=0.3)]
    prefix, path = f"file://{tmp_path}/p/", tmp_path / "w.safetensors"
    assert zephon("refit", "pull", "--prefix", prefix, "--weights", str(path)) == 1  # nothing published yet
    assert "nothing was pulled" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == []
    digests = run(publish, prefix, states[:1])
    real = Subscriber.pull

    async def cut(self, state, **kw):  # a pull that fails halfway leaves no file at the name
        raise RefitError("cut")

    monkeypatch.setattr(Subscriber, "pull", cut)
    assert zephon("refit", "pull", "--prefix", prefix, "--weights", str(path)) == 1
    assert sorted(os.listdir(tmp_path)) == ["p"]
    monkeypatch.setattr(Subscriber, "pull", real)
    capsys.readouterr()
    assert zephon("refit", "pull", "--prefix", prefix, "--weights", str(path)) == 0
    assert capsys.readouterr().out.split() == ["version", "1", "digest", f"{digests[0]:016x}", "(created", f"{path})"]
    assert sorted(os.listdir(tmp_path)) == ["p", "w.safetensors", "w.safetensors.refit"]
    assert_same(states[0], loaded(path))
    hashed = count_digests(monkeypatch)
    assert zephon("refit", "pull", "--prefix", prefix, "--weights", str(path)) == 0
    assert hashed == [0]  # the record was bound to the file under its own name
    run(publish, prefix, states[1:])
    assert zephon("refit", "pull", "--prefix", prefix, "--weights", str(path)) == 0
    assert_same(states[1], loaded(path))


def _sharded(root: Path, state: dict[str, torch.Tensor]) -> Path:
    """`state` as a Hugging Face sharded checkpoint under `root`: two files and their index."""
    names = sorted(state)
    parts = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    root.mkdir(exist_ok=True)
    for file, held in parts.items():
        safetensors.save(root / file, {n: state[n] for n in held})
    index = root / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": {n: f for f, held in parts.items() for n in held}}))
    return index


def test_cli_publishes_and_pulls_a_sharded_checkpoint_by_its_index(tmp_path: Path, monkeypatch, capsys) -> None:
    """A model over 5 GB is saved by Hugging Face in shards with an index: the CLI took one file."""
    states = [model(11), step(model(11), 12, frac=0.3)]
    prefix = f"file://{tmp_path}/p/"
    src, dst = _sharded(tmp_path / "src", states[0]), _sharded(tmp_path / "dst", zeros_like(states[0]))

    def held(index: Path) -> dict[str, torch.Tensor]:
        return {k: v for f in sorted(index.parent.glob("*.safetensors")) for k, v in loaded(f).items()}

    for state in states:
        _sharded(tmp_path / "src", state)
        assert zephon("refit", "publish", "--prefix", prefix, "--weights", str(src)) == 0
        assert zephon("refit", "pull", "--prefix", prefix, "--weights", str(dst)) == 0
        assert_same(state, held(dst))
    hashed = count_digests(monkeypatch)
    assert zephon("refit", "pull", "--prefix", prefix, "--weights", str(dst)) == 0
    assert hashed == [0]  # the record is bound to both files
    second = dst.parent / "model-00002-of-00002.safetensors"
    safetensors.save(second, {k: torch.zeros_like(v) for k, v in loaded(second).items()})  # rewritten: verified again
    assert zephon("refit", "pull", "--prefix", prefix, "--weights", str(dst)) == 0
    assert hashed[0] > 0
    assert_same(states[1], held(dst))
    capsys.readouterr()
    index = json.loads(dst.read_text())
    index["weight_map"].pop(sorted(index["weight_map"])[0])
    dst.write_text(json.dumps(index))
    assert zephon("refit", "pull", "--prefix", prefix, "--weights", str(dst)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not hold the tensors its index gives it: 0 missing [], 1 not in the index" in err[0]


def test_cli_pull_lays_out_a_new_sharded_checkpoint_whole_and_bound(tmp_path: Path, monkeypatch, capsys) -> None:
    """A new rollout worker of a model over 5 GB: `pull` into a missing index makes Hugging Face's
    sharded layout (files of at most --max-shard-size, named and indexed as save_pretrained
    names them), fills it under other names, and gives the index its name last."""
    shapes = {f"layers.{i}.w": ((64, 32), torch.bfloat16) for i in range(5)} | {"norm": ((32,), torch.float32)}
    states = [model(21, shapes), step(model(21, shapes), 22, frac=0.3)]
    prefix, new = f"file://{tmp_path}/p/", tmp_path / "new"
    index = new / "model.safetensors.index.json"
    new.mkdir()
    run(publish, prefix, states[:1])
    real = Subscriber.pull

    async def cut(self, state, **kw):  # a pull that fails halfway leaves nothing behind
        raise RefitError("cut")

    monkeypatch.setattr(Subscriber, "pull", cut)
    assert zephon("refit", "pull", "--prefix", prefix, "--weights", str(index), "--max-shard-size", "9KB") == 1
    assert os.listdir(new) == []
    monkeypatch.setattr(Subscriber, "pull", real)
    capsys.readouterr()
    assert zephon("refit", "pull", "--prefix", prefix, "--weights", str(index), "--max-shard-size", "9KB") == 0
    out = capsys.readouterr().out.split()
    assert out[:3] + out[4:] == ["version", "1", "digest", "(created", str(index), "and", "its", "3", "files)"]
    files = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]  # 4 KiB a layer: two a file
    assert sorted(os.listdir(new)) == sorted([*files, index.name, f"{index.name}.refit"])
    written = json.loads(index.read_text())
    assert written["metadata"] == {"total_size": sum(t.numel() * t.element_size() for t in states[0].values())}
    assert sorted(set(written["weight_map"].values())) == files and sorted(written["weight_map"]) == sorted(shapes)
    assert all(os.path.getsize(new / f) < 9000 + 1000 for f in files)

    def held() -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in safetensors.load_index(index).items()}

    assert_same(states[0], held())
    hashed = count_digests(monkeypatch)
    assert zephon("refit", "pull", "--prefix", prefix, "--weights", str(index)) == 0
    assert hashed == [0]  # the record was bound to the three files under their own names
    run(publish, prefix, states[1:])
    assert zephon("refit", "pull", "--prefix", prefix, "--weights", str(index)) == 0
    assert_same(states[1], held())
    # files already there that a new layout would replace: refused, and left as they are
    one = tmp_path / "one"
    one.mkdir()
    safetensors.save(one / "model.safetensors", {"other": torch.ones(3)})  # a checkpoint under 5 GB: no index
    capsys.readouterr()
    assert zephon("refit", "pull", "--prefix", prefix, "--weights", str(one / "model.safetensors.index.json")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"but {one}/model.safetensors is there, which the new checkpoint's files would " \
        f"replace; to update it in place, pull into it: --weights {one}/model.safetensors" in err[0], err
    assert sorted(os.listdir(one)) == ["model.safetensors"] and list(loaded(one / "model.safetensors")) == ["other"]
    (new / index.name).unlink()  # an index lost: its files are still there
    assert zephon("refit", "pull", "--prefix", prefix, "--weights", str(index), "--max-shard-size", "9KB") == 2
    assert f"but {new}/{files[0]} is there" in capsys.readouterr().err
    assert_same(states[1], {k: v for f in files for k, v in loaded(new / f).items()})
    # one file's worth: Hugging Face's single-file name, and an index for the path asked for
    (tmp_path / "small").mkdir()
    small = tmp_path / "small" / "model.safetensors.index.json"
    assert zephon("refit", "pull", "--prefix", prefix, "--weights", str(small)) == 0
    assert capsys.readouterr().out.split()[4:] == ["(created", str(small), "and", "model.safetensors)"]
    assert sorted(os.listdir(small.parent)) == ["model.safetensors", small.name, f"{small.name}.refit"]
    assert_same(states[1], loaded(small.parent / "model.safetensors"))


def test_shard_files_splits_as_hugging_face_does() -> None:
    """The same files, tensor for tensor, as huggingface_hub's split (what save_pretrained uses)."""
    from huggingface_hub import split_torch_state_dict_into_shards

    g, seen = torch.Generator().manual_seed(3), set()
    for trial in range(200):
        n = int(torch.randint(1, 12, (1,), generator=g))
        state = {f"t{trial}.{i}": torch.zeros(int(torch.randint(0, 6000, (1,), generator=g)),
                                              dtype=[torch.float32, torch.bfloat16, torch.int8][i % 3])
                 for i in range(n)}
        bound = int(torch.randint(1000, 12000, (1,), generator=g))
        ours = safetensors.shard_files({k: (t.dtype, tuple(t.shape)) for k, t in state.items()}, bound)
        theirs = split_torch_state_dict_into_shards(state, max_shard_size=bound)
        assert ours == theirs.filename_to_tensors, (trial, bound)
        seen |= {"one file" if len(ours) == 1 else "files", *(["a tensor over the bound"] if any(
            t.numel() * t.element_size() > bound for t in state.values()) else [])}
    assert seen == {"one file", "files", "a tensor over the bound"}


def test_cli_record_directory_exits_2(tmp_path: Path, capsys) -> None:
    weights = tmp_path / "w.safetensors"
    safetensors.save(weights, model(1))
    assert zephon("refit", "pull", "--prefix", f"file://{tmp_path}/p/", "--weights", str(weights),
                  "--record", str(tmp_path)) == 2
    assert "is a directory" in capsys.readouterr().err


def test_safetensors_save_refuses_a_dtype_it_cannot_hold(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="complex64"):
        safetensors.save(tmp_path / "w.safetensors", {"z": torch.zeros(2, dtype=torch.complex64)})



@pytest.mark.parametrize("cut", ["cancel-scope", "wait_for"])
def test_a_pull_cut_short_by_a_timeout_ends_bit_exact_on_the_next(cut: str) -> None:
    """A rollout worker's timeout around `pull` (a cancel scope, or asyncio's own `wait_for`) may
    stop it halfway through writing the weights in place; the next pull still ends on the
    trainer's bits, version after version."""
    import asyncio
    import random

    rng = random.Random(7)

    async def go() -> int:
        store, cuts = MemoryStore(), 0
        torch.manual_seed(0)
        state = {f"w{i}": torch.randn(128, 1024) for i in range(8)}  # 4 MiB: a pull takes milliseconds
        replica = zeros_like(state)
        async with Publisher("m/", store=store, chunk_bytes=1 << 17) as pub, Subscriber("m/", store=store) as sub:
            for n in range(1, 7):
                for t in state.values():
                    t.view(-1)[torch.randint(0, t.numel(), (4000,))] += 1.0
                await pub.publish(state)
                timeout = 0.0005  # the first try of every version is cut
                while True:
                    if cut == "wait_for":
                        try:
                            got = await asyncio.wait_for(sub.pull(replica), timeout)
                            break
                        except asyncio.TimeoutError:
                            pass
                    else:
                        with anyio.move_on_after(timeout) as scope:
                            got = await sub.pull(replica)
                        if not scope.cancelled_caught:
                            break
                    cuts += 1
                    timeout = rng.uniform(0.001, 0.05)
                assert got == n
                assert_same(replica, state)
        return cuts

    assert run(go) >= 6
