"""The `zephon` command: stream, inspect and config for the loader; refit and relay for weights."""

from __future__ import annotations

import argparse
import difflib
import errno
import json
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

from zephon_stream.engine.signals import ctrl_c_after
from zephon_stream.errors import ZephonError

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    args = _parse(build_parser(), _glued(sys.argv[1:] if argv is None else argv))
    prog = f"zephon {args.command}"  # as a usage error, `zephon shard` and `zephon refit` say
    try:
        return args.func(args)
    except ZephonError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except MemoryError:
        print(f"{prog}: error: out of memory: the config asks for more than this machine has; lower seq_len, "
              "global_batch_size, lanes, or the buffer settings (sample_buffer, sample_batch, doc_buffer)",
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 143 if _TERMINATED else 130  # 128 + the signal, as a shell reports it
    except BrokenPipeError:  # `zephon ... | head`: the reader left; that is not an error
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """`parser.parse_args(argv)`, with an unknown argument blamed on the subcommand it was given to
    (`zephon refit pull: error: unrecognized arguments: --version 1`), not on `zephon` itself."""
    _ARGV[:] = argv  # for `_Parser.error`, which argparse calls with the message alone
    args, extra = parser.parse_known_args(argv)
    if extra:
        used = parser
        for word in argv:  # down the subcommands named, as argparse went
            subs = {name: p for action in used._actions if isinstance(action, argparse._SubParsersAction)
                    for name, p in action.choices.items()}
            if word in subs:
                used = subs[word]
        used.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def _glued(argv: list[str]) -> list[str]:
    """`--set-weights -1:web=1` as `--set-weights=-1:web=1`: argparse takes a value that starts with
    `-` (and is no plain negative number) for an option, and said "expected one argument" instead
    of what is wrong with the step."""
    out: list[str] = []
    for arg in argv:
        if out and out[-1] == "--set-weights" and arg.startswith("-") and ":" in arg:
            out[-1] = f"--set-weights={arg}"
        else:
            out.append(arg)
    return out


_ARGV: list[str] = []  # the arguments being parsed (see `_parse`)


class _Parser(argparse.ArgumentParser):
    """A usage error is one line, like every other error (argparse prints the whole usage first)."""

    def error(self, message: str) -> NoReturn:
        if re.search(r"unrecognized arguments: (.* )?--config\b", message):
            message += "; the config file is given by itself: zephon stream CONFIG.toml (inspect, config too)"
        if message.startswith("the following arguments are required"):  # a typo of one is named: --prefx
            known = [o for o in self._option_string_actions if o.startswith("--")]
            typos = [a.split("=")[0] for a in _ARGV if a.startswith("--") and a.split("=")[0] not in known]
            near = [(t, difflib.get_close_matches(t, known, n=1)) for t in typos]
            message += "".join(f"; {t} is not one of its options{f' (did you mean {m[0]}?)' if m else ''}"
                               for t, m in near)
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _count(text: str, what: str = "step") -> int:
    """An argparse type: an integer >= 0 (a step; `_rank` for a rank)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative: give a {what} >= 0")
    return value


def _rank(text: str) -> int:
    return _count(text, "rank")


_BACKEND_HELP = "where the lanes run (default: the config's backend, threads unless set)"


def build_parser() -> argparse.ArgumentParser:
    """The `zephon` command line: every subcommand and option (each with help text)."""
    from zephon_stream import __version__

    parser = _Parser(prog="zephon", description=__doc__)
    parser.add_argument("--version", action="version", version=f"zephon-stream {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("stream", help="stream batches of a config; print digests or progress",
                       description=_STREAM_DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", type=Path, help="the config's TOML file")
    p.add_argument("--steps", type=_count, metavar="N",
                   help="the global step to stop at: stop once N global batches have been consumed, counted "
                        "from the start of training (after --resume from step 20, --steps 40 streams 20 more); "
                        "default: until the data ends")
    p.add_argument("--dp-rank", type=_rank, default=0, metavar="R", help="this data-parallel rank (default 0)")
    p.add_argument("--dp-size", type=int, default=1, metavar="N",
                   help="data-parallel ranks in all; must divide lanes and global_batch_size (default 1)")
    p.add_argument("--backend", choices=["inline", "threads", "processes", "ray"], default=None, help=_BACKEND_HELP)
    p.add_argument("--digests", action="store_true",
                   help="print one JSON line per sample this rank receives (step, slot, lane, tokens, sha256, "
                        "images, pixels_sha256, source_tokens, trained) instead of progress")
    p.add_argument("--save-state", type=Path, metavar="FILE",
                   help="write this rank's state_dict() to FILE once --save-at global steps are consumed; "
                        "without --save-at, where the stream stops (--steps, the end of the data, or Ctrl-C)")
    p.add_argument("--save-at", type=_count, metavar="STEP",
                   help="the global step at which --save-state is written (at most --steps)")
    p.add_argument("--resume", type=Path, nargs="+", metavar="FILE",
                   help="state files to load first (several when ranks merge)")
    _add_set_weights(p)
    p.set_defaults(func=_stream)

    p = sub.add_parser("inspect", help="print one global batch decoded back to text",
                       description="Print global batch --step of a config decoded back to text: each sample with its "
                                   "slot and lane, each document piece opened by its source's name, image spans and "
                                   "chat sources' trained text marked.")
    p.add_argument("config", type=Path, help="the config's TOML file")
    p.add_argument("--step", type=_count, required=True, help="the global step to print (0 is the first batch)")
    p.add_argument("--resume", type=Path, nargs="+", metavar="FILE",
                   help="start from these state files (a checkpoint at or before --step) instead of step 0")
    p.add_argument("--backend", choices=["inline", "threads", "processes", "ray"], default=None, help=_BACKEND_HELP)
    _add_set_weights(p)
    p.set_defaults(func=_inspect)

    p = sub.add_parser("config", help="print a config in full, defaults included",
                       description="Print a config in full, defaults included, as TOML that `zephon stream` reads "
                                   "back (the same batches): the settings a run really used.")
    p.add_argument("config", type=Path, help="the config's TOML file")
    p.set_defaults(func=_config)

    _add_optional(sub)
    return parser


def _config(args: argparse.Namespace) -> int:
    from zephon_stream.loader.config import Config  # imported here: `zephon relay` needs no loader

    print(Config.from_toml(args.config).to_toml(), end="")
    return 0


_STREAM_DOC = """Stream the batches of a config on one data-parallel rank.

Progress goes to stderr: a live bar on a terminal, a plain line every 5 s otherwise (a log file,
a pipe). It shows the step, --steps as the total, the elapsed time, an ETA, the token rate over the
last 10 s, and how full the lanes' buffers are (prefetch: near 100% the loader is ahead of the
consumer, near 0% the consumer waits for data).
"""


def _add_set_weights(p: argparse.ArgumentParser) -> None:
    p.add_argument("--set-weights", type=_decision, action="append", default=[], metavar="STEP:NAME=W,...",
                   help="mix the sources by these weights from global step STEP on, as Loader.set_weights does "
                        "(e.g. 2000:web=0.5,code=0.5; every source named); repeatable, applied in order after "
                        "--resume (a decision the checkpoint's log holds already does nothing)")


def _decision(text: str) -> tuple[int, dict[str, float]]:
    """`STEP:NAME=W,NAME=W` -> (step, {name: weight}); the names and weights are checked by set_weights."""
    step, sep, rest = text.partition(":")
    pairs = [p.split("=") for p in rest.split(",")]
    usage = argparse.ArgumentTypeError(f"{text!r} is not STEP:NAME=WEIGHT,NAME=WEIGHT (e.g. 2000:web=0.5,code=0.5)")
    if not sep or any(len(p) != 2 for p in pairs):
        raise usage
    try:
        weights = {name.strip(): float(w) for name, w in pairs}
    except ValueError:
        raise usage from None
    twice = sorted({n.strip() for n, _ in pairs if [m.strip() for m, _ in pairs].count(n.strip()) > 1})
    if twice:
        raise argparse.ArgumentTypeError(f"{text!r} gives {', '.join(twice)} twice: give each source's weight once")
    return _count(step), weights


def _add_optional(sub: Any) -> None:
    """Subcommands that live with their packages (refit, relay), when those are installed."""
    import importlib

    for module in ("zephon_stream.cli.refit", "zephon_stream.cli.relay", "zephon_stream.cli.shard"):
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


def _save_state(loader: Any, path: Path, step: int | None = None) -> None:
    from zephon_stream.engine.files import atomic_write
    from zephon_stream.loader.state import state_to_bytes

    with _user_path("--save-state", path):  # whole or not at all: it may be the file resumed from
        atomic_write(path, [state_to_bytes(loader.state_dict(step=step))])


def _stream(args: argparse.Namespace) -> int:
    args.streaming = False  # set by `_stream_to` once its loop starts: what an interrupt says
    with _sigterm_as_ctrl_c():
        try:
            if not args.digests:
                return _stream_to(args, sys.stdout)
            # stdout is the digests': anything else this process prints goes to stderr (a library's print,
            # such as Ray's notice of a worker that died, made the lines no longer JSON lines)
            data, sys.stdout = sys.stdout, sys.stderr
            try:
                return _stream_to(args, data)
            finally:
                sys.stdout = data
        except KeyboardInterrupt:  # before the stream's loop (planning, a restore): it exited 143 in silence
            if not args.streaming:
                print(f"zephon stream: {'terminated (SIGTERM)' if _TERMINATED else 'interrupted'} before its first "
                      "batch was out: nothing was streamed; run it again as it was", file=sys.stderr)
            raise


_TERMINATED: list[int] = []  # SIGTERM came (`_sigterm_as_ctrl_c`): `main` exits 143, not 130


@contextmanager
def _sigterm_as_ctrl_c() -> Iterator[None]:
    """While the block runs, SIGTERM (a scheduler's preemption: SLURM, Kubernetes) stops the stream as
    Ctrl-C does: the state is saved where the output stopped (`--save-state`). It was the default
    action: the process ended at once, and the state file was never written. It is raised as SIGINT,
    so a write that `ctrl_c_after` holds together stays whole.

    A shell script's background job (`zephon stream ... &`, `srun ... &`) starts with SIGINT
    ignored, and Python keeps it so: the SIGINT raised for a SIGTERM was dropped, and the stream ran
    on to its end (a trial: 3 minutes, then SIGKILL in a real preemption, no state). There, while
    the block runs, SIGINT gets a handler that raises only for a SIGTERM that came: a Ctrl-C meant
    for the script's foreground stays ignored."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        _TERMINATED.append(signum)
        signal.raise_signal(signal.SIGINT)

    def sigint_still_ignored(signum: int, frame: Any) -> None:
        if _TERMINATED:
            raise KeyboardInterrupt

    ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    previous_int = signal.signal(signal.SIGINT, sigint_still_ignored) if ignored else None
    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        if ignored:
            signal.signal(signal.SIGINT, previous_int)


def _stream_to(args: argparse.Namespace, out: Any) -> int:
    _check_save_options(args)
    loader = _loader(args, args.dp_rank, args.dp_size)
    if args.steps is not None and loader.step > args.steps:
        raise ZephonError(f"--steps {args.steps} is before the resumed step {loader.step}: --steps is the global step "
                          f"to stop at, counted from the start of training; give --steps >= {loader.step}")
    if args.save_at is not None and loader.step > args.save_at:
        raise ZephonError(f"--save-at {args.save_at} is before the resumed step {loader.step}: the state there is "
                          f"already the one you resumed from; give --save-at >= {loader.step}")
    saved = _maybe_save(loader, args)
    batches = _batches(loader, args.steps)
    progress = None
    if not args.digests:
        from zephon_stream.cli.progress import StreamProgress

        progress = StreamProgress(loader.statistics, total=args.steps, start=loader.step)
        batches = progress.track(batches)
    at_the_end = args.save_state is not None and args.save_at is None  # save where the stream stops
    start = done = loader.step  # done: the global step after the last batch whose output is out
    args.streaming = True
    try:
        for batch in batches:
            with ctrl_c_after():  # the lines and `done` together: a Ctrl-C in the write left them apart
                if args.digests:
                    _write_digests(batch, out, [s.name for s in loader.config.sources])
                done = batch["step"] + 1
            saved = _maybe_save(loader, args) or saved
    except ZephonError as exc:  # a bad record, a store that stayed down: keep what was streamed, as Ctrl-C does
        if not at_the_end or done == start:
            raise
        if progress:
            progress.close()
        _save_state(loader, args.save_state, done)
        raise ZephonError(f"{exc}; the stream stopped at global step {done}, and its state is in "
                          f"{str(args.save_state)!r} (--resume it once the cause is fixed)") from exc
    except KeyboardInterrupt:  # it may land after a batch was taken and before its lines were written
        if progress:
            progress.close()
        where = f"zephon stream: {'terminated (SIGTERM)' if _TERMINATED else 'interrupted'} at global step {done}"
        with ctrl_c_after():  # a second Ctrl-C or SIGTERM waits for the state and the line (it cut the save)
            if at_the_end:  # the batches whose output is out, and no more
                _save_state(loader, args.save_state, done)
                where += f"; its state is in {str(args.save_state)!r} (--resume it to go on)"
            print(where, file=sys.stderr)
        raise
    if progress:
        progress.close(data_ended=args.steps is None or loader.step < args.steps)
    if at_the_end:
        with ctrl_c_after():
            _save_state(loader, args.save_state)
    elif args.save_at is not None and not saved:
        raise ZephonError(f"the data ended at global step {loader.step}, before --save-at {args.save_at}: "
                          f"{str(args.save_state)!r} was not written; give a smaller --save-at")
    if args.steps is not None and loader.step < args.steps:
        print(f"zephon stream: the data ended at global step {loader.step}, before --steps {args.steps} "
              f"(max_epochs = {loader.config.max_epochs}: every epoch read)", file=sys.stderr)
    return 0


def _check_save_options(args: argparse.Namespace) -> None:
    """Refuse --save-state/--save-at that could never write, before any work."""
    if args.save_at is not None and args.save_state is None:
        raise ZephonError("--save-at needs --save-state FILE: the file the state at that step is written to")
    if args.save_at is not None and args.steps is not None and args.save_at > args.steps:
        raise ZephonError(f"--save-at {args.save_at} is past --steps {args.steps}: the run stops at global step "
                          f"{args.steps} and would save nothing; give --save-at <= --steps")
    if args.save_state is not None:
        _check_output("--save-state", args.save_state)


def _maybe_save(loader: Any, args: argparse.Namespace) -> bool:
    if args.save_at is None or loader.step != args.save_at:
        return False
    _save_state(loader, args.save_state)
    return True


def _loader(args: argparse.Namespace, dp_rank: int, dp_size: int) -> Any:
    """The config's loader for this rank, with the `--resume` files loaded."""
    from zephon_stream.errors import CheckpointError
    from zephon_stream.loader.config import Config
    from zephon_stream.loader.loader import Loader
    from zephon_stream.loader.state import state_from_bytes

    config = Config.from_toml(args.config)
    with ctrl_c_after():  # a Ctrl-C or SIGTERM inside torch's import (in the Loader's) aborted the process (a
        loader = Loader(config, dp_rank=dp_rank, dp_size=dp_size, backend=args.backend)  # review: 1 of 40)
    if args.resume:
        states = []
        for f in args.resume:
            with _user_path("--resume", f):
                data = f.read_bytes()
            try:
                states.append(state_from_bytes(data))
            except CheckpointError as exc:  # of several files, the one at fault
                raise CheckpointError(f"--resume {str(f)!r}: {exc}") from exc
        loader.load_state_dict(states)
    for step, weights in args.set_weights:
        loader.set_weights(weights, at_step=step)
    return loader


def _write_digests(batch: dict[str, Any], out: Any, source_names: list[str]) -> None:
    from zephon_stream.operators.collate import sample_digests

    # one write: an interrupt lands before a batch's lines or after them, not among them
    out.write("".join(json.dumps(record) + "\n" for record in sample_digests(batch, source_names)))


def _batches(loader: Any, stop: int | None) -> Any:
    """Batches until global step `stop` (steps continue from a resumed position)."""
    if stop is not None and loader.step >= stop:
        return
    for batch in loader:
        yield batch
        if stop is not None and loader.step >= stop:
            return


def _inspect(args: argparse.Namespace) -> int:
    loader = _loader(args, 0, 1)
    if loader.step > args.step:
        raise ZephonError(f"--step {args.step} is before the resumed step {loader.step}: resume from a checkpoint "
                          f"saved at or before step {args.step}, or leave out --resume")
    carry: dict[int, bool] = {}  # per lane: whether its latest sample's last label is a target (see `_first_trained`)
    for batch in _batches(loader, args.step + 1):
        first = _first_trained(batch, carry)
        if batch["step"] == args.step:
            _print_batch(loader, batch, first)
            return 0
    raise ZephonError(f"the data ended at global step {loader.step}, before --step {args.step}")


def _first_trained(batch: dict[str, Any], carry: dict[int, bool]) -> list[bool]:
    """Whether each sample's first token is trained under shifted labels, which only the label at
    the last position of its lane's previous sample says (a lane's samples continue one another:
    that label is this token, or IGNORE); `carry` holds it per lane from batch to batch, and a
    lane not seen yet (the first batch, or the first after a resume) starts untrained."""
    from zephon_stream.operators.types import IGNORE

    out = []
    for lane, last in zip(batch["lanes"].tolist(), (batch["labels"][:, -1] != IGNORE).tolist()):
        out.append(carry.get(lane, False))
        carry[lane] = last
    return out


def _print_batch(loader: Any, batch: dict[str, Any], first: list[bool]) -> None:
    """`first`: whether each sample's first token is trained (`_first_trained`), for shifted labels."""
    import torch

    from zephon_stream.operators.images import mark_images
    from zephon_stream.operators.types import IGNORE

    bounds = batch["cu_seqlens"].tolist()
    sources = batch["segment_sources"].tolist()
    names = {i: s.name for i, s in enumerate(loader.config.sources)} | {-1: "?"}
    chat = {i for i, s in enumerate(loader.config.sources) if s.messages_field is not None}
    seq_len = batch["input_ids"].shape[1]
    flat = batch["input_ids"].reshape(-1).tolist()
    targets = batch["labels"] != IGNORE  # token p is trained when a label targets it: shifted, the one at p - 1
    if loader.config.labels != "unshifted":
        targets = torch.cat([torch.tensor(first, dtype=torch.bool).view(-1, 1), targets[:, :-1]], dim=1)
    trained = targets.reshape(-1).tolist()
    print(f"# global batch {batch['step']}: {len(batch['slots'])} samples of {seq_len} tokens; "
          "each document piece opens with ⟦its source⟧, padding is not shown"
          + ("; in chat sources ⟦+⟧ opens and ⟦-⟧ closes the text trained on" if chat else ""))
    for b, (slot, lane, n) in enumerate(zip(batch["slots"].tolist(), batch["lanes"].tolist(),
                                            batch["num_tokens"].tolist())):
        pieces = [f"⟦{names[src]}⟧" + (_marked(loader.tokenizer, flat[a:e], trained[a:e]) if src in chat
                                        else loader.tokenizer.decode(flat[a:e]))
                  for a, e, src in zip(bounds, bounds[1:], sources) if b * seq_len <= a < b * seq_len + n]
        text = "".join(pieces)
        if loader.config.vision is not None:
            text = mark_images(text, batch, b, loader.config.vision)
        print(f"\n## slot {slot} (lane {lane}, {n} tokens)\n" + text)


def _marked(tokenizer: Any, ids: list[int], trained: list[bool]) -> str:
    """The text of `ids`, each run of trained tokens between ⟦+⟧ and ⟦-⟧."""
    out, start = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or trained[i] != trained[start]:
            text = tokenizer.decode(ids[start:i])
            out.append(f"⟦+⟧{text}⟦-⟧" if trained[start] else text)
            start = i
    return "".join(out)


if __name__ == "__main__":
    sys.exit(main())
