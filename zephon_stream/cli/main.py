"""The `zephon` command: stream, inspect and config for the loader; refit and relay for weights."""

from __future__ import annotations

import argparse
import errno
import hashlib
import json
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from zephon_stream.errors import ZephonError
from zephon_stream.loader.config import Config
from zephon_stream.loader.state import state_from_bytes, state_to_bytes

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="zephon", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("stream", help="stream batches of a config; print digests or progress")
    p.add_argument("config", type=Path)
    p.add_argument("--steps", type=int, default=None, help="global batches to stream (default: until the end)")
    p.add_argument("--dp-rank", type=int, default=0)
    p.add_argument("--dp-size", type=int, default=1)
    p.add_argument("--backend", choices=["inline", "threads", "processes"], default=None)
    p.add_argument("--digests", action="store_true", help="print one JSON line per sample this rank receives")
    p.add_argument("--save-state", type=Path, help="write the rank's state_dict() here ...")
    p.add_argument("--save-at", type=int, help="... once this many global steps have been consumed")
    p.add_argument("--resume", type=Path, nargs="+", help="state files to load first (several when ranks merge)")
    p.set_defaults(func=_stream)

    p = sub.add_parser("inspect", help="print one global batch decoded back to text")
    p.add_argument("config", type=Path)
    p.add_argument("--step", type=int, required=True)
    p.add_argument("--backend", choices=["inline", "threads", "processes"], default=None)
    p.set_defaults(func=_inspect)

    p = sub.add_parser("config", help="print a config in full, defaults included")
    p.add_argument("config", type=Path)
    p.set_defaults(func=lambda a: print(Config.from_toml(a.config).to_toml(), end="") or 0)

    _add_optional(sub)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ZephonError as exc:
        print(f"zephon: error: {exc}", file=sys.stderr)
        return 2
    except MemoryError:
        print("zephon: error: out of memory: the config asks for more than this machine has; lower seq_len, "
              "global_batch_size, lanes, or the buffer settings (sample_buffer, sample_batch, doc_buffer)",
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `zephon ... | head`: the reader left; that is not an error
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _add_optional(sub: Any) -> None:
    """Subcommands that live with their packages (refit, relay), when those are installed."""
    import importlib

    for module in ("zephon_stream.cli.refit", "zephon_stream.cli.relay"):
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise
            continue
        mod.add_subparser(sub)


@contextmanager
def _user_path(option: str, path: Path) -> Iterator[None]:
    """Turn an OSError on a path the user gave into a one-line error naming the option."""
    try:
        yield
    except OSError as exc:
        hint = {errno.ENOENT: "check the path",
                errno.EISDIR: "give a file, not a directory",
                errno.ENOTDIR: "a part of the path is not a directory",
                errno.EACCES: "check the permissions"}.get(exc.errno or 0, "check the path")
        raise ZephonError(f"{option} {str(path)!r}: {exc.strerror or exc}; {hint}") from exc


def _check_output(option: str, path: Path) -> None:
    """Refuse an output path before the work that would end in writing it."""
    if path.is_dir():
        raise ZephonError(f"{option} {str(path)!r} is a directory: give a file path")
    if not path.parent.is_dir():
        raise ZephonError(f"{option} {str(path)!r}: directory {str(path.parent)!r} does not exist; create it first")


def _save_state(loader: Any, path: Path) -> None:
    with _user_path("--save-state", path):
        path.write_bytes(state_to_bytes(loader.state_dict()))


def _stream(args: argparse.Namespace) -> int:
    from zephon_stream.loader.loader import Loader

    if (args.save_state is None) != (args.save_at is None):
        raise ZephonError("--save-state and --save-at go together")
    if args.save_state is not None:
        _check_output("--save-state", args.save_state)
    loader = Loader(Config.from_toml(args.config), dp_rank=args.dp_rank, dp_size=args.dp_size, backend=args.backend)
    if args.resume:
        states = []
        for f in args.resume:
            with _user_path("--resume", f):
                states.append(state_from_bytes(f.read_bytes()))
        loader.load_state_dict(states)
    progress = _Progress(loader) if not args.digests else None
    if args.save_at is not None and loader.step == args.save_at:
        _save_state(loader, args.save_state)
    stop = None if args.steps is None else args.steps
    out = sys.stdout
    for batch in _batches(loader, stop):
        if args.digests:
            ids = batch["input_ids"].numpy().astype("<u4")
            for row, slot, lane, n in zip(ids, batch["slots"].tolist(), batch["lanes"].tolist(),
                                          batch["num_tokens"].tolist()):
                out.write(json.dumps({"step": batch["step"], "slot": slot, "lane": lane, "tokens": n,
                                      "sha256": hashlib.sha256(row.tobytes()).hexdigest()}) + "\n")
        elif progress:
            progress.update()
        if args.save_at is not None and loader.step == args.save_at:
            _save_state(loader, args.save_state)
    if progress:
        progress.finish()
    return 0


def _batches(loader: Any, stop: int | None) -> Any:
    """Batches until global step `stop` (steps continue from a resumed position)."""
    if stop is not None and loader.step >= stop:
        return
    for batch in loader:
        yield batch
        if stop is not None and loader.step >= stop:
            return


class _Progress:
    """A live line on a terminal; a line every 5 s otherwise (on stderr, so stdout stays data)."""

    def __init__(self, loader: Any) -> None:
        self.loader, self.t0, self.last = loader, time.perf_counter(), 0.0
        self.tty = sys.stderr.isatty()

    def update(self, final: bool = False) -> None:
        now = time.perf_counter()
        if not final and now - self.last < (0.2 if self.tty else 5.0):
            return
        self.last = now
        st = self.loader.statistics()
        rate = st.tokens / max(now - self.t0, 1e-9)
        line = (f"step {st.step}  samples {st.samples}  tokens {st.tokens}  {rate:,.0f} tok/s  "
                f"buffers {st.buffered_batches}/{st.buffer_capacity} (peak {st.peak_buffered_batches})  "
                f"skipped {st.skipped_records + st.skipped_shards}")
        sys.stderr.write(("\r" + line + "\x1b[K") if self.tty else line + "\n")
        sys.stderr.flush()

    def finish(self) -> None:
        self.update(final=True)
        if self.tty:
            sys.stderr.write("\n")


def _inspect(args: argparse.Namespace) -> int:
    from zephon_stream.loader.loader import Loader

    loader = Loader(Config.from_toml(args.config), dp_rank=0, dp_size=1, backend=args.backend)
    for batch in loader:
        if batch["step"] == args.step:
            _print_batch(loader, batch)
            return 0
    raise ZephonError(f"the data ended before step {args.step}")


def _print_batch(loader: Any, batch: dict[str, Any]) -> None:
    bounds = batch["cu_seqlens"].tolist()
    seq_len = batch["input_ids"].shape[1]
    flat = batch["input_ids"].reshape(-1).tolist()
    print(f"# global batch {batch['step']}: {len(batch['slots'])} samples of {seq_len} tokens; "
          "documents are separated by ⟦|⟧, padding is not shown")
    for b, (slot, lane, n) in enumerate(zip(batch["slots"].tolist(), batch["lanes"].tolist(),
                                            batch["num_tokens"].tolist())):
        pieces = [loader.tokenizer.decode(flat[a:e]) for a, e in zip(bounds, bounds[1:])
                  if b * seq_len <= a < b * seq_len + n]
        print(f"\n## slot {slot} (lane {lane}, {n} tokens)\n" + "⟦|⟧".join(pieces))


if __name__ == "__main__":
    sys.exit(main())
