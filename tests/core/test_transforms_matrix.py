"""The whole determinism matrix (tests/core/test_determinism.py) for filtered and transformed
sources: the same tests, collected again here with `config` the text config whose source a
drops a third of its documents (a filter) and appends a word drawn from the per-record seed (a
map), and whose source b keeps two thirds of its documents, chosen by the seed (a filter).

So maps, filters and per-record seeds give the same batches on every world size and backend
(inline, threads, processes), with any buffer sizes, injected latency, and any resume."""

from __future__ import annotations

import msgspec
import pytest

from tests.core.test_determinism import (  # noqa: F401  (collected here with this module's `config`)
    baseline,
    test_buffer_capacities,
    test_epochs_to_the_end_and_resume_at_epoch_boundary,
    test_injected_read_latency,
    test_read_ahead_window_does_not_change_order,
    test_refuses_world_that_cannot_keep_order,
    test_resume_on_both_sides_of_the_first_epoch_crossing,
    test_resume_onto_other_world_and_backend,
    test_resume_twice,
    test_world_sizes_and_backends,
)
from zephon_stream.loader.config import TransformStep

FNS = "tests.core.transform_fns"
STEPS = {"a": [TransformStep(filter=f"{FNS}:drop_bang"), TransformStep(map=f"{FNS}:seeded_word")],
         "b": [TransformStep(filter=f"{FNS}:keep_some")]}


@pytest.fixture()
def config(config):
    """The text config (tests/core/conftest.py) with STEPS on its sources."""
    return config.replace(sources=[msgspec.structs.replace(s, transforms=STEPS[s.name]) for s in config.sources])
