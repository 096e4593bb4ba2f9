"""algorithm.resample_flat_groups: a fully_async rollout worker leaves out a group whose rewards are
all equal (its admission slot then starts another group: rollout/stream.py releases the ticket of a
record that is None, as for a failed reward), at most 4 x groups_per_step in a row; the other modes
refuse the key with one line."""

from concurrent.futures import Future
from types import SimpleNamespace

import pytest
import torch

from async_flowgrpo.config import ConfigError, load_config
from async_flowgrpo.rollout import stream as stream_module
from async_flowgrpo.rollout.worker import RolloutWorker


def scored(*rewards: float) -> SimpleNamespace:
    return SimpleNamespace(rewards=torch.tensor(rewards), size=len(rewards))


def worker(*overrides: str) -> RolloutWorker:
    cfg = load_config("fully_async", ["rollout.groups_per_step=2", *overrides])
    return RolloutWorker(cfg, engine=SimpleNamespace(version=0), reward=object())


def test_flat_groups_are_left_out_and_counted_at_most_four_batches_in_a_row():
    w = worker("algorithm.resample_flat_groups=true")
    assert not w._resample(scored(1.0, 0.0, 1.0))  # something to learn: delivered
    assert [w._resample(scored(0.0, 0.0)) for _ in range(8)] == [True] * 8  # 4 x groups_per_step
    assert not w._resample(scored(0.0, 0.0))  # the ninth in a row is kept: the trainer never starves
    assert w._resample(scored(1.0, 1.0))  # the count starts again
    assert not w._resample(scored(0.2, 0.7))
    stats = w.stats()
    assert stats["samples/resampled_flat"] == 9 * 2 and stats["rollout/resampled_flat_reward"] == pytest.approx(1 / 9)


def test_without_the_key_every_scored_group_is_delivered():
    w = worker()
    assert not w._resample(scored(0.0, 0.0))
    assert "samples/resampled_flat" not in w.stats()


def test_the_fully_async_loop_hands_in_no_record_for_a_flat_group(monkeypatch):
    """run()'s records: None for a flat group (stream_groups then gives its slot back), the stored
    record otherwise, and None for a group whose reward failed, as before."""
    w = worker("algorithm.resample_flat_groups=true")
    groups = {0: scored(1.0, 1.0), 1: scored(0.0, 1.0), 2: None}

    def start_group(ticket: int) -> Future:
        done = Future()
        done.set_result(groups[ticket])
        return done

    made = {}

    def stream_groups(queue, worker_id, make_record, stopped, poll_s):
        made.update({t: make_record(t).result(timeout=5) for t in groups})

    monkeypatch.setattr(w, "start_group", start_group)
    monkeypatch.setattr(stream_module, "stream_groups", stream_groups)  # (the worker imports it when it streams)
    w.run(queue=None, store=lambda group: ("record", group), poll_s=0.1)
    assert made == {0: None, 1: ("record", groups[1]), 2: None}


@pytest.mark.parametrize("mode", ["sync", "one_step_off"])
def test_batch_modes_refuse_the_key_with_one_line(mode):
    with pytest.raises(ConfigError, match=r"^algorithm.resample_flat_groups: fully_async only .*drop_zero_std") as error:
        load_config(mode, ["algorithm.resample_flat_groups=true"])
    assert len(str(error.value).splitlines()) == 1
