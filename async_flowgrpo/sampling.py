"""Config -> the keyword arguments of `generate` (policy and engines): the one place they are built.

Rollouts sample stochastically on the SDE window (or by ODE for DiffusionNFT); evaluation samples
by ODE with its own steps, guidance and fixed seeds. `types.SamplingParams` is what a group records
of them, for the trainer to replay.
"""

from __future__ import annotations

from async_flowgrpo.config import Config, RolloutConfig


def rollout_sampling(r: RolloutConfig) -> dict:
    """rollout.* as keyword arguments of `generate`."""
    return dict(
        num_steps=r.num_steps,
        guidance_scale=r.guidance_scale,
        noise_level=r.noise_level,
        sde_type=r.sde_type,
        window_size=0 if r.sampler == "ode" else r.sde_window_size or r.num_steps - 1,  # 0: ODE, final latent
        window_range=tuple(r.sde_window_range) if r.sde_window_range else None,
        shared_initial_noise=r.shared_initial_noise,
        after_window_solver=r.after_window_solver,
        after_window_steps=r.after_window_steps,
        height=r.resolution or None,
        width=r.resolution or None,
    )


def eval_sampling(cfg: Config) -> dict:
    """eval.* (with the rollout's noise settings and resolution) as keyword arguments of `generate`:
    pure ODE, nothing recorded."""
    e, r = cfg.eval, cfg.rollout
    return dict(
        num_steps=e.num_steps,
        guidance_scale=e.guidance_scale,
        noise_level=r.noise_level,
        sde_type=r.sde_type,
        window_size=0,
        height=r.resolution or None,
        width=r.resolution or None,
    )
