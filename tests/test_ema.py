"""The weight average that evaluation and saved weights use (async_flowgrpo.ema)."""

from __future__ import annotations

import pytest
import torch

from async_flowgrpo.ema import WeightAverage


def live_weights() -> dict[str, torch.Tensor]:
    return {"a": torch.zeros(3), "b": torch.full((2, 2), 4.0)}


def test_the_first_updates_follow_flow_grpos_warm_up_and_then_the_cap():
    live = live_weights()
    avg = WeightAverage(live, decay=0.5)
    live["a"].fill_(10.0)
    avg.update()  # d = 1/10: the average moves 0.9 of the way
    torch.testing.assert_close(avg.average["a"], torch.full((3,), 9.0))
    live["a"].fill_(20.0)
    avg.update()  # d = min(2/11, 0.5)
    torch.testing.assert_close(avg.average["a"], torch.full((3,), 9.0 * 2 / 11 + 20.0 * 9 / 11))
    torch.testing.assert_close(avg.average["b"], torch.full((2, 2), 4.0))  # unchanged weights stay put
    for _ in range(20):
        avg.update()
    assert avg.updates == 22 and avg.current_decay() == 0.5  # (1 + 22) / 32 > 0.5: the cap rules


def test_swapped_in_shows_the_average_and_restores_the_live_weights_even_on_error():
    live = live_weights()
    avg = WeightAverage(live, decay=0.9)
    live["a"].fill_(1.0)
    avg.update()
    expected_live = {k: v.clone() for k, v in live.items()}
    with avg.swapped_in():
        torch.testing.assert_close(live["a"], avg.average["a"])
        assert not torch.equal(live["a"], expected_live["a"])
    with pytest.raises(RuntimeError), avg.swapped_in():
        raise RuntimeError("evaluation failed")
    for k in live:
        assert torch.equal(live[k], expected_live[k])


def test_state_dict_round_trip_and_a_mismatch_is_refused():
    live = live_weights()
    avg = WeightAverage(live, decay=0.9)
    live["b"].add_(1.0)
    avg.update()
    avg.update()
    again = WeightAverage(live_weights(), decay=0.9)
    again.load_state_dict(avg.state_dict())
    assert again.updates == 2
    for k in avg.average:
        assert torch.equal(again.average[k], avg.average[k])
    with pytest.raises(KeyError):
        WeightAverage({"c": torch.zeros(1)}, decay=0.9).load_state_dict(avg.state_dict())
    with pytest.raises(ValueError):
        WeightAverage(live, decay=1.0)
