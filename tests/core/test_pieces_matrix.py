"""The whole determinism matrix (tests/core/test_determinism.py) with `piece_tokens`: the same
tests, collected again here with `config` the text config whose documents longer than 24 tokens
(most of source b's, many of a's) are cut into pieces of 24 as they are read, and a shuffle
window per source (`shuffle_scope = "source"`, the setting that pieces are for). Checkpoints
then hold piece references (five ints) in the windows and the packer's carry, and cursors
inside a document; every resume in the matrix restores them."""

from __future__ import annotations

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


@pytest.fixture(params=["pieces"])
def config(request):
    return request.getfixturevalue("config").replace(piece_tokens=24, shuffle_scope="source")
