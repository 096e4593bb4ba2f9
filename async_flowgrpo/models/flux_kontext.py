"""FLUX.1 Kontext adapter (diffusers FluxKontextPipeline): Flux with input images joined to the sequence.

What differs from Flux (`flux.py`), as FluxKontextPipeline does it:
- Each input image is VAE-encoded once (the posterior's mode, then (z - shift_factor) *
  scaling_factor), packed 2 x 2 like the latents, and its tokens are appended after the noisy
  latent tokens (`torch.cat([latents, image_latents], dim=1)` in the pipeline's loop); their
  position ids are (1, row, col) where the output's are (0, row, col). The transformer's output
  keeps the first (output) tokens only; with true CFG the negative branch sees the image too.
  Several images (our extension, as Qwen-Image-Edit-Plus takes several) get ids (k, row, col), k = 1, 2, ...
- The image tokens are encoded once per group and travel in the group's conditioning: they are
  appended, flattened, to the pooled CLIP vector (`pooled` = [CLIP pooled | image tokens]), so
  every learner's replay gathers and passes them with the prompt's embeddings, unchanged, and the
  recomputed step sees bit for bit the tokens the rollout saw. `_forward` splits them off again.
- Input images must have the output's size (the prompt file check enforces it), so the number of
  images is the token count over the output's.
"""

from __future__ import annotations

import torch
from torch import Tensor

from async_flowgrpo.models.common import PromptEmbeds, pack_latents
from async_flowgrpo.models.flux import FluxAdapter


class FluxKontextAdapter(FluxAdapter):
    family = "flux_kontext"
    pipeline_class = "FluxKontextPipeline"
    image_conditioned = True

    @torch.no_grad()
    def encode_images(self, images: list[list[Tensor]]) -> Tensor:
        """Per prompt, its input images (uint8 [H, W, 3], one count for all prompts) -> packed
        image tokens [B, k * (h/2)(w/2), 4 C] in float32 (the conditioning's dtype)."""
        counts = {len(imgs) for imgs in images}
        if len(counts) != 1 or 0 in counts:
            raise ValueError(f"every prompt needs the same number (>= 1) of input images, got {sorted(counts)}")
        vae, config = self.pipeline.vae, self.pipeline.vae.config
        pixels = torch.stack([img for imgs in images for img in imgs]).movedim(-1, 1)
        x = pixels.to(self.device, vae.dtype) / 127.5 - 1.0
        z = (vae.encode(x).latent_dist.mode() - config.shift_factor) * config.scaling_factor
        tokens = pack_latents(z.float())
        return tokens.reshape(len(images), -1, tokens.shape[-1])

    def encode_prompts(self, prompts: list[str], *, cfg: bool, images: list[list[Tensor]] | None = None) -> PromptEmbeds:
        if images is None or len(images) != len(prompts):
            raise ValueError(f"{self.family} edits images: every prompt needs its input image(s) "
                             "(a JSONL prompt file's \"images\")")
        enc = super().encode_prompts(prompts, cfg=cfg)
        tokens = self.encode_images(images).flatten(1).to(enc.pooled.device)

        def join(pooled: Tensor | None) -> Tensor | None:
            return None if pooled is None else torch.cat([pooled.float(), tokens], 1)

        return PromptEmbeds(enc.embeds, join(enc.pooled), enc.negative_embeds, join(enc.negative_pooled))

    def _ids(self, h: int, w: int, images: int, text: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """(img_ids, txt_ids) on the device: the output's (0, row, col) then each input image's (k, row,
        col), and the text's zeros; built once per size and kept, as the pipeline builds its ids once
        per call (`prepare_latents`), not every step: built on the host, each step's copy to the device
        synchronised the stream in every denoising step (a blocking `.to(device)`)."""
        key = (h, w, images, text, self.device, dtype)
        cache = self.__dict__.setdefault("_id_cache", {})
        if key not in cache:
            with torch.inference_mode(False):  # kept for later calls, which may record autograd
                ids = self.pipeline._prepare_latent_image_ids(None, h, w, self.device, dtype)
                first = torch.zeros(1, dtype=torch.long, device=self.device)  # index_fill_'s index: the frame column
                img_ids = torch.cat([ids] + [ids.clone().index_fill_(1, first, k) for k in range(1, images + 1)])
                txt_ids = torch.zeros(text, 3, device=self.device, dtype=dtype)
            if len(cache) >= 8:
                cache.clear()
            cache[key] = (img_ids, txt_ids)
        return cache[key]

    def _forward(self, transformer, x, t, embeds, pooled, *, shape, guidance_scale):
        dt, (h, w), n = self.dtype, shape[-2:], x.shape[1]
        pooled = pooled.to(self.device)
        width = transformer.config.pooled_projection_dim
        tokens = pooled[:, width:].reshape(x.shape[0], -1, x.shape[-1]).to(dt)
        img_ids, txt_ids = self._ids(h // 2, w // 2, tokens.shape[1] // n, embeds.shape[1], dt)
        guidance = None
        if self.guidance_distilled:
            guidance = torch.full((x.shape[0],), float(guidance_scale), device=self.device, dtype=torch.float32)
        out = transformer(hidden_states=torch.cat([x, tokens], 1), timestep=t, guidance=guidance,
                          pooled_projections=pooled[:, :width].to(dt), encoder_hidden_states=embeds, txt_ids=txt_ids,
                          img_ids=img_ids, return_dict=False)[0]
        return out[:, :n]
