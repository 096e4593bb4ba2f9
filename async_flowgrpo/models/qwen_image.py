"""Qwen-Image adapter (diffusers QwenImagePipeline).

Family conventions, as the pipeline applies them:
- Text: Qwen2.5-VL's last hidden states of the prompt wrapped in the pipeline's chat template,
  with the template's prefix tokens dropped (`pipeline.encode_prompt` does both) and a padding
  mask (`prompt_embeds_mask`). No pooled embedding: the PromptEmbeds / Group "pooled" slot
  carries the float 0/1 mask [B, L] instead (negative_pooled: the negative prompt's mask).
  Embeddings are padded with zeros (mask 0) to the fixed `max_sequence_length` of
  async_flowgrpo.json (default 512, the pipeline's) so groups from different batches stack in
  the trainer; `velocity` trims the batch back to its longest prompt before the transformer
  (masked keys do not change the image tokens: the text RoPE does not depend on the length).
- Latents: 16 channels from AutoencoderKLQwenImage (a video VAE: 5-D latents with a frame axis),
  packed 2 x 2 for the transformer. Stored UNPACKED [C, H/8, W/8] without the frame axis;
  `velocity` packs/unpacks, `decode` adds the frame axis and un-normalizes with the VAE's
  per-channel latents_mean / latents_std.
- Timestep: sigma in 0..1 (the pipeline passes t/1000; the transformer's projection scales by 1000).
- Guidance: true CFG when guidance_scale > 1 (`true_cfg_scale`), with the negative prompt of
  async_flowgrpo.json (" " by default, as Qwen-Image's examples use), followed by the pipeline's
  norm-preserving rescale: v = v_cfg * |v_cond| / |v_cfg|, norms over the packed channel axis of
  each 2 x 2 patch token. Both halves run as one batch.
- Sigmas: linspace(1, 1/N, N), then the scheduler's dynamic shift exp(mu) with
  mu = calculate_shift(image sequence length) (and its shift_terminal stretch where configured).
"""

from __future__ import annotations

import torch
from torch import Tensor

from async_flowgrpo.models.base import FamilyAdapter
from async_flowgrpo.models.common import PromptEmbeds, denormalize_latents


class QwenImageAdapter(FamilyAdapter):
    family = "qwen_image"
    pipeline_class = "QwenImagePipeline"
    # LoRA: the default attention targets, image and text streams (Flow-GRPO's Qwen-Image LoRA too)
    default_max_sequence_length = 512  # the pipeline's default
    default_negative_prompt = " "
    packed = True
    MAX_TEXT_CALLS = 4  # transformer calls a batch is split into by text length (_text_runs); more: one masked call

    def _configure(self, settings: dict) -> None:
        if "prompt_template_encode_start_idx" in settings:  # tokens of the template's prefix (34 for Qwen2.5-VL)
            self.pipeline.prompt_template_encode_start_idx = settings["prompt_template_encode_start_idx"]

    def _encode(self, prompts: list[str]) -> tuple[Tensor, Tensor]:
        embeds, mask = self.pipeline.encode_prompt(
            prompt=prompts, device=self.device, max_sequence_length=self.max_sequence_length
        )
        return self._padded(embeds, mask)

    def _padded(self, embeds: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor]:
        """encode_prompt's (embeds, mask) padded to max_sequence_length: [B, L, D], float mask [B, L]."""
        b, n, d = embeds.shape
        if n > self.max_sequence_length:  # (the edit pipelines' prompts hold the image's tokens and do not truncate)
            raise ValueError(f"a prompt encodes to {n} tokens, more than the model's max_sequence_length "
                             f"{self.max_sequence_length}: shorten it or raise max_sequence_length in async_flowgrpo.json")
        if mask is None:  # the pipeline drops an all-ones mask
            mask = torch.ones(b, n, device=embeds.device)
        pad = self.max_sequence_length - n
        embeds = torch.cat([embeds, embeds.new_zeros(b, pad, d)], 1)
        mask = torch.cat([mask.to(embeds.dtype), mask.new_zeros(b, pad).to(embeds.dtype)], 1)
        return embeds, mask

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], *, cfg: bool) -> PromptEmbeds:
        """embeds [B, max_sequence_length, D]; `pooled` is the float mask [B, max_sequence_length]."""
        embeds, mask = self._encode(prompts)
        if not cfg:
            return PromptEmbeds(embeds, mask)
        neg, neg_mask = self._encode([self.negative_prompt] * len(prompts))
        return PromptEmbeds(embeds, mask, neg, neg_mask)

    def _text(self, embeds: Tensor, mask: Tensor) -> tuple[Tensor, Tensor | None]:
        """The batch's text embeddings and bool mask trimmed of the shared padding (up to the batch's
        last valid token); the mask None when nothing is masked."""
        mask = mask.to(self.device) > 0.5
        valid = mask.any(0).nonzero()
        length = int(valid.max()) + 1 if len(valid) else 1
        length = min(-(-length // self.token_multiple) * self.token_multiple, mask.shape[1])  # masked padding
        mask = mask[:, :length]
        return embeds[:, :length], None if bool(mask.all()) else mask

    def _text_runs(self, embeds: Tensor, mask: Tensor, read: Tensor | None = None
                   ) -> tuple[list[tuple[slice, Tensor, Tensor | None]], list]:
        """The batch as transformer calls: (rows, their text, its mask). A CFG batch (the negative
        prompt, shorter, beside a group's prompt) goes as the pipeline calls it, a call per half, each
        trimmed to its text and unmasked (`encode_prompt` drops an all-ones mask): a mask in the call
        takes SDPA off its fastest kernels for every row, and attention is a quarter of the edit
        model's FLOPs. Masked padding keys change no valid token (the text's RoPE positions are its
        indices), so the calls compute what the masked batch does. Past MAX_TEXT_CALLS runs of one
        text length (a trainer's micro-batch or an evaluation's chunk of many prompts: many small
        calls would cost more than the mask), or with rows whose mask has holes (`_padded` makes
        none), the batch keeps one masked call; padding kept for sequence parallelism
        (`token_multiple`) stays masked.
        `read`: values the caller needs on the host, read with the lengths (one host read a call)."""
        valid = mask.to(self.device) > 0.5
        b, length = valid.shape
        ends = torch.where(valid, torch.arange(1, length + 1, device=valid.device), 0).amax(1)
        extra = [] if read is None else [read.to(self.device).long()]
        host = torch.cat([*extra, ends, valid.sum(1)]).tolist()
        read_back, host = host[: len(host) - 2 * b], host[len(host) - 2 * b:]
        keys = [end if end == count and end > 0 else -1 for end, count in zip(host[:b], host[b:])]
        cuts = [row for row in range(1, b) if keys[row] != keys[row - 1]]
        if len(cuts) >= self.MAX_TEXT_CALLS or -1 in keys:
            return [(slice(None), *self._text(embeds, mask))], read_back
        runs = []
        for start, stop in zip([0, *cuts], [*cuts, b]):
            rows = slice(start, stop) if cuts else slice(None)
            keep = min(-(-keys[start] // self.token_multiple) * self.token_multiple, length)
            runs.append((rows, embeds[rows][:, :keep], None if keep == keys[start] else valid[rows][:, :keep]))
        return runs, read_back

    def _forward(self, transformer, x, t, embeds, mask, *, shape, guidance_scale):
        """`mask` (the pooled slot): the text mask, see the module docstring; the calls `_text_runs` makes."""
        h, w = shape[-2:]
        runs, _ = self._text_runs(embeds, mask)
        outs = [transformer(hidden_states=x[rows], timestep=t[rows], encoder_hidden_states=text,
                            encoder_hidden_states_mask=text_mask, img_shapes=[[(1, h // 2, w // 2)]] * x[rows].shape[0],
                            return_dict=False)[0]
                for rows, text, text_mask in runs]
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _after_cfg(self, v: Tensor, v_cond: Tensor) -> Tensor:
        return v * (v_cond.norm(dim=-1, keepdim=True) / v.norm(dim=-1, keepdim=True))

    def _latents_for_vae(self, z: Tensor) -> Tensor:
        return denormalize_latents(self.pipeline.vae, z[:, :, None])  # a one-frame video: [n, C, 1, h, w]

    def _from_vae(self, x: Tensor) -> Tensor:
        return x[:, :, 0]
