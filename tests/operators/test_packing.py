"""The packing strategies (concat, best_fit, none) at the operator level: every token of every
document once and in order, no sample over seq_len, labels / positions / document_ids by one
oracle, trained masks, save/restore at every point, best_fit's window rules and padding share."""

from __future__ import annotations

import anyio
import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zephon_stream import IncompatibleState
from zephon_stream.operators.best_fit import BestFitPack
from zephon_stream.operators.collate import collate, document_ids, sample_digests
from zephon_stream.operators.pack import IGNORE, Pack, PackState
from zephon_stream.operators.single import SinglePack
from zephon_stream.operators.types import ChatDoc, trained_mask
from zephon_stream.testing.operators import ListSource, assert_roundtrip

PAD = 0  # no document token is 0: every id below names one (document, position)
STRATEGIES = ["concat", "best_fit", "none", "truncate"]


def make_docs(lengths: list[int], chats: list[bool] | None = None, seed: int = 0) -> list[tuple]:
    """Documents with ids unique over the list (1, 2, ...); a chat document trains on a random ~60%."""
    rng = np.random.default_rng(seed)
    out, t = [], 1
    for i, n in enumerate(lengths):
        ids = np.arange(t, t + n, dtype=np.uint32)
        payload = ChatDoc(ids, rng.random(n) < 0.6) if chats and chats[i] else ids
        out.append(((0, 0, i, 1), payload))
        t += n
    return out


def make(strategy: str, docs: list[tuple], seq_len: int, mask: bool = True, window: int = 4) -> list:
    src = ListSource(docs)
    if strategy == "concat":
        return [src, Pack(seq_len, PAD, mask, src)]
    if strategy == "best_fit":
        return [src, BestFitPack(seq_len, PAD, mask, window, src)]
    return [src, SinglePack(seq_len, PAD, strategy == "truncate", src)]


async def drain(op) -> list:
    out = []
    while (s := await op.next()) is not None:
        out.append(s)
    return out


def run(strategy: str, docs: list[tuple], seq_len: int, mask: bool = True, window: int = 4) -> list:
    return anyio.run(drain, make(strategy, docs, seq_len, mask, window)[-1])


def expected_label(docs: list[tuple], where: dict, token: int, follow: int | None, mask: bool) -> int:
    """The label of `token`: its document's next token if trained; at the document's end, -100 with
    `mask`, else the target `follow` (the token after it in the sample, or the stream's next)."""
    d, j = where[token]
    payload = docs[d][1]
    if j + 1 < len(payload):
        target, (dd, jj) = int(payload[j + 1]), (d, j + 1)
    elif mask or follow is None:
        return IGNORE
    else:
        target, (dd, jj) = follow, where[follow]
    trained = trained_mask(docs[dd][1])
    return target if trained is None or trained[jj] else IGNORE


def check(samples: list, docs: list[tuple], seq_len: int, strategy: str, mask: bool = True) -> None:
    """Every property a packing strategy promises, against an oracle built from the documents."""
    where = {int(t): (d, j) for d, (_, p) in enumerate(docs) for j, t in enumerate(p[:len(p)])}
    seen: dict[int, list[int]] = {d: [] for d in range(len(docs))}
    for i, s in enumerate(samples):
        n = s.num_tokens
        assert len(s.input_ids) == len(s.labels) == len(s.position_ids) == seq_len
        assert 0 < n <= seq_len and sum(s.segments) == n and all(k > 0 for k in s.segments)
        assert (s.input_ids[n:] == PAD).all() and (s.labels[n:] == IGNORE).all() and not s.position_ids[n:].any()
        ids = document_ids(s.segments, seq_len)
        assert (ids[n:] == -1).all() and ids[:n].tolist() == [k for k, m in enumerate(s.segments) for _ in range(m)]
        at = 0
        for k, take in enumerate(s.segments):
            toks = s.input_ids[at:at + take].tolist()
            d, j0 = where[toks[0]]
            assert [where[t] for t in toks] == [(d, j0 + m) for m in range(take)], "a segment is one document's run"
            assert s.position_ids[at:at + take].tolist() == list(range(take))
            assert s.sources[k] == docs[d][0][0]
            length = len(docs[d][1])
            if strategy == "best_fit":  # what is over of whole seq_len pieces first, then the seq_len pieces
                assert (length - j0 - take) % seq_len == 0 and take == ((length - j0) % seq_len or seq_len)
            elif strategy != "concat":  # seq_len pieces from the start
                assert j0 % seq_len == 0 and take == min(seq_len, length - j0)
            seen[d] += range(j0, j0 + take)
            at += take
        nxt_stream = (int(samples[i + 1].input_ids[0]) if strategy == "concat" and n == seq_len
                      and i + 1 < len(samples) else None)
        for t in range(n):
            follow = int(s.input_ids[t + 1]) if t + 1 < n else nxt_stream
            assert s.labels[t] == expected_label(docs, where, int(s.input_ids[t]), follow, mask), (i, t)
        if strategy == "none" or strategy == "truncate":
            assert len(s.segments) == 1
    for d, (_, payload) in enumerate(docs):  # every token of every document once, in order
        kept = min(len(payload), seq_len) if strategy == "truncate" else len(payload)
        assert seen[d] == list(range(kept)), f"document {d}"


docs_strategy = st.lists(st.tuples(st.integers(1, 40), st.booleans()), max_size=14)


@settings(max_examples=150, deadline=None)
@given(docs_strategy, st.integers(2, 24), st.sampled_from(STRATEGIES), st.booleans(), st.integers(1, 6),
       st.integers(0, 2**32 - 1))
def test_every_token_once_in_order_with_labels_positions_and_document_ids(spec, seq_len, strategy, mask, window,
                                                                          seed):
    docs = make_docs([n for n, _ in spec], [c for _, c in spec], seed)
    samples = run(strategy, docs, seq_len, mask, window)
    check(samples, docs, seq_len, strategy, mask if strategy in ("concat", "best_fit") else True)
    if strategy == "truncate":
        op = make("truncate", docs, seq_len)[-1]
        anyio.run(drain, op)
        longer = [len(p) for _, p in docs if len(p) > seq_len]
        assert (op.state().truncated, op.state().dropped) == (len(longer), sum(n - seq_len for n in longer))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 30), st.booleans()), max_size=9), st.integers(2, 12),
       st.sampled_from(STRATEGIES), st.integers(1, 4))
def test_state_roundtrip_at_every_point_gives_the_same_continuation(spec, seq_len, strategy, window):
    docs = make_docs([n for n, _ in spec], [c for _, c in spec], 5)
    by_ref = {ref: (ref, p) for ref, p in docs}
    anyio.run(lambda: assert_roundtrip(lambda: make(strategy, docs, seq_len, window=window),
                                       resolve=by_ref.__getitem__))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 50), max_size=40), st.integers(2, 32), st.integers(1, 8))
def test_best_fit_leaves_nothing_in_the_window_that_would_have_fit(lengths, seq_len, window):
    """When a sample has room left, every piece the window holds after it is larger than that room,
    and the window never holds more than `window` documents."""
    docs = make_docs(lengths)
    by_ref = {ref: p for ref, p in docs}
    op = make("best_fit", docs, seq_len, window=window)[-1]

    async def main():
        while (s := await op.next()) is not None:
            st_ = op.state()
            assert len(st_.window) <= window and st_.carry is None
            pieces = [min(len(by_ref[tuple(r)]) - off, seq_len) for r, off in st_.window]
            assert all(p > seq_len - s.num_tokens for p in pieces) or s.num_tokens == seq_len
    anyio.run(main)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 16), min_size=1, max_size=60), st.integers(1, 8))
def test_best_fit_takes_a_short_document_within_window_samples_of_reading_it(lengths, window):
    """No starvation: each sample opens with the oldest piece, so a document no longer than
    seq_len is packed at most `window` samples after the one during which it was read."""
    seq_len = 16
    docs = make_docs(lengths)
    src = ListSource(docs)
    op = BestFitPack(seq_len, PAD, True, window, src)

    async def main():
        read_in, packed_in, k = {}, {}, 0
        while (s := await op.next()) is not None:
            for d in range(len(read_in), src.index):
                read_in[d] = k
            at = 0
            for take in s.segments:
                packed_in[int(s.input_ids[at]) and _doc_of(docs, int(s.input_ids[at]))] = k
                at += take
            k += 1
        assert all(packed_in[d] - read_in[d] <= window for d in read_in)
        assert sorted(packed_in) == list(range(len(docs)))
    anyio.run(main)


def _doc_of(docs: list[tuple], token: int) -> int:
    return next(d for d, (_, p) in enumerate(docs) if int(p[0]) <= token <= int(p[-1]))


def test_the_worked_example_of_best_fit():
    docs = make_docs([5, 6, 2, 3, 12, 1, 4])
    samples = run("best_fit", docs, 8, window=3)
    letters = {int(t): "abcdefg"[d] for d, (_, p) in enumerate(docs) for t in p}
    rows = ["".join(letters.get(int(t), ".") for t in s.input_ids) for s in samples]
    assert rows == ["aaaaaddd", "bbbbbbcc", "eeeegggg", "eeeeeeee", "f......."]
    ids = [document_ids(s.segments, 8).tolist() for s in samples]
    assert (ids[0], ids[2], ids[4]) == ([0] * 5 + [1] * 3, [0] * 4 + [1] * 4, [0] + [-1] * 7)
    assert samples[2].labels[3] == int(docs[4][1][4])  # e's first piece ends on a label: its next piece's first


def test_a_long_document_under_way_opens_the_next_samples():
    """b (11 = 3 + 8) gives its first piece to fill a's sample; its whole piece opens the next
    sample although c, older in the window, waits: a started document never holds a slot long."""
    docs = make_docs([5, 4, 11])
    letters = {int(t): "acb"[d] for d, (_, p) in enumerate(docs) for t in p}
    rows = ["".join(letters.get(int(t), ".") for t in s.input_ids) for s in run("best_fit", docs, 8, window=3)]
    assert rows == ["aaaaabbb", "bbbbbbbb", "cccc...."]


def test_the_worked_example_of_none_and_truncate():
    docs = make_docs([3, 10, 5])
    letters = {int(t): "abc"[d] for d, (_, p) in enumerate(docs) for t in p}

    def rows(strategy):
        return ["".join(letters.get(int(t), ".") for t in s.input_ids) for s in run(strategy, docs, 4)]
    assert rows("none") == ["aaa.", "bbbb", "bbbb", "bb..", "cccc", "c..."]
    assert rows("truncate") == ["aaa.", "bbbb", "cccc"]


def test_labels_follow_the_trained_mask_across_piece_ends_and_in_concat():
    """A chat document 1..10 trained on its second half (6..10), then a text document 11..13: a
    label is its target where the target is trained, also where a piece ends (the next piece's
    first token) and where concat's look-ahead applies; -100 elsewhere."""
    ids = np.arange(1, 11, dtype=np.uint32)
    docs = [((0, 0, 0, 1), ChatDoc(ids, np.arange(10) >= 5)), ((0, 0, 1, 1), np.arange(11, 14, dtype=np.uint32))]
    no = IGNORE
    want = {
        "concat": [[no, no, no, no], [6, 7, 8, 9], [10, no, 12, 13], [no, no, no, no]],
        "best_fit": [[no, no, no, no], [no, no, 6, 7], [8, 9, 10, no], [12, 13, no, no]],
        "none": [[no, no, no, no], [6, 7, 8, 9], [10, no, no, no], [12, 13, no, no]],
    }
    for strategy, labels in want.items():
        assert [s.labels.tolist() for s in run(strategy, docs, 4)] == labels, strategy


def test_document_ids_and_trained_in_a_collated_batch():
    docs = make_docs([3, 10, 5, 2], [False, True, False, True], seed=3)
    samples = run("best_fit", docs, 8)
    for b, s in enumerate(samples):
        s.lane, s.index = 0, b
    batch = collate(samples, 0, range(len(samples)))
    assert batch["document_ids"].shape == batch["input_ids"].shape
    bounds = batch["cu_seqlens"].tolist()
    flat = batch["document_ids"].flatten().tolist()
    for a, e in zip(bounds, bounds[1:]):  # each varlen segment is one document id (padding: -1)
        assert len(set(flat[a:e])) == 1
    digests = sample_digests(batch)
    assert [d["trained"] for d in digests] == [int((s.labels != IGNORE).sum()) for s in samples]

    class Unshifted:
        labels, vision = "unshifted", None
    shifted = collate(samples, 0, range(len(samples)), Unshifted())
    assert (shifted["labels"][:, 1:] == batch["labels"][:, :-1]).all()
    assert [d["trained"] for d in sample_digests(shifted)] == shifted["labels"].ne(IGNORE).sum(dim=1).tolist()


def padding_share(samples: list) -> float:
    return 1 - sum(s.num_tokens for s in samples) / (len(samples) * len(samples[0].input_ids))


def test_best_fit_pads_far_less_than_one_document_per_sample():
    """Generated lengths with a long tail (lognormal, median ~ seq_len / 4, 8% longer than seq_len)."""
    rng = np.random.default_rng(0)
    lengths = (rng.lognormal(4.2, 1.0, 3000).astype(int) + 1).tolist()
    docs = make_docs(lengths)
    shares = {s: padding_share(run(s, docs, 256, window=64)) for s in ("concat", "best_fit", "none")}
    small = padding_share(run("best_fit", docs, 256, window=4))
    assert shares["concat"] < 0.001  # only the last sample
    assert shares["best_fit"] < 0.03 < 0.5 < shares["none"]
    assert shares["best_fit"] <= small  # a larger window fits better


def test_restore_refuses_what_a_strategy_never_writes():
    docs = make_docs([4, 20])
    by_ref = {ref: (ref, p) for ref, p in docs}.__getitem__
    a, b = docs[0][0], docs[1][0]
    cases = [
        ("best_fit", PackState(a, 0), "best_fit\" carries nothing but its window"),
        ("best_fit", PackState(None, 0, [(a, 0), (a, 0)]), "the same document twice"),
        ("best_fit", PackState(None, 0, [(a, 0)] * 5), "at most packing_window = 4"),
        ("best_fit", PackState(None, 0, [(b, 3)]), r"pack.window\[0\] = 3: .* at 0 or 20 - k \* seq_len, seq_len = 8"),
        ("best_fit", PackState(None, 0, [(b, 8)]), r"pack.window\[0\] = 8: pieces"),
        ("best_fit", PackState(None, 0, [(b, 24)]), r"pack.window\[0\] = 24: the document .* has 20 tokens"),
        ("concat", PackState(None, 0, [(a, 0)]), "only packing = \"best_fit\" has a window"),
        ("none", PackState(None, 0, [], 1, 3), "only packing = \"none\" with truncate"),
        ("truncate", PackState(b, 8), "never carried past its sample"),
        ("truncate", PackState(None, 0, [], 2, 1), "0 <= truncated <= dropped"),
        ("none", PackState(b, 5), "start at multiples of seq_len, seq_len = 8"),
    ]
    for strategy, state, match in cases:
        op = make(strategy, docs, 8)[-1]
        with pytest.raises(IncompatibleState, match=match):
            op.restore(msgspec.msgpack.decode(msgspec.msgpack.encode(state), type=PackState), by_ref)


def test_a_state_of_the_old_shape_still_decodes():
    """Checkpoints written before the window and counters existed: two fields, the rest default."""
    old = msgspec.msgpack.encode([[1, 2, 0, 10], 4])
    assert msgspec.msgpack.decode(old, type=PackState) == PackState((1, 2, 0, 10), 4, [], 0, 0)
