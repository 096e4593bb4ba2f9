"""Build a tiny FluxKontextPipeline (real Flux architecture, image tokens joined as Kontext does)
offline: the tiny Flux parts of `tiny_flux`, no guidance embedding by default (true CFG with the
negative prompt, as FLUX.1 Kontext pipelines without distillation run it), optionally a given VAE
(the embedded edit model reuses the shipped shapes model's trained one)."""

from __future__ import annotations

from diffusers import FluxKontextPipeline

from async_flowgrpo.models.tiny import save_tiny
from async_flowgrpo.models.tiny_flux import TinyFluxSpec, build_tiny_flux


def build_tiny_kontext(spec: TinyFluxSpec, vae=None) -> FluxKontextPipeline:
    parts = build_tiny_flux(spec).components
    if vae is not None:
        parts["vae"] = vae
    return FluxKontextPipeline(**parts)


def make_tiny_kontext_dir(path: str, **spec_kw) -> str:
    """Build, save and return a tiny random Flux Kontext model directory (for tests; about a second)."""
    spec = TinyFluxSpec(**{"guidance_embeds": False, **spec_kw})
    return save_tiny(build_tiny_kontext(spec), path, "flux_kontext", spec, resolution=spec.resolution,
                     max_sequence_length=spec.t5_max_length)
