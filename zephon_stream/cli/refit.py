"""`zephon refit publish|pull|status`: the refit relay from the command line.

    zephon refit publish --prefix URI --weights FILE.safetensors [--keyframe-every K] [--workers N]
    zephon refit pull    --prefix URI --weights FILE.safetensors [--workers N]   (updates FILE in place,
                                                                           or creates it whole)
    zephon refit status  --prefix URI

Building the parser imports no torch (`zephon relay --help` stays fast); `publish` and `pull`
load it when they run.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING, Any

import anyio

from zephon_stream.connectors import open_store
from zephon_stream.errors import ConfigError, DataError, RefitError, ZephonError
from zephon_stream.refit.versions import find_latest, list_versions, read_manifest

if TYPE_CHECKING:
    from zephon_stream.refit.safetensors import Mapped

__all__ = ["add_subparser"]


def add_subparser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `refit` command to an argparse subparsers object; each command sets `func`."""
    p = subparsers.add_parser("refit", help="publish, pull and inspect delta-compressed weight versions")
    sub = p.add_subparsers(dest="refit_command", required=True)
    pub = sub.add_parser("publish", help="publish a safetensors file as the next version")
    pub.add_argument("--prefix", required=True, help="file:///dir/, s3://bucket/prefix/ or memory://name/")
    pub.add_argument("--weights", required=True, metavar="FILE",
                     help="the .safetensors file to publish, or a sharded checkpoint's model.safetensors.index.json")
    pub.add_argument("--keyframe-every", type=int, default=10, metavar="K",
                     help="publish a full keyframe every K versions, deltas between (default 10)")
    pub.add_argument("--keep-versions", type=int, default=8, metavar="N",
                     help="versions kept under the prefix; older ones are deleted (default 8)")
    pub.add_argument("--chunk-bytes", type=int, default=4 << 20, metavar="B",
                     help="bytes per chunk, the unit of upload and digest (default 4 MiB)")
    pub.add_argument("--overwrite", action="store_true", help="also publish overwrite objects (for retries)")
    pub.add_argument("--workers", type=int, default=4, metavar="N", help="chunks encoded and uploaded concurrently")
    pub.set_defaults(func=_publish)
    pull = sub.add_parser("pull", help="update a safetensors file in place to the latest version")
    pull.add_argument("--prefix", required=True, metavar="URI", help="where the versions were published")
    pull.add_argument("--weights", required=True, metavar="FILE",
                      help="the .safetensors file to update in place (a missing one is created from the newest "
                           "version), or a sharded checkpoint's model.safetensors.index.json")
    pull.add_argument("--record", metavar="FILE", help="local version record (default: FILE.refit beside the weights)")
    pull.add_argument("--workers", type=int, default=4, metavar="N", help="chunks fetched and checked concurrently")
    pull.set_defaults(func=_pull)
    st = sub.add_parser("status", help="list versions, their sizes and keyframes")
    st.add_argument("--prefix", required=True, metavar="URI", help="where the versions were published")
    st.set_defaults(func=_status)
    return p


def _guard(fn: Any) -> Any:
    """Run a command: a user's mistake (a bad setting or input file) exits 2, a refused or failed
    operation exits 1, each with one line (and the error's notes) on stderr."""
    def run(args: argparse.Namespace) -> int:
        try:
            return anyio.run(fn, args)
        except ZephonError as exc:
            print(f"zephon refit {args.refit_command}: error: {exc}", file=sys.stderr)
            for note in getattr(exc, "__notes__", []):
                print(f"  {note}", file=sys.stderr)
            return 2 if isinstance(exc, ConfigError) else 1

    return run


def _weights(path: str, *, writable: bool = False) -> Mapped:
    """The weights file, or a sharded checkpoint's index (`*.index.json`: all its files as one
    state), or ConfigError (exit 2): a missing, unreadable or malformed file is the user's to fix."""
    from zephon_stream.refit import safetensors  # torch

    try:
        if _is_index(path):
            return safetensors.load_index(path, writable=writable)
        return safetensors.load(path, writable=writable)
    except ZephonError as exc:
        raise ConfigError(f"--weights {path}: {exc}") from exc


def _is_index(path: str) -> bool:
    return path.endswith(".json")


@_guard
async def _publish(args: argparse.Namespace) -> int:
    from zephon_stream.refit.publisher import Publisher  # torch

    state = _weights(args.weights)
    async with Publisher(args.prefix, keyframe_every=args.keyframe_every, keep_versions=args.keep_versions,
                         chunk_bytes=args.chunk_bytes, overwrite=args.overwrite, workers=args.workers) as pub:
        info = await pub.publish(state)
    kind = "keyframe" if info.keyframe else "delta"
    print(f"version {info.version} digest {info.model_digest:016x} {kind} delta_bytes {info.delta_bytes} "
          f"key_bytes {info.key_bytes} changes {info.changes}")
    return 0


@_guard
async def _pull(args: argparse.Namespace) -> int:
    from zephon_stream.refit.subscriber import Subscriber  # torch

    # a new rollout worker: the file is made from the version's table (a sharded one's files are its own to lay out)
    new = not os.path.lexists(args.weights) and not _is_index(args.weights)
    if _is_index(args.weights) and not os.path.lexists(args.weights):
        single = os.path.join(os.path.dirname(args.weights), "model.safetensors")
        raise ConfigError(f"--weights {args.weights}: no such index. A pull updates a sharded checkpoint in place "
                          f"but does not lay one out: to start a new worker, pull into one file (--weights {single}), "
                          "which loaders of Hugging Face checkpoints read as well")
    record = args.record or f"{args.weights}.refit"
    if new:
        weights = await _new_weights(args)
        if weights is None:
            raise RefitError(f"no version is published under {args.prefix}: nothing was pulled, {args.weights} was "
                             "not created")
    else:
        weights = args.weights
    try:
        state = _weights(weights, writable=True)
        async with Subscriber(args.prefix, record=record, weights=state.files or weights,
                              workers=args.workers) as sub:
            version = await sub.pull(state, sync=state.flush)
            if new:  # complete: it takes its name, and the record is bound to the file under it
                del state
                os.replace(weights, args.weights)
                await sub._rebind(args.weights)
    finally:
        if new and os.path.lexists(weights):
            os.unlink(weights)
    if version == 0:
        raise RefitError(f"no version is published under {args.prefix}: nothing was pulled, {args.weights} is "
                         "unchanged")
    made = f" (created {args.weights})" if new else ""
    print(f"version {version} digest {sub.record.model_digest:016x}{made}")
    return 0


async def _new_weights(args: argparse.Namespace) -> str | None:
    """A zero-filled safetensors file beside `--weights` that holds the newest version's tensors
    (None: no version is published). A pull fills it; it takes the file's name when complete,
    so a file at that name is always a whole version."""
    import torch

    from zephon_stream.refit import safetensors

    if not os.path.isdir(os.path.dirname(os.path.abspath(args.weights))):
        raise ConfigError(f"--weights {args.weights}: directory {os.path.dirname(args.weights)!r} does not exist")
    store, prefix = open_store(args.prefix)
    async with store:
        latest = await find_latest(store, prefix)
        got = await read_manifest(store, prefix, latest) if latest else None
    if got is None:
        return None
    table = got[1]
    tensors = {spec.name: (getattr(torch, spec.dtype), spec.shape) for spec in table.specs}
    partial = f"{args.weights}.partial"
    safetensors.allocate(partial, tensors)
    return partial


@_guard
async def _status(args: argparse.Namespace) -> int:
    store, prefix = open_store(args.prefix)
    async with store:
        latest = await find_latest(store, prefix)
        print(f"latest {latest}")
        print(f"{'version':>8} {'base':>6} {'keyframe':>8} {'delta_bytes':>12} {'key_bytes':>12} "
              f"{'changes':>10} {'ratio':>8} digest")
        for v in await list_versions(store, prefix):
            try:
                got = await read_manifest(store, prefix, v)
            except (DataError, RefitError) as exc:  # one bad version: say so, and show the others
                print(f"{v:>8} unusable: {exc}")
                continue
            if got is None:
                continue
            m = got[0]
            ratio = f"{m.model_bytes / m.delta_bytes:.1f}x" if m.delta_bytes else "-"
            print(f"{v:>8} {m.base_version or '-':>6} {'yes' if m.keyframe else 'no':>8} {m.delta_bytes:>12} "
                  f"{m.key_bytes:>12} {m.changes:>10} {ratio:>8} {m.model_digest:016x}")
    return 0
