"""`make demo`: stream a real-text mixture from the local store, checkpoint, resume, and check.

1. Builds a small dataset of real documentation (Debian's kernel and Python manuals when apt can
   fetch them, else the standard library's docstrings) plus stdlib source code, and trains a BPE
   tokenizer on it: no model hub.
2. Streams 40 global batches on one rank with progress on stderr (a live bar on a terminal,
   plain lines otherwise), saving a checkpoint file at step 20.
3. Resumes from that file on two ranks with the processes backend and checks that steps 20..39
   are byte-identical to the uninterrupted run.
4. The same for images and text: Tux Paint's stamps (captioned images, fetched once with apt-get
   into the cache) mixed with the prose, 10 steps, cut at step 5, resumed on two ranks: pixels
   included, byte-identical. Skipped with a note if the stamps cannot be fetched.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's tools/ (not in the wheel)
from tools.corpus import build_demo, debian_fetch_notice
from zephon_stream import Config, Loader, SourceConfig, state_from_bytes, state_to_bytes
from zephon_stream.cli.progress import StreamProgress
from zephon_stream.testing.determinism import batch_records

STEPS, CUT = 40, 20


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("root", nargs="?", default="data/demo", help="where the dataset is built (default data/demo)")
    root = Path(parser.parse_args().root).resolve()
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the dataset build's steps, off a terminal
    notice = debian_fetch_notice()
    if notice:
        print(notice, flush=True)
    t = time.perf_counter()
    demo = build_demo(root)
    print(f"dataset: {root} ({', '.join(f'{k}: {v} docs' for k, v in demo.docs.items())}; "
          f"{demo.origin}) in {time.perf_counter() - t:.1f}s")
    config = Config(
        seed=1234, lanes=12, seq_len=512, global_batch_size=24, tokenizer=demo.tokenizer, shuffle_window=64,
        sources=[SourceConfig(name="prose", uri=f"file://{demo.sources['prose']}/", weight=0.7),
                 SourceConfig(name="code", uri=f"file://{demo.sources['code']}/", weight=0.3)])
    toml = root / "stream.toml"
    toml.write_text(config.to_toml())
    print(f"config: {toml}\n")

    loader = Loader(config)
    records, state = [], None
    progress = StreamProgress(loader.statistics, total=STEPS)
    for batch in progress.track(loader):
        records += batch_records(batch)
        if loader.step == CUT:
            state = loader.state_dict()
        if loader.step == STEPS:
            break
    progress.close()
    loader.close()
    ckpt = root / f"loader-step{CUT}.state"
    ckpt.write_bytes(state_to_bytes(state))
    print(f"checkpoint at step {CUT}: {ckpt} ({ckpt.stat().st_size} bytes for {config.lanes} lanes)")
    state = state_from_bytes(ckpt.read_bytes())  # resume from the file, as a restarted job would

    resumed = []
    for rank in range(2):
        t = time.perf_counter()
        with Loader(config, dp_rank=rank, dp_size=2, backend="processes") as part:
            part.load_state_dict(state)
            for batch in part:
                resumed += batch_records(batch)
                if part.step == STEPS:
                    break
        print(f"rank {rank} of 2 resumed at step {CUT}, streamed to step {STEPS} in {time.perf_counter() - t:.1f} s")
    resumed.sort(key=lambda r: r[1])
    want = [r for r in records if r[0] >= CUT]
    digest = hashlib.sha256("".join(r[4] for r in want).encode()).hexdigest()[:16]
    if resumed != want:
        print("MISMATCH: the resumed continuation differs from the uninterrupted run", file=sys.stderr)
        return 1
    print(f"resumed on 2 ranks (processes backend): steps {CUT}..{STEPS - 1}, {len(want)} samples "
          f"byte-identical to the uninterrupted run (digest {digest}): continuation matched")
    vision = images_and_text(root, demo)
    if vision is None:
        return 1
    zephon = _command("zephon")
    print(f"\nnext: {zephon} stream {toml} --steps 5 --digests | head -3;  {zephon} inspect {toml} --step 0 | head -20"
          + (f";  {zephon} inspect {vision} --step 2 | head -5" if vision else ""))
    return 0


def _command(name: str) -> str:
    """`name` as it can be pasted into a shell here: bare when the shell finds this environment's, else
    its path (`.venv/bin/zephon` when the venv is not activated)."""
    mine = Path(sys.executable).parent / name
    if shutil.which(name) == str(mine) or not mine.exists():
        return name
    try:
        return str(mine.relative_to(Path.cwd()))
    except ValueError:
        return str(mine)


def _stream(config: Config, rank: int, size: int, backend: str, state: object, stop: int) -> tuple[list, object]:
    """(records of the batches up to step `stop`, the state at step 5) of one rank."""
    records, at5 = [], None
    with Loader(config, dp_rank=rank, dp_size=size, backend=backend) as loader:
        if state is not None:
            loader.load_state_dict(state)
        for batch in loader:
            records += batch_records(batch)
            at5 = loader.state_dict() if loader.step == 5 else at5
            if loader.step == stop:
                break
    return records, at5


def images_and_text(root: Path, demo: object) -> Path | bool | None:
    """Part 4: the image+text config's TOML path; False when the stamps cannot be had; None on a mismatch."""
    from tools.vlm import build_vlm_demo
    from zephon_stream import VisionConfig

    print("\nimages and text: Tux Paint's stamps (tuxpaint-stamps-default: a 161 MB apt-get download the first "
          "time, 30 MB kept in the cache)", flush=True)
    vlm = build_vlm_demo(root / "vlm")
    if vlm is None:
        print("  skipped: the stamps could not be fetched (apt-get download tuxpaint-stamps-default)")
        return False
    config = Config(
        seed=1234, lanes=12, seq_len=1024, global_batch_size=24, tokenizer=vlm.tokenizer, shuffle_window=16,
        vision=VisionConfig(vision_start_token="<|vision_start|>", vision_end_token="<|vision_end|>",
                            max_pixels=28 * 28 * 256),
        sources=[SourceConfig(name="stamps", uri=f"file://{vlm.shards}/", weight=0.5, image_field="png",
                              text_field="txt"),
                 SourceConfig(name="prose", uri=f"file://{demo.sources['prose']}/", weight=0.5)])
    toml = root / "vision.toml"
    toml.write_text(config.to_toml())
    t = time.perf_counter()
    records, state = _stream(config, 0, 1, "threads", None, 10)
    images = sum(1 for r in records if ":" in r[4])
    print(f"  streamed 10 steps ({images} samples with images) in {time.perf_counter() - t:.1f} s; config {toml}")
    resumed = []
    for rank in range(2):
        resumed += _stream(config, rank, 2, "processes", state, 10)[0]
    resumed.sort(key=lambda r: r[1])
    if resumed != [r for r in records if r[0] >= 5]:
        print("MISMATCH: the resumed image+text continuation differs", file=sys.stderr)
        return None
    print("  resumed at step 5 on 2 ranks (processes backend): steps 5..9 byte-identical, pixels included")
    return toml


if __name__ == "__main__":
    sys.exit(main())
