"""Qwen-Image-Edit and Qwen-Image-Edit-2509 ("Plus") adapters (diffusers QwenImageEditPipeline,
QwenImageEditPlusPipeline): Qwen-Image with input images, on the text side and in the sequence.

What differs from Qwen-Image (`qwen_image.py`), as diffusers 0.42's pipelines do it (quoted lines
are from diffusers/pipelines/qwenimage/pipeline_qwenimage_edit.py, "Plus" from
pipeline_qwenimage_edit_plus.py):

- Each input image is resized to a target area at its own aspect ratio, to multiples of 32:
  `calculate_dimensions(target_area, ratio)` (`round(width / 32) * 32`). Edit (`__call__`):
  `calculate_dimensions(1024 * 1024, image_size[0] / image_size[1])`, then
  `image = self.image_processor.resize(image, calculated_height, calculated_width)` and
  `prompt_image = image`: the text encoder sees the VAE's image. Plus (`__call__`): two resizes per
  image, `calculate_dimensions(CONDITION_IMAGE_SIZE, ...)` (384 * 384) for the text encoder and
  `calculate_dimensions(VAE_IMAGE_SIZE, ...)` (1024 * 1024) for the VAE. Our `vae_image_area` and
  `condition_image_area` (async_flowgrpo.json may set them: the tiny twin's are 32 * 32).
- The prompt is encoded by Qwen2.5-VL WITH the image(s), through the pipeline's own
  `encode_prompt(prompt, image=...)` (`_get_qwen_prompt_embeds`: `self.processor(text=txt,
  images=image, ...)`, then `self.text_encoder(..., pixel_values=..., image_grid_thw=...)`), with the
  edit template and `self.prompt_template_encode_start_idx = 64` (the system prompt dropped; the
  image's tokens and the instruction kept). Edit's template holds one
  `<|vision_start|><|image_pad|><|vision_end|>`; Plus puts `"Picture {}: <|vision_start|>..."` per
  image before the instruction (`img_prompt_template`). The negative prompt is encoded with the
  same image(s) (`self.encode_prompt(image=prompt_image, prompt=negative_prompt, ...)`). The
  embeddings hold the image's vision tokens (a 1024 x 1024 image: 1369 of them), so
  `max_sequence_length` defaults higher than Qwen-Image's, and a longer prompt is an error, not a
  truncation (the pipelines never truncate).
- The VAE latents of each image (`_encode_vae_image`: `retrieve_latents(...,
  sample_mode="argmax")`, then `(image_latents - latents_mean) / latents_std`) are packed 2 x 2
  (`prepare_latents`: `self._pack_latents(image_latents, ...)`; Plus: `torch.cat(all_image_latents,
  dim=1)`) and joined after the noisy tokens in every step (`latent_model_input =
  torch.cat([latents, image_latents], dim=1)`), the negative branch included. The transformer gets
  one shape per image: `img_shapes = [[(1, height // self.vae_scale_factor // 2, ...), (1,
  calculated_height // self.vae_scale_factor // 2, ...)]] * batch_size` (Plus: one entry per VAE
  image), and its output keeps the noisy tokens: `noise_pred = noise_pred[:, : latents.size(1)]`,
  before the CFG combine and its norm rescale (Qwen-Image's `_after_cfg`). Only the noisy tokens
  are sampled, scored and trained; the image tokens are fixed inputs.
- Sigmas as Qwen-Image's: `image_seq_len = latents.shape[1]`, the noisy tokens only.
- The image tokens are encoded once per group and travel in the group's conditioning, as FLUX.1
  Kontext's do (`flux_kontext.py`): the "pooled" slot is [text mask (max_sequence_length) | the
  images' latent height and width (2) | their packed tokens, flattened], so every replay passes
  the rollout's tokens bit for bit. All of a prompt's images must resize to one size (the prompt
  file check makes every input image the output's size).
- Edit takes one image per prompt (its template has one image slot; `check_image_count`); Plus
  takes several (its `__call__` serves batch_size 1 only: we call `encode_prompt` per prompt).
- The processor: without torchvision, transformers cannot build a `Qwen2VLProcessor` (its video
  processor needs torchvision), so the pipeline is loaded without one and `load` builds it from the
  model's processor/preprocessor_config.json (the PIL image processor) and the pipeline's tokenizer,
  with no video processor (the pipelines pass no videos). With torchvision the model's own loads.
"""

from __future__ import annotations

import importlib.util
import os

import torch
from PIL import Image
from torch import Tensor

from async_flowgrpo.models.common import PromptEmbeds, pack_latents
from async_flowgrpo.models.qwen_image import QwenImageAdapter


def images_only_processor(folder: str, tokenizer):
    """A Qwen2VLProcessor over the image processor saved in `folder` and `tokenizer`, without a
    video processor (which transformers builds only with torchvision)."""
    from transformers import Qwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    class ImagesOnlyProcessor(Qwen2VLProcessor):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    return ImagesOnlyProcessor(image_processor=Qwen2VLImageProcessorPil.from_pretrained(folder), tokenizer=tokenizer,
                               video_processor=None)


class QwenImageEditAdapter(QwenImageAdapter):
    family = "qwen_image_edit"
    pipeline_class = "QwenImageEditPipeline"
    image_conditioned = True
    max_images: int | None = 1  # input images per prompt (None: any number)
    # the image's 1369 vision tokens (1024 x 1024, 28 px per merged token), the template's and the instruction's
    default_max_sequence_length = 1536
    vae_image_area = 1024 * 1024
    condition_image_area: int | None = None  # None: the text encoder sees the VAE's resized image

    @classmethod
    def check_image_count(cls, count: int) -> None:
        if cls.max_images is not None and count > cls.max_images:
            raise ValueError(f"model.family {cls.family} takes {cls.max_images} input image per prompt, got {count}; "
                             "Qwen-Image-Edit-2509 (model.family=qwen_image_edit_plus) takes several")

    @classmethod
    def _load_kwargs(cls, path: str) -> dict:
        return {} if importlib.util.find_spec("torchvision") else {"processor": None}

    @classmethod
    def load(cls, path: str, **kwargs) -> QwenImageEditAdapter:
        adapter = super().load(path, **kwargs)
        pipe = adapter.pipeline
        if pipe.processor is None:
            pipe.register_modules(processor=images_only_processor(os.path.join(path, "processor"), pipe.tokenizer))
        return adapter

    def _configure(self, settings: dict) -> None:
        super()._configure(settings)
        self.vae_image_area = settings.get("vae_image_area", self.vae_image_area)
        self.condition_image_area = settings.get("condition_image_area", self.condition_image_area)

    # ---------------------------------------------------------------- conditioning

    def _resized(self, image: Tensor, area: int) -> Image.Image:
        """uint8 [H, W, 3] -> a PIL image of about `area` pixels at its aspect ratio, as the pipelines resize."""
        from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import calculate_dimensions

        pil = Image.fromarray(image.cpu().numpy())
        width, height = calculate_dimensions(area, pil.width / pil.height)
        return self.pipeline.image_processor.resize(pil, height, width)

    def _prompt_images(self, images: list[Image.Image]):
        """What `encode_prompt(image=...)` takes: Edit one image, Plus a list."""
        return images[0]

    @torch.no_grad()
    def encode_images(self, images: list[Tensor]) -> Tensor:
        """One prompt's input images -> float32 [2 + k * (h/2)(w/2) * 4C]: their latent h and w, then
        their packed, normalised VAE latents."""
        resized = [self._resized(img, self.vae_image_area) for img in images]
        if len({im.size for im in resized}) != 1:
            raise ValueError(f"a prompt's input images must share one size, got {[im.size for im in resized]}")
        width, height = resized[0].size
        pixels = torch.cat([self.pipeline.image_processor.preprocess(im, height, width) for im in resized])
        vae = self.pipeline.vae
        z = self.pipeline._encode_vae_image(pixels[:, :, None].to(self.device, vae.dtype), generator=None)[:, :, 0]
        size = torch.tensor(z.shape[-2:], dtype=torch.float32, device=z.device)
        return torch.cat([size, pack_latents(z.float()).flatten()])

    def _encode_with(self, prompt: str, images) -> tuple[Tensor, Tensor]:
        embeds, mask = self.pipeline.encode_prompt(prompt=[prompt], image=images, device=self.device)
        return self._padded(embeds, mask)

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], *, cfg: bool, images: list[list[Tensor]] | None = None) -> PromptEmbeds:
        """embeds [B, max_sequence_length, D]; `pooled` [B, max_sequence_length + 2 + image tokens] (module docstring)."""
        if images is None or len(images) != len(prompts):
            raise ValueError(f"{self.family} edits images: every prompt needs its input image(s) "
                             "(a JSONL prompt file's \"images\")")
        counts = {len(imgs) for imgs in images}
        if len(counts) != 1 or 0 in counts:
            raise ValueError(f"every prompt needs the same number (>= 1) of input images, got {sorted(counts)}")
        self.check_image_count(counts.pop())
        rows = []
        for prompt, imgs in zip(prompts, images):
            seen = self._prompt_images([self._resized(img, self.condition_image_area or self.vae_image_area)
                                        for img in imgs])
            tokens = self.encode_images(imgs)
            embeds, mask = self._encode_with(prompt, seen)
            row = [embeds, torch.cat([mask.float(), tokens[None].to(mask.device)], 1)]
            if cfg:
                neg, neg_mask = self._encode_with(self.negative_prompt, seen)
                row += [neg, torch.cat([neg_mask.float(), tokens[None].to(neg_mask.device)], 1)]
            rows.append(row)
        return PromptEmbeds(*(torch.cat(parts) for parts in zip(*rows)))

    def _forward(self, transformer, x, t, embeds, pooled, *, shape, guidance_scale):
        """Qwen-Image's calls (`_text_runs`), the input images' tokens joined after the noisy ones."""
        (h, w), length = shape[-2:], self.max_sequence_length
        pooled = pooled.to(self.device)
        runs, (image_h, image_w) = self._text_runs(embeds, pooled[:, :length], read=pooled[0, length:length + 2].round())
        image = [(1, image_h // 2, image_w // 2)]
        outs = []
        for rows, text, text_mask in runs:
            xs = x[rows]
            tokens = pooled[rows, length + 2:].reshape(xs.shape[0], -1, xs.shape[-1]).to(self.dtype)
            count = tokens.shape[1] // ((image_h // 2) * (image_w // 2))
            out = transformer(
                hidden_states=torch.cat([xs, tokens], 1),
                timestep=t[rows],
                encoder_hidden_states=text,
                encoder_hidden_states_mask=text_mask,
                img_shapes=[[(1, h // 2, w // 2)] + image * count] * xs.shape[0],
                return_dict=False,
            )[0]
            outs.append(out[:, : xs.shape[1]])
        return outs[0] if len(outs) == 1 else torch.cat(outs)


class QwenImageEditPlusAdapter(QwenImageEditAdapter):
    family = "qwen_image_edit_plus"
    pipeline_class = "QwenImageEditPlusPipeline"
    max_images = None
    default_max_sequence_length = 1024  # about 200 tokens per 384 x 384 image, and the instruction
    condition_image_area = 384 * 384  # CONDITION_IMAGE_SIZE

    def _prompt_images(self, images: list[Image.Image]):
        return images
