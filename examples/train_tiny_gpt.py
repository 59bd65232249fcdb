"""Train a tiny GPT on real text under torchrun; checkpoint model, optimizer and loader with DCP.

    torchrun --nproc_per_node 4 examples/train_tiny_gpt.py --steps 20   # stops at step 20
    torchrun --nproc_per_node 2 examples/train_tiny_gpt.py --steps 40   # resumes at 20

Without --config it builds `data/tiny_gpt` (Debian's kernel and Python manuals, or the standard
library's docstrings, plus stdlib code; a byte-level BPE) with `tools/corpus.py`'s `build_demo`.
Each start resumes from the newest *complete* checkpoint under --ckpt-dir (DCP writes `.metadata`
last), on any number of processes that divides the 12 lanes. Rank 0 prints, per step, the loss
over the global batch and the SHA-256 of the global batch's `input_ids` gathered from every rank:
the digests do not depend on the number of processes or on where the run was cut.
Plain torch: gloo on CPU, NCCL and `ToDevice` (pinned memory, side-stream copies) on CUDA.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from tokenizers import Tokenizer
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel

from zephon_stream import Config, Loader, SourceConfig
from zephon_stream.distributed import ToDevice, global_batch_digest


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """Decoder-only; attention stays inside each packed document (documents start at position 0)."""

    def __init__(self, vocab: int, seq_len: int, d: int, layers: int, heads: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq_len, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        for m in self.modules():  # GPT-2's init: small weights, zero biases, LayerNorms as built
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear):
                nn.init.zeros_(m.bias)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        doc = (positions == 0).cumsum(1)
        causal = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool, device=ids.device).tril()
        mask = (causal & (doc[:, :, None] == doc[:, None, :]))[:, None]
        x = self.tok(ids) + self.pos(positions)
        for block in self.blocks:
            x = block(x, mask)
        return self.ln(x) @ self.tok.weight.T  # tied output embedding


def demo_config(data: Path, seq_len: int, global_batch: int) -> Config:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's tools/ (not in the wheel)
    from tools.corpus import build_demo

    if dist.get_rank() == 0:
        build_demo(data)  # real text and its tokenizer; the other ranks wait, then reuse it
    dist.barrier()
    demo = build_demo(data)
    return Config(seed=1234, lanes=12, seq_len=seq_len, global_batch_size=global_batch,
                  tokenizer=demo.tokenizer, shuffle_window=64, sources=[
                      SourceConfig(name="prose", uri=f"file://{demo.sources['prose']}/", weight=0.7),
                      SourceConfig(name="code", uri=f"file://{demo.sources['code']}/", weight=0.3)])


def latest_checkpoint(run: Path) -> Path | None:
    """The newest checkpoint that DCP finished: `.metadata` is renamed into place last."""
    done = sorted(p for p in run.glob("step_*") if (p / ".metadata").is_file())
    return done[-1] if done else None


def save(path: Path, model: nn.Module, optim: torch.optim.Optimizer, feed: ToDevice) -> None:
    model_sd, optim_sd = get_state_dict(model, optim)
    dcp.save({"model": model_sd, "optim": optim_sd, "loader": feed}, checkpoint_id=path)


def resume(path: Path, model: nn.Module, optim: torch.optim.Optimizer, feed: ToDevice) -> None:
    model_sd, optim_sd = get_state_dict(model, optim)
    state = {"model": model_sd, "optim": optim_sd, "loader": feed}
    dcp.load(state, checkpoint_id=path)  # calls feed.load_state_dict: lanes and global step are validated
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])


def train_step(ddp: DistributedDataParallel, optim: torch.optim.Optimizer, batch: dict, lr: float) -> float:
    """One optimizer step on the global batch; returns its mean loss per predicted token."""
    for group in optim.param_groups:
        group["lr"] = lr
    labels = batch["labels"]
    logits = ddp(batch["input_ids"], batch["position_ids"])
    loss_sum = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100,
                               reduction="sum")
    totals = torch.stack([loss_sum.detach(), (labels != -100).sum().float()])
    dist.all_reduce(totals)
    (loss_sum * dist.get_world_size() / totals[1]).backward()  # DDP averages ranks: the global-batch mean
    nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
    optim.step()
    optim.zero_grad(set_to_none=True)
    return (totals[0] / totals[1]).item()


def train(args: argparse.Namespace, device: torch.device) -> None:
    rank = dist.get_rank()
    if args.config:
        config = Config.from_toml(args.config)
    else:
        config = demo_config(args.data, args.seq_len, args.global_batch)
    loader = Loader(config)  # DP rank and size from the default process group
    feed = ToDevice(loader, device)  # a no-op pass-through on CPU
    torch.manual_seed(args.seed)
    vocab = Tokenizer.from_file(config.tokenizer).get_vocab_size()
    model = TinyGPT(vocab, config.seq_len, args.d_model, args.layers, args.heads).to(device)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    log = print if rank == 0 else (lambda *a, **k: None)
    params = sum(p.numel() for p in model.parameters())
    log(f"rank 0 pid {os.getpid()}: {dist.get_world_size()} processes, {params / 1e6:.2f}M parameters, "
        f"vocab {vocab}, {config.global_batch_size} x {config.seq_len} tokens per step", flush=True)
    if (ckpt := latest_checkpoint(args.ckpt_dir)) is not None:
        resume(ckpt, model, optim, feed)
        log(f"resumed from {ckpt} at step {loader.step} on {dist.get_world_size()} processes", flush=True)
    for batch in feed if loader.step < args.steps else ():
        step = batch["step"]
        loss = train_step(ddp, optim, batch, args.lr * min(1.0, (step + 1) / args.warmup))
        digest = global_batch_digest(batch)  # a collective: every rank calls it
        log(f"step {step:5d}  loss {loss:.4f}  batch {digest}", flush=True)
        if (step + 1) % args.ckpt_every == 0 or step + 1 == args.steps:
            save(args.ckpt_dir / f"step_{step + 1:06d}", model, optim, feed)
            log(f"checkpoint step_{step + 1:06d} saved", flush=True)
        if step + 1 == args.steps:
            break


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200, help="train until this many global batches are done")
    ap.add_argument("--ckpt-dir", type=Path, default=Path("data/tiny_gpt_ckpt"), help="holds step_NNNNNN/")
    ap.add_argument("--ckpt-every", type=int, default=10)
    ap.add_argument("--config", help="a zephon-stream TOML config; default: the real-text demo data")
    ap.add_argument("--data", type=Path, default=Path("data/tiny_gpt"))
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--global-batch", type=int, default=24)
    ap.add_argument("--d-model", type=int, default=192)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    try:
        train(args, device)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
