"""benchmarks/grad_signal.py: the signal-share estimate and one tiny end-to-end measurement."""

import json

import pytest
from conftest import load_benchmark
import torch


@pytest.fixture(scope="module")
def grad_signal():
    return load_benchmark("grad_signal")


def test_signal_share_recovers_the_signal_fraction_of_synthetic_gradients(grad_signal):
    g = torch.Generator().manual_seed(0)
    dim, n = 20_000, 12
    signal = torch.randn(dim, generator=g)
    noise_scale = 3.0  # E|n|^2 = 9 |s|^2: a tenth of each gradient's squared norm is signal
    grads = [signal + noise_scale * torch.randn(dim, generator=g) for _ in range(n)]
    mean, se = grad_signal.signal_share(grads)
    assert mean == pytest.approx(0.1, abs=0.02) and 0 < se < 0.02
    same = grad_signal.signal_share([signal] * 3)
    assert same[0] == pytest.approx(1.0) and same[1] == pytest.approx(0.0, abs=1e-9)
    pure_noise = grad_signal.signal_share([torch.randn(dim, generator=g) for _ in range(n)])
    assert abs(pure_noise[0]) < 0.01
    with pytest.raises(ValueError, match="at least 3"):
        grad_signal.signal_share(grads[:2])


def test_standardized_gradients_find_the_signal_that_large_noisy_coordinates_hide(grad_signal):
    """Adam divides each coordinate by its own scale: a signal in small coordinates, under noise 100x
    larger in a few others, is invisible to the plain cosine and clear in the standardized one;
    coordinates no batch moves drop out."""
    g = torch.Generator().manual_seed(1)
    n, small, loud = 40, 2_000, 20
    grads = []
    for _ in range(n):
        quiet = 1.0 + 0.5 * torch.randn(small, generator=g)  # signal 1, noise 0.5 (80 % signal share)
        grads.append(torch.cat([quiet, 100.0 * torch.randn(loud, generator=g), torch.zeros(5)]))
    plain, _ = grad_signal.signal_share(grads)
    standardized = grad_signal.standardized(grads)
    assert standardized[0].numel() == small + loud  # the never-moved coordinates are gone
    mean, se = grad_signal.signal_share(standardized)
    assert plain < 0.05 and mean == pytest.approx(small * 0.8 / (small + loud), abs=0.03) and se < 0.02


def test_the_null_control_shuffles_rewards_across_groups_and_recomputes_advantages(grad_signal):
    from types import SimpleNamespace

    from async_flowgrpo.config import AlgorithmConfig

    groups = [SimpleNamespace(rewards=torch.tensor([1.0, 1.0, 1.0]), size=3), SimpleNamespace(rewards=torch.zeros(3), size=3)]
    a = AlgorithmConfig()
    grad_signal.shuffled_rewards(groups, a, torch.Generator().manual_seed(0))
    shuffled = torch.cat([g.rewards for g in groups])
    assert sorted(shuffled.tolist()) == [0.0, 0.0, 0.0, 1.0, 1.0, 1.0]  # the same rewards, moved
    assert shuffled.tolist() != [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    for g in groups:  # each group's advantages from its shuffled rewards (zero mean within a group)
        assert g.advantages.shape == (3,) and float(g.advantages.sum()) == pytest.approx(0.0, abs=1e-6)
        assert (g.advantages > 0).tolist() == (g.rewards > g.rewards.mean()).tolist()


def test_batch_gradient_returns_the_update_gradient_and_leaves_the_weights(grad_signal):
    class Learner:  # the learner's contract: train_step backpropagates, then calls optimizer.step()
        def __init__(self):
            self.params = [torch.nn.Parameter(torch.tensor([1.0, 2.0]))]
            self.optimizer = torch.optim.SGD(self.params, lr=0.5)

        def train_step(self, groups, version):
            (self.params[0] * torch.tensor(groups)).sum().backward()
            self.optimizer.step()
            self.optimizer.zero_grad()

    learner = Learner()
    step = learner.optimizer.step
    assert grad_signal.batch_gradient(learner, [3.0, -1.0]).tolist() == [3.0, -1.0]
    assert learner.params[0].tolist() == [1.0, 2.0] and learner.optimizer.step == step


@pytest.mark.parametrize("algorithm", ["flow_grpo", "diffusion_nft"])
def test_measures_either_algorithms_update_on_a_tiny_model(grad_signal, tiny_model_dir, tmp_path, algorithm):
    files = ["config/diffusion_nft.yaml"] if algorithm == "diffusion_nft" else []
    result = grad_signal.main([
        "--name", "smoke", "--batches", "3", "--out", str(tmp_path), "--null", *files,
        f"model.path={tiny_model_dir}", "rollout.group_size=2", "rollout.groups_per_step=2", "rollout.num_steps=3",
        "rollout.sde_window_size=1", "rollout.sde_window_range=null", "rollout.prompt_mix=null",
        "rollout.prompts=shapes_train",
    ])
    saved = json.loads((tmp_path / "smoke.json").read_text())
    assert saved["algorithm"] == algorithm and saved["batches"] == 3 and saved["samples_per_batch"] == 4
    assert -1.0 <= saved["mean_cos"] <= 1.0 and saved["se"] >= 0 and saved["mean_cos"] == result["mean_cos"]
    for cosines in (saved, saved["null"]):  # plain and standardized, of the real and the shuffled rewards
        assert -1.0 <= cosines["mean_cos_standardized"] <= 1.0 and cosines["se_standardized"] >= 0
