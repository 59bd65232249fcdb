"""`piece_tokens`: longer documents cut into pieces as they are read, before the shuffle and the
mix. Every token still comes out once an epoch, no piece is longer than the setting, checkpoints
hold pieces (and cursors inside a document) and resume from them, a damaged piece reference is
refused, and long documents no longer hold the realized shares away from the weights.
The determinism matrix runs with pieces in tests/core/test_pieces_matrix.py."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import msgspec
import pytest

from tests._chat_data import write_word_chats
from zephon_stream import IncompatibleState
from zephon_stream.loader.config import Config, ScheduleEntry, SourceConfig
from zephon_stream.loader.loader import Loader
from zephon_stream.loader.state import check_lane_state
from zephon_stream.operators.feed import FeedState
from zephon_stream.testing.determinism import run_world

from .conftest import write_jsonl
from .test_mixtures import worst_gap

SIZE = 24


def _epoch(cfg: Config) -> tuple[Counter[int], list[int], int]:
    """One epoch, inline: (every real token, counted; the real tokens of each sample; the
    positions with a target)."""
    counts: Counter[int] = Counter()
    lengths, targets = [], 0
    for batch in Loader(cfg, backend="inline"):
        for ids, n, labels in zip(batch["input_ids"].tolist(), batch["num_tokens"].tolist(),
                                  batch["labels"].tolist()):
            lengths.append(n)
            counts.update(ids[:n])
            targets += sum(1 for t in labels[:n] if t != -100)
    return counts, lengths, targets


def test_every_token_once_an_epoch_in_pieces_no_longer_than_the_setting(config):
    one = config.replace(max_epochs=1, packing="none")
    whole, whole_lengths, _ = _epoch(one)
    cut, lengths, _ = _epoch(one.replace(piece_tokens=SIZE))
    assert max(whole_lengths) > SIZE, "the data has documents longer than a piece"
    assert max(lengths) <= SIZE and cut == whole


def _states_with_pieces(cfg: Config, steps: int) -> dict[int, dict]:
    """step -> state_dict, for the steps whose checkpoint holds a piece reference and a cursor
    inside a document."""
    out = {}
    loader = Loader(cfg, backend="inline")
    for _ in loader:
        lanes = loader.frontier.lanes.values()
        refs = [r for ls in lanes if ls for w in ls.shuffles for r in w.window if len(r) == 5]
        inside = [c for ls in lanes if ls for c in ls.sources if c.piece]
        if refs and inside:
            out[loader.step] = loader.state_dict()
        if loader.step == steps:
            break
    return out


def test_checkpoints_hold_pieces_and_resume_from_them(config):
    _resume_from_a_piece(config.replace(piece_tokens=SIZE, shuffle_scope="source"), 30, 12, 3, "threads")


def _resume_from_a_piece(cfg: Config, steps: int, within: int, world: int, backend: str) -> None:
    """A checkpoint of the first `within` steps that holds a piece and a cursor inside a document,
    resumed on `world` ranks on `backend`, gives the rest of `steps` steps of the inline run."""
    full, _ = run_world(cfg, 1, steps, backend="inline")
    states = _states_with_pieces(cfg, within)
    assert states, f"no checkpoint of the first {within} steps holds a piece and a cursor inside a document"
    step = max(states)
    rest, _ = run_world(cfg, world, steps - step, backend=backend, resume=[states[step]])
    assert rest == [r for r in full if r[0] >= step]


def _lane_state(cfg: Config):
    loader = Loader(cfg, backend="inline")
    it = iter(loader)
    for _ in range(6):
        next(it)
    it.close()
    return next(ls for ls in loader.frontier.lanes.values()
                if ls and any(len(r) == 5 for w in ls.shuffles for r in w.window))


def test_piece_references_are_checked(config):
    cfg = config.replace(piece_tokens=SIZE, shuffle_scope="source")
    ls = _lane_state(cfg)
    check_lane_state(ls, cfg)
    s, w = next((s, w) for s, w in enumerate(ls.shuffles) if any(len(r) == 5 for r in w.window))
    i = next(i for i, r in enumerate(w.window) if len(r) == 5)

    def with_ref(ref):
        window = list(w.window)
        window[i] = ref
        shuffles = list(ls.shuffles)
        shuffles[s] = msgspec.structs.replace(w, window=window)
        return msgspec.structs.replace(ls, shuffles=shuffles)

    ref = tuple(w.window[i])
    at_starts = msgspec.structs.replace(ls, sources=[FeedState(c.position, c.offset) for c in ls.sources])
    with pytest.raises(IncompatibleState, match="pieces need piece_tokens"):
        check_lane_state(at_starts, cfg.replace(piece_tokens=0))
    with pytest.raises(IncompatibleState, match=f"a piece starts at a multiple of piece_tokens = {SIZE}"):
        check_lane_state(with_ref((*ref[:4], ref[4] + 1)), cfg)
    with pytest.raises(IncompatibleState, match="a document is"):
        check_lane_state(with_ref((*ref, 0)), cfg)
    cursors = list(ls.sources)
    cursors[s] = FeedState(cursors[s].position, cursors[s].offset, SIZE + 1)
    with pytest.raises(IncompatibleState, match=f"piece_tokens = {SIZE}"):
        check_lane_state(msgspec.structs.replace(ls, sources=cursors), cfg)


def test_a_piece_that_no_document_has_is_refused_on_restore(config):
    """A reference to a piece past its document's end passes the state checks (they cannot see
    the document's length) and is refused when the lane reads the document again."""
    cfg = config.replace(piece_tokens=SIZE, shuffle_scope="source")
    loader = Loader(cfg, backend="inline")
    it = iter(loader)
    for _ in range(6):
        next(it)
    it.close()
    state = loader.state_dict()

    def behind(raw: list) -> list | None:  # a piece of a document its source's cursor has moved past
        return next((r for w in raw[7] for r in w[0] if len(r) == 5 and (r[1], r[2] + r[3]) <= tuple(raw[3][r[0]][:2])),
                    None)

    name, raw = next((k, raw) for k, v in state.items() if k.startswith("lane_")
                     and behind(raw := msgspec.msgpack.decode(v)) is not None)
    behind(raw)[4] = SIZE * 1000
    state[name] = msgspec.msgpack.encode(raw)
    again = Loader(cfg, backend="inline")
    again.load_state_dict(state)
    with pytest.raises(IncompatibleState, match=r"no piece of document .* starts at token 24000"):
        next(iter(again))


def _long_documents(root: Path) -> None:
    """Source a: short documents; source b: documents of 400-1600 words (far longer than seq_len)."""
    rng = random.Random(5)
    words = "the of and to in is that for it as with was on be by this are loader lane token".split()
    for name, (lo, hi) in (("a", (20, 120)), ("b", (400, 1600))):
        (root / name).mkdir(parents=True)
        for shard in range(12):
            docs = [" ".join(rng.choice(words) for _ in range(rng.randint(lo, hi))) for _ in range(60)]
            write_jsonl(root / name / f"{name}-{shard}.jsonl", docs)


def test_pieces_keep_realized_shares_within_one_point_when_documents_are_long(dataset, tmp_path):
    """Documents many samples long hold a lane to their source: the realized shares of 100-step
    windows stray past 1 point. Cut into pieces of seq_len, every window is within 1 point."""
    root, _ = dataset
    _long_documents(tmp_path)
    change = 10 + 100 + 5
    sources = [SourceConfig(name="a", uri=f"file://{tmp_path}/a/", weight=0.7),
               SourceConfig(name="b", uri=f"file://{tmp_path}/b/", weight=0.3)]
    config = Config(seed=99, lanes=12, seq_len=128, global_batch_size=24, tokenizer=str(root / "tokenizer.json"),
                    split_bytes=16384, shuffle_scope="source", sources=sources,
                    schedule=[ScheduleEntry(change, {"a": 0.3, "b": 0.7})])
    steps = change + 10 + 100 + 5
    whole, _ = worst_gap(config, steps)
    cut, gaps = worst_gap(config.replace(piece_tokens=128), steps)
    assert whole > 1.0, f"whole documents: largest gap {whole:.2f} points (the data should break the goal)"
    assert len(gaps) == 12 and cut < 1.0, f"pieces: realized shares off by up to {cut:.2f} points"


def test_piece_tokens_is_an_order_setting(config):
    assert "piece_tokens" not in config.order_settings("t")
    assert config.replace(piece_tokens=SIZE).order_settings("t")["piece_tokens"] == SIZE


@pytest.fixture()
def chat_config(config, tmp_path):
    """Conversations of the test words (ChatML, labels only on the assistant turns) mixed with
    source a, cut into pieces of 16 tokens: pieces of chat documents carry their trained flags."""
    root = write_word_chats(tmp_path, n=240, shards=2)
    chat = msgspec.structs.replace(config.sources[0], name="sft", uri=f"file://{root}/sft/", weight=0.6,
                                   messages_field="messages", chat_template=str(root / "chatml.jinja"))
    return config.replace(tokenizer=str(root / "tokenizer.json"), piece_tokens=16, shuffle_scope="source",
                          sources=[chat, msgspec.structs.replace(config.sources[0], weight=0.4)])


def test_chat_pieces_keep_their_trained_tokens_and_resume(chat_config):
    """Every token of an epoch once, the trained ones trained as often as whole (less the last
    token of each cut piece, whose target lay in the next piece), and a resume from a checkpoint
    holding chat pieces gives the same batches."""
    one = chat_config.replace(max_epochs=1, packing="none")

    whole, _, whole_targets = _epoch(one.replace(piece_tokens=0))
    cut, _, cut_targets = _epoch(one)
    assert cut == whole
    assert 0 < cut_targets < whole_targets
    _resume_from_a_piece(chat_config, 24, 10, 2, "processes")
