"""Chat rendering cost against the number of assistant turns, with and without generation marks.

    .venv/bin/python bench/chat.py [--turns 2 8 32 128] [--seconds 0.5]

Conversations of the Python FAQ's text (the Debian docs that `make bench-data` fetches; this
repository's README where they are absent), `--turns` user/assistant pairs each, rendered with
the tests' written-out ChatML and Qwen 2.5 tool templates. For each it prints the mean time of
`ChatTemplate.spans` (the trained spans, as the loader finds them) over a `--seconds` loop:
unmarked (prefix renders), with `{% generation %}` marks, unmarked with `last_assistant`, and one
plain render, with the ratio of the unmarked spans to the marked.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests._chat_data import CHATML, CHATML_GEN, QWEN_TOOLS, QWEN_TOOLS_GEN
from zephon_stream.chat import ChatTemplate


def _paragraphs() -> list[str]:
    from tools.corpus import ensure_debian_docs

    root = ensure_debian_docs()
    faq = root / "usr/share/doc/python3.11/html/_sources/faq" if root else None
    files = sorted(faq.glob("*.rst.txt")) if faq is not None and faq.is_dir() else [
        Path(__file__).resolve().parents[1] / "README.md"]
    return [p.strip() for f in files for p in f.read_text(encoding="utf-8").split("\n\n") if len(p.strip()) > 40]


def _mean(fn, seconds: float) -> float:
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        fn()
        n += 1
    return (time.perf_counter() - t0) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, nargs="+", default=[2, 8, 32, 128])
    ap.add_argument("--seconds", type=float, default=0.5)
    args = ap.parse_args()
    text = _paragraphs()
    print("mean ms per conversation: unmarked spans | marked spans | unmarked last_assistant | one render | ratio")
    for turns in args.turns:
        conv = [{"role": "system", "content": text[0]}]
        for i in range(turns):
            conv += [{"role": "user", "content": text[(2 * i + 1) % len(text)]},
                     {"role": "assistant", "content": text[(2 * i + 2) % len(text)]}]
        for name, plain, marked in (("chatml", CHATML, CHATML_GEN), ("qwen-tools", QWEN_TOOLS, QWEN_TOOLS_GEN)):
            p, m = ChatTemplate(plain, name), ChatTemplate(marked, name)
            p._warned_long = True  # the bench knows
            a = _mean(lambda p=p, conv=conv: p.spans(conv, "assistant"), args.seconds)
            b = _mean(lambda m=m, conv=conv: m.spans(conv, "assistant"), args.seconds)
            c = _mean(lambda p=p, conv=conv: p.spans(conv, "last_assistant"), args.seconds)
            d = _mean(lambda p=p, conv=conv: p.render(conv), args.seconds)
            print(f"{turns:4d} turns {name:10s} {a * 1e3:8.2f} | {b * 1e3:6.2f} | {c * 1e3:6.2f} | {d * 1e3:6.2f} | "
                  f"{a / b:6.1f}x")


if __name__ == "__main__":
    main()
