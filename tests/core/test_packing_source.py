"""The packing strategies through the Loader: exactly once over an epoch, labels / positions /
document_ids against cu_seqlens, truncation counted in statistics across a resume, trained
labels equal under every strategy for a chat source, `--digests`' `trained`, and the lane state
checks of best_fit's window."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import msgspec
import pytest

from tests._chat_data import CHATML, train_tokenizer, word_conversations
from tests.core.conftest import make_docs
from zephon_stream import IncompatibleState
from zephon_stream.loader.config import Config, SourceConfig
from zephon_stream.loader.loader import Loader
from zephon_stream.loader.state import LoaderState, check_lane_state
from zephon_stream.operators.collate import sample_digests
from zephon_stream.operators.pack import IGNORE
from zephon_stream.operators.tokenize import Tokenize
from zephon_stream.testing.determinism import run_world


def _pieces(batches: list[dict]) -> Counter:
    """Every real segment (a document or a piece of one) of the batches, as a token tuple."""
    out: Counter = Counter()
    for batch in batches:
        flat = batch["input_ids"].flatten().tolist()
        bounds = batch["cu_seqlens"].tolist()
        for a, e, s in zip(bounds, bounds[1:], batch["segment_sources"].tolist()):
            if s >= 0:
                out[tuple(flat[a:e])] += 1
    return out


def _cut(docs: list[tuple[int, ...]], seq_len: int, packing: str) -> Counter:
    """The documents cut as `packing` cuts them: seq_len pieces from the start ("none"), or from the
    end with what is over first ("best_fit")."""
    first = [len(d) % seq_len if packing == "best_fit" else 0 for d in docs]
    return Counter(d[max(i, 0):i + seq_len] for d, f in zip(docs, first)
                   for i in range(f - seq_len if f else 0, len(d), seq_len))


@pytest.mark.parametrize(("packing", "dp_size"), [("best_fit", 1), ("best_fit", 3), ("none", 2)])
def test_exactly_once_over_one_epoch(config, dataset, packing, dp_size):
    """Every document of the epoch, longer than seq_len ones cut into seq_len pieces, exactly once."""
    _, docs = dataset
    cfg = config.replace(max_epochs=1, packing=packing, packing_window=16)
    tok = Tokenize(cfg.tokenizer, cfg.eos_token)
    batches = []
    for rank in range(dp_size):
        batches += list(Loader(cfg, dp_rank=rank, dp_size=dp_size, backend="threads"))
    want = [tuple(ids.tolist()) for ids in tok(docs["a"] + docs["b"])]
    assert any(len(d) > cfg.seq_len for d in want), "the data should hold documents longer than seq_len"
    assert _pieces(batches) == _cut(want, cfg.seq_len, packing)


@pytest.mark.parametrize("packing", ["concat", "best_fit", "none"])
def test_labels_positions_and_document_ids_agree_with_cu_seqlens(config, packing):
    cfg = config.replace(packing=packing, seq_len=32)
    for b, batch in enumerate(Loader(cfg, backend="inline")):
        ids, labels = batch["input_ids"].flatten().tolist(), batch["labels"].flatten().tolist()
        pos, docs = batch["position_ids"].flatten().tolist(), batch["document_ids"].flatten().tolist()
        bounds, sources = batch["cu_seqlens"].tolist(), batch["segment_sources"].tolist()
        row_docs: dict[int, int] = {}
        for a, e, s in zip(bounds, bounds[1:], sources):
            row = a // 32
            if s < 0:  # padding: its own segment, document id -1, no labels
                assert set(docs[a:e]) == {-1} and set(labels[a:e]) == {IGNORE}
                continue
            assert e <= (row + 1) * 32 and pos[a:e] == list(range(e - a))
            assert set(docs[a:e]) == {row_docs.setdefault(row, -1) + 1}
            row_docs[row] += 1
            assert labels[a:e - 1] == ids[a + 1:e]  # text sources: every target inside a segment is trained
        if b == 3:
            break


def test_truncation_is_counted_in_statistics_across_a_resume(config, dataset):
    _, docs = dataset
    cfg = config.replace(max_epochs=1, packing="none", truncate=True)
    lengths = [len(ids) for ids in Tokenize(cfg.tokenizer, cfg.eos_token)(docs["a"] + docs["b"])]
    want = (sum(n > cfg.seq_len for n in lengths), sum(max(n - cfg.seq_len, 0) for n in lengths))
    loader = Loader(cfg, backend="threads")
    batches = list(loader)
    stats = loader.statistics()
    assert want[0] > 0 and (stats.truncated_documents, stats.truncated_tokens) == want
    assert sum(int(b["num_tokens"].sum()) for b in batches) == sum(lengths) - want[1]
    _, states = run_world(cfg, 2, 7, backend="inline")  # cut at step 7 on two ranks, finish on three
    totals = [0, 0]
    for rank in range(3):
        resumed = Loader(cfg, dp_rank=rank, dp_size=3, backend="inline")
        resumed.load_state_dict(states)
        list(resumed)
        totals[0] += resumed.statistics().truncated_documents
        totals[1] += resumed.statistics().truncated_tokens
    assert tuple(totals) == want


def test_best_fit_state_holds_its_window_as_references_and_is_checked(config):
    cfg = config.replace(packing="best_fit", packing_window=16, max_epochs=1)
    loader = Loader(cfg, backend="inline")
    it = iter(loader)
    for _ in range(5):
        next(it)
    it.close()
    state = loader.state_dict()
    lanes = LoaderState.from_dict(state).lane_states
    assert all(0 < len(ls.pack.window) <= 16 and ls.pack.carry is None for ls in lanes)
    assert max(len(v) for k, v in state.items() if k != "meta") < 2048  # references, never tokens
    ls = lanes[0]
    rep = msgspec.structs.replace
    first = ls.pack.window[0]
    cases = [
        (rep(ls, pack=rep(ls.pack, window=ls.pack.window[:-1] + [first])), "pack.window.*referenced twice"),
        (rep(ls, pack=rep(ls.pack, window=[(first[0], -5)])), r"pack.window = \[-5\]: the offsets .* must be >= 0"),
        (rep(ls, pack=rep(ls.pack, carry=first[0])), 'pack.carry.*"best_fit" carries nothing but its window'),
        (rep(ls, done=True), "once its windows and carry are empty"),
    ]
    for bad, match in cases:
        with pytest.raises(IncompatibleState, match=match):
            check_lane_state(bad, cfg)
    edited = dict(state)  # where a piece starts needs the document: checked once it is read again
    edited["lane_0000"] = msgspec.msgpack.encode(rep(ls, pack=rep(ls.pack, window=[(first[0], 1)]
                                                                  + ls.pack.window[1:])))
    resumed = Loader(cfg, backend="inline")
    resumed.load_state_dict(edited)
    with pytest.raises(IncompatibleState, match=r"lane 0 state field pack.window\[0\] = 1: "):
        next(iter(resumed))
    with pytest.raises(IncompatibleState, match="holds at most packing_window = 4"):
        check_lane_state(ls, cfg.replace(packing_window=4))
    with pytest.raises(IncompatibleState, match="only packing = \"best_fit\" has a window, not 'concat'"):
        check_lane_state(ls, cfg.replace(packing="concat"))


@pytest.fixture(scope="module")
def chat_config(tmp_path_factory) -> Config:
    """A chat source (generated conversations of the test words, ChatML) beside a text source."""
    root = tmp_path_factory.mktemp("chat_packing")
    (root / "sft").mkdir()
    conversations = word_conversations(seed=4, n=240, turns=3)
    for s in range(3):
        part = conversations[s * 80:(s + 1) * 80]
        (root / "sft" / f"part-{s}.jsonl").write_bytes(b"".join(
            msgspec.json.encode({"id": i, "messages": c}) + b"\n" for i, c in enumerate(part)))
    (root / "text").mkdir()
    texts = make_docs(random.Random(9), 400, 60)
    (root / "text" / "t.jsonl").write_bytes(b"".join(msgspec.json.encode({"text": t}) + b"\n" for t in texts))
    train_tokenizer(root / "tokenizer.json", texts[:200])
    (root / "chatml.jinja").write_text(CHATML)
    return Config(seed=77, lanes=4, seq_len=64, global_batch_size=8, tokenizer=str(root / "tokenizer.json"),
                  shuffle_window=4, split_bytes=4096, sample_batch=2, max_epochs=1,
                  sources=[SourceConfig(name="sft", uri=f"file://{root}/sft/", weight=0.5, messages_field="messages",
                                        chat_template=str(root / "chatml.jinja")),
                           SourceConfig(name="text", uri=f"file://{root}/text/", weight=0.5)])


def test_a_chat_source_trains_on_the_same_targets_under_every_strategy(chat_config: Config):
    """Each strategy labels each trained target once (a piece's last label is the next piece's
    first token), so over an epoch the trained labels add up alike, and the digests count them."""
    trained = {}
    for packing in ("concat", "best_fit", "none"):
        cfg = chat_config.replace(packing=packing)
        batches = list(Loader(cfg, backend="threads"))
        digests = [d for b in batches for d in sample_digests(b)]
        trained[packing] = sum(d["trained"] for d in digests)
        assert trained[packing] == sum(int(b["labels"].ne(IGNORE).sum()) for b in batches)
        real = sum(d["tokens"] for d in digests)
        assert 0 < trained[packing] < real
    assert trained["concat"] == trained["best_fit"] == trained["none"]


def test_cli_digests_carry_trained(config, tmp_path: Path, capsys):
    from zephon_stream.cli.main import main

    cfg = config.replace(packing="best_fit")
    path = tmp_path / "p.toml"
    path.write_text(cfg.to_toml())
    assert main(["stream", str(path), "--steps", "1", "--digests", "--backend", "inline"]) == 0
    lines = [msgspec.json.decode(line) for line in capsys.readouterr().out.splitlines()]
    batch = next(iter(Loader(cfg, backend="inline")))
    assert [d["trained"] for d in lines] == batch["labels"].ne(IGNORE).sum(dim=1).tolist()
    assert all({"step", "slot", "lane", "tokens", "sha256", "source_tokens"} <= set(d) for d in lines)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile:UserWarning")
@pytest.mark.parametrize("packing", ["best_fit", "concat"])
def test_document_ids_make_flex_attention_attend_within_documents(config, packing):
    """flex attention masked by `document_ids` (same id, causal) equals causal attention run on each
    cu_seqlens segment alone: no token sees another document, and padding rows stay finite."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    batch = next(iter(Loader(config.replace(packing=packing), backend="inline")))
    docs = batch["document_ids"][:6]
    rows, seq_len = docs.shape
    assert (docs == -1).any() or packing == "concat"

    def same_document(b, h, q, kv):
        return (docs[b, q] == docs[b, kv]) & (q >= kv)
    mask = create_block_mask(same_document, B=rows, H=None, Q_LEN=seq_len, KV_LEN=seq_len, device="cpu")
    q, k, v = torch.randn(3, rows, 2, seq_len, 8, generator=torch.Generator().manual_seed(0)).unbind(0)
    out = flex_attention(q, k, v, block_mask=mask)
    bounds = [b for b in batch["cu_seqlens"].tolist() if b <= rows * seq_len]
    flat = [t.transpose(0, 1).reshape(2, rows * seq_len, 8) for t in (q, k, v)]  # heads, tokens, dim
    want = torch.cat([sdpa(*(t[:, a:e] for t in flat), is_causal=True) for a, e in zip(bounds, bounds[1:])], dim=1)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.transpose(0, 1).reshape(2, rows * seq_len, 8), want)
