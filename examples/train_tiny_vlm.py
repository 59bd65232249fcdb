"""Train a tiny vision-language model on Tux Paint's stamps (images with human-written captions), on CPU.

    python examples/train_tiny_vlm.py --steps 150

The data is built once into data/vlm by `tools/vlm.py` (the Debian package `tuxpaint-stamps-default`,
fetched into the cache; about 785 captioned PNGs as tar shards, and a BPE with the Qwen2-VL vision
tokens). The model is plain torch, Qwen2-VL shaped: a patch embedding over `pixel_values`, a 2x2
patch merger, and a small causal decoder whose image placeholder positions take the merged
patches. The loader hands uint8 pixels; they are normalised here, on the model's device.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tools/ lives beside the package

from zephon_stream import Config, Loader, SourceConfig
from zephon_stream.loader.config import VisionConfig
from zephon_stream.vision import normalize


class TinyVLM(nn.Module):
    def __init__(self, vocab: int, row: int, merge: int, d: int = 128, layers: int = 2, heads: int = 4,
                 max_len: int = 512) -> None:
        super().__init__()
        self.merge2 = merge * merge
        self.patch = nn.Sequential(nn.Linear(row, d), nn.GELU(), nn.Linear(d, d))
        self.merger = nn.Sequential(nn.LayerNorm(d * self.merge2), nn.Linear(d * self.merge2, d))
        self.embed, self.pos = nn.Embedding(vocab, d), nn.Embedding(max_len, d)
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.decoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)  # norm_first: no nested path
        self.head = nn.Linear(d, vocab)

    def forward(self, batch: dict) -> torch.Tensor:
        x = self.embed(batch["input_ids"]) + self.pos(batch["position_ids"])
        if len(batch["pixel_values"]):
            patches = self.patch(normalize(batch["pixel_values"]))
            merged = self.merger(patches.reshape(-1, self.merge2 * patches.shape[-1]))  # rows come merge-window first
            x = x.clone()
            x[batch["mm_token_type_ids"].bool()] = merged  # placeholders and images are both in sample order
        n = x.shape[1]
        causal = torch.triu(torch.full((n, n), float("-inf")), diagonal=1)
        return self.head(self.decoder(x, mask=causal, is_causal=True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=150, help="global steps to train")
    ap.add_argument("--data", default="data/vlm", help="where tools/vlm.py builds the shards and tokenizer")
    args = ap.parse_args()

    from tools.vlm import build_vlm_demo

    paths = build_vlm_demo(args.data)
    if paths is None:
        raise SystemExit("the stamps could not be fetched (apt-get download tuxpaint-stamps-default)")
    vision = VisionConfig(vision_start_token="<|vision_start|>", vision_end_token="<|vision_end|>",
                          min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 36)
    config = Config(seed=0, lanes=4, seq_len=256, global_batch_size=8, tokenizer=paths.tokenizer, shuffle_window=32,
                    vision=vision, sources=[SourceConfig(name="stamps", uri=f"file://{paths.shards}/",
                                                         image_field="png", text_field="txt")])
    loader = Loader(config)
    row = 3 * vision.temporal_patch_size * vision.patch_size ** 2
    model = TinyVLM(loader.tokenizer.vocab_size, row, vision.merge_size, max_len=config.seq_len)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters; {paths.images} captioned images")
    start, window = time.monotonic(), []
    for batch in loader:
        logits = model(batch)
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
        window.append(loss.item())
        step = batch["step"]
        if step % 10 == 0 or step + 1 == args.steps:
            print(f"step {step:4d}  loss {sum(window) / len(window):.3f}  images {len(batch['image_grid_thw']):3d}  "
                  f"{time.monotonic() - start:6.1f} s", flush=True)
            window = []
        if step + 1 == args.steps:
            break
    loader.close() if hasattr(loader, "close") else None


if __name__ == "__main__":
    main()
