"""ToDevice on CPU (the no-op transfer path; this machine has no GPU) and the digest helpers.

The read-ahead logic is the same on every device: with `ahead` > 0 the loader runs ahead of the
trainer, and ToDevice's state must still be the frontier of the batches handed out."""

from __future__ import annotations

import itertools

import pytest
import torch

from zephon_stream import ConfigError, Loader
from zephon_stream.distributed import ToDevice, batch_digest, global_batch_digest
from zephon_stream.loader.config import ScheduleEntry


def digests(batches, n):
    return [batch_digest(b["input_ids"], b["slots"]) for b in itertools.islice(batches, n)]


def test_cpu_is_a_pass_through(stream_config, baseline):
    loader = Loader(stream_config[0], dp_rank=0, dp_size=1)
    feed = ToDevice(loader, "cpu")
    assert feed.ahead == 0 and feed._stream is None
    for step, batch in enumerate(feed):
        assert batch_digest(batch["input_ids"], batch["slots"]) == baseline[step]
        assert all(v.device.type == "cpu" for v in batch.values() if torch.is_tensor(v))
        assert feed.state_dict() == loader.state_dict() and loader.step == step + 1
        if step == 5:
            break


@pytest.mark.parametrize("ahead", [1, 3])
def test_read_ahead_checkpoints_the_handed_out_frontier(stream_config, baseline, ahead):
    loader = Loader(stream_config[0], dp_rank=0, dp_size=1)
    feed = ToDevice(loader, "cpu", ahead=ahead)
    it = iter(feed)
    assert digests(it, 4) == baseline[:4]
    assert loader.step == 4 + ahead  # the loader is ahead of the trainer ...
    state = feed.state_dict()  # ... the checkpoint is not
    it.close()  # stopping early rewinds the read-ahead: nothing is skipped
    assert loader.step == 4
    assert digests(iter(feed), 3) == baseline[4:7]
    fresh = ToDevice(Loader(stream_config[0], dp_rank=0, dp_size=1), "cpu", ahead=ahead)
    fresh.load_state_dict(state)
    assert digests(iter(fresh), 5) == baseline[4:9]


W1, W2, W3 = {"a": 0.1, "b": 0.9}, {"a": 0.9, "b": 0.1}, {"a": 0.5, "b": 0.5}


@pytest.mark.parametrize("ahead", [1, 3])
def test_set_weights_for_a_step_read_ahead(stream_config, ahead):
    """The trainer decides for its next step, which the loader has consumed already (read ahead):
    ToDevice reads it again with the new weights. The batches, and a resume from the feed's state,
    are those of the run whose config schedules the same decisions (loader.set_weights refused it:
    'step 4 was already consumed')."""
    config = stream_config[0]
    calls = {3: [(W1, 4), (W3, 30)], 6: [(W2, 6 + ahead)], 9: [(W1, 10)]}  # after step -> (weights, at_step)
    scheduled = config.with_decisions([ScheduleEntry(at, w) for made in calls.values() for w, at in made])
    want = digests(Loader(scheduled, dp_rank=0, dp_size=1), 16)
    feed = ToDevice(Loader(config, dp_rank=0, dp_size=1), "cpu", ahead=ahead)
    got, state = [], None
    for batch in feed:
        got += digests([batch], 1)
        for weights, at in calls.get(batch["step"], []):
            feed.set_weights(weights, at_step=at)
        if batch["step"] == 11:
            state = feed.state_dict()
            with pytest.raises(ConfigError, match=r"step 11 was already handed out .* step >= 12"):
                feed.set_weights(W2, at_step=11)
            with pytest.raises(ConfigError, match="must give a weight to each source"):
                feed.set_weights({"a": 1.0}, at_step=12)
        if batch["step"] == 13:
            break
    assert got == want[:14]
    resumed = ToDevice(Loader(config, dp_rank=0, dp_size=1), "cpu", ahead=ahead)
    resumed.load_state_dict(state)
    assert digests(iter(resumed), 4) == want[12:16]


def test_digests(stream_config, baseline):
    batch = next(iter(Loader(stream_config[0], dp_rank=0, dp_size=1)))
    assert global_batch_digest(batch) == baseline[0]  # no process group: the batch is the global batch
    flipped = torch.flip(batch["input_ids"], [0])
    assert batch_digest(flipped, torch.flip(batch["slots"], [0])) == baseline[0]  # rows in slot order
    assert batch_digest(flipped) != baseline[0]


def test_refuses_negative_read_ahead(stream_config):
    with pytest.raises(ValueError, match="ahead=-1"):
        ToDevice(Loader(stream_config[0], dp_rank=0, dp_size=1), ahead=-1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here: the pinned-memory, side-stream "
                    "copy path runs only on a GPU (its read-ahead logic is tested above on CPU)")
def test_cuda_copies_overlap_and_arrive_intact(stream_config, baseline):
    loader = Loader(stream_config[0], dp_rank=0, dp_size=1)
    feed = ToDevice(loader, "cuda")
    assert feed.ahead == 1
    for step, batch in enumerate(feed):
        assert batch["input_ids"].is_cuda and batch["input_ids"].dtype == torch.int64
        assert batch_digest(batch["input_ids"], batch["slots"]) == baseline[step]  # waits on the copy's event
        assert loader.step == step + 2 and feed.state_dict()["meta"] != loader.state_dict()["meta"]
        if step == 5:
            break
    assert loader.step == 6  # the copied-ahead batch was rewound
