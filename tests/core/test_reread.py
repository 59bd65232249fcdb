"""Reread: a restore's documents, tokenized when first needed, in need order, in growing chunks."""

from __future__ import annotations

import anyio
import numpy as np
import pytest

from zephon_stream import IncompatibleState
from zephon_stream.loader.reread import Reread, interleave
from zephon_stream.operators.shuffle import Deferred


def _refs(source: int, n: int) -> list[tuple]:
    return [(source, 0, 100 * i, 10) for i in range(n)]


def _reread(records: dict, calls: list, skip: set = frozenset(), batch: int = 8, first_chunk: int = 1) -> Reread:
    async def tokenize(source, docs):
        calls.append([ref for ref, _ in docs])
        return [(ref, np.array([len(text)], dtype=np.uint32)) for ref, text in docs if ref not in skip]

    def refused(detail):
        return IncompatibleState(detail)

    return Reread(records, tokenize, lambda source: batch, refused, first_chunk)


def test_a_fetch_tokenizes_the_next_documents_of_its_source_in_chunks_that_double() -> None:
    a, b = _refs(0, 12), _refs(1, 3)
    order = interleave([a, b])
    records = {r: f"text {r}" for r in order}
    calls: list = []
    docs = _reread(records, calls, batch=4)
    for ref in a:
        assert anyio.run(docs.fetch, ref)[0] == len(records[ref])
    assert calls == [a[:1], a[1:3], a[3:7], a[7:11], a[11:]]  # 1, 2, 4, then the batch size (4)
    assert anyio.run(docs.fetch, b[2]) is not None and calls[-1] == [b[2], b[0], b[1]]


def test_load_and_later() -> None:
    refs = _refs(0, 5)
    calls: list = []
    docs = _reread({r: "x" * i for i, r in enumerate(refs)}, calls)
    anyio.run(docs.load, refs[:2])
    assert calls == [refs[:2]]
    assert docs.now(refs[0])[1][0] == 0 and docs.now(refs[0])[1][0] == 0  # loaded: at hand, any number of times
    assert not isinstance(docs.later(refs[1])[1], Deferred)
    ref, payload = docs.later(refs[4])
    assert isinstance(payload, Deferred) and calls == [refs[:2]]  # nothing tokenized until fetched
    assert anyio.run(payload.fetch, ref)[0] == 4
    with pytest.raises(IncompatibleState, match="not loaded"):
        docs.now(refs[3])


def test_a_document_that_no_longer_tokenizes_is_refused() -> None:
    refs = _refs(0, 3)
    docs = _reread({r: "x" for r in refs}, [], skip={refs[1]})
    with pytest.raises(IncompatibleState, match=r"no longer tokenize"):
        anyio.run(docs.load, refs)


def test_interleave() -> None:
    assert interleave([[1, 2, 3], [4], [], [5, 6]]) == [1, 4, 5, 2, 6, 3]
    assert interleave([]) == []
