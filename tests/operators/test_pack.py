"""Pack: concatenate and cut; nothing dropped, labels are the next token, state is one carry."""

from __future__ import annotations

import anyio
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zephon_stream import IncompatibleState
from zephon_stream.operators.pack import IGNORE, Pack, PackState
from zephon_stream.testing.operators import ListSource, assert_roundtrip

EOS = 0


def _docs(lengths: list[int]) -> list[tuple]:
    out, t = [], 1
    for i, n in enumerate(lengths):
        ids = np.arange(t, t + n, dtype=np.uint32)
        ids[-1] = EOS
        out.append(((0, 0, i * 10, 10), ids))
        t += n
    return out


async def _drain(pack: Pack) -> list:
    out = []
    while (s := await pack.next()) is not None:
        out.append(s)
    return out


@pytest.mark.parametrize("seq_len", [2, 6, 64])
def test_roundtrip_at_every_point(seq_len: int) -> None:
    docs = _docs([5, 3, 8, 1, 13, 2])
    by_ref = {d[0]: d for d in docs}

    def make():
        src = ListSource(docs)
        return [src, Pack(seq_len, 999, True, src)]

    assert anyio.run(lambda: assert_roundtrip(make, resolve=by_ref.__getitem__)) >= 1


def test_the_worked_example_of_the_module_docstring() -> None:
    a, b, c = [1, 1, 1, 1, EOS], [2, 2, EOS], [3] * 7 + [EOS]
    docs = [((0, 0, i, 1), np.array(d, dtype=np.uint32)) for i, d in enumerate((a, b, c))]
    samples = anyio.run(_drain, Pack(6, 9, True, ListSource(docs)))
    assert [s.input_ids.tolist() for s in samples] == [[1, 1, 1, 1, 0, 2], [2, 0, 3, 3, 3, 3], [3, 3, 3, 0, 9, 9]]
    assert [s.labels.tolist() for s in samples] == [[1, 1, 1, 0, IGNORE, 2], [0, IGNORE, 3, 3, 3, 3],
                                                   [3, 3, 0, IGNORE, IGNORE, IGNORE]]
    assert [s.position_ids.tolist() for s in samples] == [[0, 1, 2, 3, 4, 0], [0, 1, 0, 1, 2, 3],
                                                         [0, 1, 2, 3, 0, 0]]
    assert [s.segments for s in samples] == [[5, 1], [2, 4], [4]]


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(1, 40), max_size=25), st.integers(2, 33), st.booleans())
def test_no_token_lost_or_duplicated_and_labels_are_the_next_token(lengths: list[int], seq_len: int,
                                                                   mask: bool) -> None:
    docs = _docs(lengths)
    stream = np.concatenate([d[1] for d in docs]) if docs else np.zeros(0, dtype=np.uint32)
    samples = anyio.run(_drain, Pack(seq_len, 999, mask, ListSource(docs)))
    got = np.concatenate([s.input_ids[:s.num_tokens] for s in samples]) if samples else stream[:0]
    assert got.tolist() == stream.tolist()
    assert all(len(s.input_ids) == seq_len and sum(s.segments) == s.num_tokens for s in samples)
    flat = [(int(t), int(lab)) for s in samples for t, lab in zip(s.input_ids[:s.num_tokens], s.labels[:s.num_tokens])]
    for i, (tok, lab) in enumerate(flat):
        if lab != IGNORE:
            assert lab == flat[i + 1][0]
        elif i + 1 < len(flat):
            assert mask and tok == EOS


def test_restore_checks_the_carry_offset() -> None:
    docs = _docs([4])
    by_ref = {d[0]: d for d in docs}
    pack = Pack(8, 9, True, ListSource(docs))
    with pytest.raises(IncompatibleState, match=r"pack.offset = 4: the carried document .* has 4 tokens"):
        pack.restore(PackState(docs[0][0], 4), by_ref.__getitem__)
    with pytest.raises(IncompatibleState, match="pack.offset = 3: must be 0 when no document is carried"):
        pack.restore(PackState(None, 3), by_ref.__getitem__)
