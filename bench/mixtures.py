"""Realized source shares around a mixture change, on real text (the demo corpus).

    .venv/bin/python bench/mixtures.py [--root data/demo] [--change 120] [--steps 240] [--shuffle-scope source]
        [--piece-tokens N]

Data: `tools.corpus.build_demo` (Debian's documentation as prose, the standard library's
sources as code; the Debian packages come from the apt cache, fetched by `make demo`). The run
mixes prose 0.7 / code 0.3, then a `[[schedule]]` entry switches to 0.3 / 0.7 at `--change`.
Prints, for every window of 100 consecutive steps that starts 10 or more steps after a change
(step 0 counts as one) and ends before the next, the largest gap between a source's realized
token share (from the `--digests` field `source_tokens`) and its weight, in percentage points.
The goal is under 1 point at 12 lanes. `--shuffle-scope lane` (one window after the mix) shows
how long documents drawn before the change stay in a lane's window. `--piece-tokens N` cuts
documents longer than N tokens into pieces before the mix (the config's `piece_tokens`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's tools/ (not in the wheel)
from tools.corpus import build_demo
from zephon_stream import Config, Loader, SourceConfig
from zephon_stream.loader.config import ScheduleEntry
from zephon_stream.operators.collate import source_tokens

SPAN, SETTLE = 100, 10


def step_tokens(config: Config, steps: int, backend: str) -> list[dict[str, int]]:
    """Real tokens per source in each global batch of the first `steps`."""
    names = [s.name for s in config.sources]
    out = []
    with Loader(config, backend=backend) as loader:
        for batch in loader:
            per_step = dict.fromkeys(names, 0)
            for sample in source_tokens(batch, names):
                for name, n in sample.items():
                    per_step[name] += n
            out.append(per_step)
            if loader.step == steps:
                break
    return out


def worst_gaps(config: Config, tokens: list[dict[str, int]]) -> list[tuple[int, float]]:
    """(first step, largest |share - weight| in points) of every window of SPAN steps starting
    SETTLE or more steps after a change and ending before the next one."""
    changes = config.weights_by_step()
    gaps = []
    for (start, weights), (end, _) in zip(changes, changes[1:] + [(len(tokens), None)]):
        target = [w / sum(weights) for w in weights]
        for first in range(start + SETTLE, end - SPAN + 1):
            window = tokens[first:first + SPAN]
            total = sum(sum(t.values()) for t in window)
            shares = [sum(t[s.name] for t in window) / total for s in config.sources]
            gaps.append((first, 100 * max(abs(a - b) for a, b in zip(shares, target))))
    return gaps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", type=Path, default=Path("data/demo"))
    ap.add_argument("--change", type=int, default=120)
    ap.add_argument("--steps", type=int, default=240)
    ap.add_argument("--global-batch-size", type=int, default=24)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--shuffle-window", type=int, default=64)
    ap.add_argument("--shuffle-scope", choices=["lane", "source"], default="source")
    ap.add_argument("--backend", default="threads")
    ap.add_argument("--piece-tokens", type=int, default=0, help="the config's piece_tokens (0: documents whole)")
    args = ap.parse_args()
    demo = build_demo(args.root)
    config = Config(
        seed=1234, lanes=12, seq_len=args.seq_len, global_batch_size=args.global_batch_size,
        tokenizer=demo.tokenizer, shuffle_window=args.shuffle_window, shuffle_scope=args.shuffle_scope,
        piece_tokens=args.piece_tokens,
        sources=[SourceConfig(name="prose", uri=f"file://{demo.sources['prose']}/", weight=0.7),
                 SourceConfig(name="code", uri=f"file://{demo.sources['code']}/", weight=0.3)],
        schedule=[ScheduleEntry(args.change, {"prose": 0.3, "code": 0.7})])
    tokens = step_tokens(config, args.steps, args.backend)
    gaps = worst_gaps(config, tokens)
    for label, part in (("before the change", [g for f, g in gaps if f < args.change]),
                        ("after the change", [g for f, g in gaps if f >= args.change])):
        if part:
            print(f"{label}: {len(part)} windows of {SPAN} steps, largest gap {max(part):.2f} points, "
                  f"median {statistics.median(part):.2f}")
    around = [sum(t["code"] for t in tokens[s:s + 5]) / max(1, sum(sum(t.values()) for t in tokens[s:s + 5]))
              for s in range(max(0, args.change - 10), min(len(tokens), args.change + 30), 5)]
    print("code share by 5 steps from change-10:", " ".join(f"{100 * a:.0f}" for a in around))
    return 0


if __name__ == "__main__":
    sys.exit(main())
