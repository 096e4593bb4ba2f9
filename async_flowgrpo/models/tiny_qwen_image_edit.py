"""Build a tiny QwenImageEditPipeline or QwenImageEditPlusPipeline (Qwen-Image-Edit, -2509) offline, for tests.

The tiny Qwen-Image parts (`tiny_qwen_image`), with what the edit pipelines add:
- The Qwen2.5-VL vision tower runs (the prompt is encoded with its image): one block with 4 px
  patches, merged 2 x 2 as Qwen2.5-VL's, so a 32 x 32 image is 16 tokens of the text sequence.
- An image processor of the same patch size (Qwen2VLImageProcessorPil, which needs no torchvision)
  saved under processor/; the pipeline is saved without a processor (transformers builds a
  Qwen2VLProcessor only with torchvision), and the adapter builds one from that folder.
- The tokenizer knows the edit template's words and Plus's "Picture k:" labels, and splits the
  template's prefix into 64 tokens as Qwen2's BPE does, the pipelines'
  `prompt_template_encode_start_idx` (checked here).
- Images resize to 32 * 32 pixels (`vae_image_area`, `condition_image_area` in async_flowgrpo.json):
  the pipelines' 1024 * 1024 and 384 * 384 at the twin's size.
"""

from __future__ import annotations

import os

from diffusers import QwenImageEditPipeline, QwenImageEditPlusPipeline

from async_flowgrpo.models.tiny import save_tiny
from async_flowgrpo.models.tiny_qwen_image import (DEFAULT_VOCAB, TinyQwenImageSpec, build_tiny_qwen_image,
                                                   template_prefix_length)

PATCH = 4  # the vision tower's patch side in pixels
PICTURE_WORDS = ("picture", ":", "1", "2", "3", "4")  # Plus labels each image "Picture k: "


def build_tiny_qwen_image_edit(spec: TinyQwenImageSpec, plus: bool = False):
    pipeline_class = QwenImageEditPlusPipeline if plus else QwenImageEditPipeline
    return build_tiny_qwen_image(spec, pipeline_class, processor=None)


def make_tiny_qwen_image_edit_dir(path: str, plus: bool = False, **spec_kw) -> str:
    """Build, save and return a tiny random Qwen-Image-Edit (plus=True: Edit-Plus) model directory."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    spec_kw["vocab"] = tuple(spec_kw.get("vocab", DEFAULT_VOCAB)) + PICTURE_WORDS
    spec = TinyQwenImageSpec(**{"vision_patch_size": PATCH, "max_sequence_length": 64, **spec_kw})
    pipe = build_tiny_qwen_image_edit(spec, plus)
    drop = template_prefix_length(pipe)
    if drop != pipe.prompt_template_encode_start_idx:
        raise RuntimeError(f"tiny tokenizer splits the edit template's prefix into {drop} tokens, the pipeline "
                           f"drops {pipe.prompt_template_encode_start_idx}")
    area = spec.resolution * spec.resolution
    save_tiny(pipe, path, "qwen_image_edit_plus" if plus else "qwen_image_edit", spec, resolution=spec.resolution,
              max_sequence_length=spec.max_sequence_length, vae_image_area=area, condition_image_area=area)
    # smallest and largest images in pixels: 2 x 2 to 8 x 8 merged tokens
    Qwen2VLImageProcessorPil(patch_size=PATCH, merge_size=2, temporal_patch_size=2, min_pixels=(4 * PATCH) ** 2,
                             max_pixels=(16 * PATCH) ** 2).save_pretrained(os.path.join(path, "processor"))
    return path
