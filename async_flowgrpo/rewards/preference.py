"""Human-preference rewards from local files: HPSv2 / HPSv2.1 and ImageReward, scored with the CLIP
and BLIP classes transformers ships (nothing downloaded; a missing path or package is one line).

Their own packages are not used: on PyPI, hpsv2 1.2.0 pins pytest==7.2.0 and protobuf<4 and pulls
webdataset, pandas and pyarrow; image-reward 1.5 pins timm==0.6.13 and fairscale==0.4.13. Their
scoring is a few lines, followed here as quoted below. (HPSv3 is a Qwen2-VL-7B reward model whose
package pins transformers==4.45.2 and pulls deepspeed and trl: run it in its own environment behind
`python -m async_flowgrpo.rewards.serve`, docs/rewards.md.)

hpsv2 — the open_clip ViT-H-14 checkpoint HPS_v2.1_compressed.pt (or HPS_v2_compressed.pt), its
keys renamed onto transformers' CLIPModel at load; the score is the cosine similarity, as
hpsv2/img_score.py scores it (the features normalized by `CLIP.forward`, open_clip/model.py):

    logits_per_image = image_features @ text_features.T
    hps_score = torch.diagonal(logits_per_image).cpu().numpy()

The val transform there is `Resize(image_size, interpolation=BICUBIC), CenterCrop(image_size)` on a
tensor (open_clip/transform.py image_transform), hence `preprocess: torch` by default.
Options (`reward.options.hpsv2`): path (the .pt, or a CLIPModel directory already converted; or
$ASYNC_FLOWGRPO_HPSV2_PATH), processor_path (a local copy of laion/CLIP-ViT-H-14-laion2B-s32B-b79K:
its config.json, tokenizer and preprocessor_config.json; or $ASYNC_FLOWGRPO_HPSV2_PROCESSOR_PATH),
device, dtype, batch_size, preprocess as for clip_score.

imagereward — ImageReward.pt (BLIP ViT-L + a BERT-base text encoder with cross-attention + an MLP),
scored as ImageReward/ImageReward.py `ImageReward.score` does:

    text_input = self.blip.tokenizer(prompt, padding='max_length', truncation=True, max_length=35, ...)
    image_embeds = self.blip.visual_encoder(image)
    text_output = self.blip.text_encoder(text_input.input_ids, attention_mask = text_input.attention_mask,
                                         encoder_hidden_states = image_embeds, encoder_attention_mask = image_atts, ...)
    txt_features = text_output.last_hidden_state[:,0,:].float()
    rewards = self.mlp(txt_features)
    rewards = (rewards - self.mean) / self.std

with `self.mean = 0.16717362830052426`, `self.std = 1.0333394966054072` and the transform
`Resize(n_px, interpolation=BICUBIC), CenterCrop(n_px), ToTensor(), Normalize((0.48145466, ...),
(0.26862954, ...))` on the PIL image. BLIP's vision tower (BLIP/vit.py) maps onto
BlipVisionModel, its med.py BertModel onto BlipTextModel (the same layer names); the MLP is the
aesthetic predictor's layout. The architecture is read from the checkpoint's shapes (heads: 64
channels each, as ViT-L and BERT-base have).
Options (`reward.options.imagereward`): path (ImageReward.pt, or $ASYNC_FLOWGRPO_IMAGEREWARD_PATH),
tokenizer_path (a local bert-base-uncased tokenizer directory, or
$ASYNC_FLOWGRPO_IMAGEREWARD_TOKENIZER_PATH), device, dtype, batch_size.
"""

from __future__ import annotations

import os
import re
import threading
from typing import Optional

import numpy as np
import torch
from PIL import Image
from torch import nn

from async_flowgrpo.rewards.aesthetic import AestheticMLP
from async_flowgrpo.rewards.clip_score import (
    _DTYPES,
    _check_inputs,
    _first_line,
    default_device,
    load_clip_encoder,
    resolve_local_path,
)

ENV_HPSV2 = "ASYNC_FLOWGRPO_HPSV2_PATH"
ENV_HPSV2_PROCESSOR = "ASYNC_FLOWGRPO_HPSV2_PROCESSOR_PATH"
ENV_IMAGEREWARD = "ASYNC_FLOWGRPO_IMAGEREWARD_PATH"
ENV_IMAGEREWARD_TOKENIZER = "ASYNC_FLOWGRPO_IMAGEREWARD_TOKENIZER_PATH"

CLIP_MEAN, CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
IMAGEREWARD_MEAN, IMAGEREWARD_STD = 0.16717362830052426, 1.0333394966054072
IMAGEREWARD_MAX_LENGTH = 35
HEAD_DIM = 64

_CACHE: dict[tuple, nn.Module] = {}
_LOCK = threading.Lock()


def read_checkpoint(path: str, reward: str) -> dict[str, torch.Tensor]:
    """A state dict from a .pt/.pth/.bin (tensors only: weights_only) or .safetensors file; a
    {"state_dict": ...} wrapper and DataParallel's "module." prefixes are taken off."""
    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file

            sd = load_file(path)
        else:
            sd = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise RuntimeError(f"{reward}: could not read the checkpoint '{path}': {_first_line(e)}") from e
    if isinstance(sd, dict) and isinstance(sd.get("state_dict"), dict):
        sd = sd["state_dict"]
    if not isinstance(sd, dict):
        raise RuntimeError(f"{reward}: '{path}' holds a {type(sd).__name__}, not a state dict")
    return {k.removeprefix("module."): v for k, v in sd.items() if isinstance(v, torch.Tensor)}


def _load_exactly(module: nn.Module, sd: dict, reward: str, path: str) -> None:
    """load_state_dict that names what did not match (position_ids buffers aside: saved by some
    versions, rebuilt by others)."""
    missing, unexpected = module.load_state_dict({k: v for k, v in sd.items() if not k.endswith("position_ids")}, strict=False)
    missing = [k for k in missing if not k.endswith("position_ids")]
    if missing or unexpected:
        raise RuntimeError(f"{reward}: '{path}' does not match the model: missing {missing[:3]}, unexpected {unexpected[:3]}")


# -- HPSv2 ------------------------------------------------------------------------------------------
# open_clip's block (open_clip/transformer.py ResidualAttentionBlock): ln_1, attn (nn.MultiheadAttention:
# in_proj_weight = [q; k; v]), ln_2, mlp.c_fc, mlp.c_proj. Its VisionTransformer: conv1 (no bias),
# class_embedding, positional_embedding, ln_pre, transformer, ln_post, proj ([width, embed_dim]: x @ proj).
_OPENCLIP_BLOCK = {"ln_1": "layer_norm1", "ln_2": "layer_norm2", "attn.out_proj": "self_attn.out_proj",
                   "mlp.c_fc": "mlp.fc1", "mlp.c_proj": "mlp.fc2"}
_OPENCLIP_TOP = {
    "visual.class_embedding": "vision_model.embeddings.class_embedding",
    "visual.positional_embedding": "vision_model.embeddings.position_embedding.weight",
    "visual.conv1.weight": "vision_model.embeddings.patch_embedding.weight",
    "visual.ln_pre": "vision_model.pre_layrnorm",  # (transformers' spelling)
    "visual.ln_post": "vision_model.post_layernorm",
    "token_embedding.weight": "text_model.embeddings.token_embedding.weight",
    "positional_embedding": "text_model.embeddings.position_embedding.weight",
    "ln_final": "text_model.final_layer_norm",
    "logit_scale": "logit_scale",
}


def openclip_to_clip(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An open_clip CLIP state dict (ViT image tower, its own text transformer) as transformers' CLIPModel's."""
    out = {}
    for key, value in sd.items():
        block = re.match(r"(visual\.)?transformer\.resblocks\.(\d+)\.(.+)$", key)
        if block:
            tower = "vision_model" if block.group(1) else "text_model"
            prefix, rest = f"{tower}.encoder.layers.{block.group(2)}.", block.group(3)
            if rest.startswith("attn.in_proj_"):
                kind = rest.removeprefix("attn.in_proj_")  # weight | bias
                for name, part in zip(("q", "k", "v"), value.chunk(3, dim=0)):
                    out[f"{prefix}self_attn.{name}_proj.{kind}"] = part
                continue
            head, _, leaf = rest.rpartition(".")
            if head not in _OPENCLIP_BLOCK:
                raise KeyError(f"unexpected open_clip key {key}")
            out[f"{prefix}{_OPENCLIP_BLOCK[head]}.{leaf}"] = value
        elif key == "visual.proj":
            out["visual_projection.weight"] = value.t().contiguous()
        elif key == "text_projection":
            out["text_projection.weight"] = value.t().contiguous()
        elif key == "attn_mask":
            continue  # a buffer open_clip rebuilds
        else:
            head, _, leaf = key.rpartition(".")
            if key in _OPENCLIP_TOP:
                out[_OPENCLIP_TOP[key]] = value
            elif head in _OPENCLIP_TOP:
                out[f"{_OPENCLIP_TOP[head]}.{leaf}"] = value
            else:
                raise KeyError(f"unexpected open_clip key {key}")
    return out


def _hps_model_builder(path: str, processor_path: str):
    def build():
        from transformers import CLIPConfig, CLIPModel

        config = CLIPConfig.from_pretrained(processor_path, local_files_only=True)
        model = CLIPModel(config)
        try:
            sd = openclip_to_clip(read_checkpoint(path, "hpsv2"))
        except KeyError as e:
            raise RuntimeError(f"hpsv2: '{path}' is not an open_clip CLIP checkpoint: {e.args[0]}") from None
        _load_exactly(model, sd, "hpsv2", path)
        return model

    return build


@torch.no_grad()
def hpsv2(
    images: torch.Tensor,
    prompts: list,
    metadata: list,
    *,
    path: Optional[str] = None,
    processor_path: Optional[str] = None,
    device: Optional[str] = None,
    dtype: str = "float32",
    batch_size: int = 32,
    preprocess: str = "torch",
) -> torch.Tensor:
    """HPSv2 / HPSv2.1: cosine similarity of the fine-tuned CLIP's image and prompt embeddings."""
    if int(batch_size) < 1:
        raise ValueError(f"hpsv2: batch_size must be >= 1, got {batch_size}")
    _check_inputs("hpsv2", images, prompts)
    path = resolve_local_path(path, ENV_HPSV2, "hpsv2")
    processor_path = resolve_local_path(processor_path or (path if os.path.isdir(path) else None), ENV_HPSV2_PROCESSOR,
                                        "hpsv2", key="processor_path")
    build = None if os.path.isdir(path) else _hps_model_builder(path, processor_path)
    enc = load_clip_encoder(path, processor_path, device, dtype, preprocess, "hpsv2", build_model=build)
    if images.shape[0] == 0:
        return torch.zeros(0)
    img = enc.embed_images(images, int(batch_size))
    txt = enc.embed_texts([str(p) for p in prompts], int(batch_size))
    return (img * txt).sum(-1).cpu()


# -- ImageReward --------------------------------------------------------------------------------------
def clip_pixels(images: torch.Tensor, size: int) -> torch.Tensor:
    """uint8 [n, H, W, 3] -> [n, 3, size, size] as torchvision's Resize(size, BICUBIC) +
    CenterCrop(size) + ToTensor + Normalize(CLIP mean, std) do to PIL images."""
    out = []
    for array in images.detach().cpu().numpy():
        img = Image.fromarray(array)
        w, h = img.size
        short, long = (w, h) if w <= h else (h, w)
        new_short, new_long = size, int(size * long / short)
        img = img.resize((new_short, new_long) if w <= h else (new_long, new_short), Image.BICUBIC)
        w, h = img.size
        top, left = int(round((h - size) / 2.0)), int(round((w - size) / 2.0))
        img = img.crop((left, top, left + size, top + size))
        out.append(torch.from_numpy(np.asarray(img, dtype=np.float32) / 255.0).permute(2, 0, 1))
    x = torch.stack(out)
    return (x - torch.tensor(CLIP_MEAN).view(1, 3, 1, 1)) / torch.tensor(CLIP_STD).view(1, 3, 1, 1)


def _count(sd: dict, pattern: str) -> int:
    return len({m.group(1) for k in sd if (m := re.match(pattern, k))})


def imagereward_configs(sd: dict[str, torch.Tensor]):
    """BlipVisionConfig and BlipTextConfig of the checkpoint (keys without the "blip." prefix), read from its shapes."""
    from transformers import BlipTextConfig, BlipVisionConfig

    width = sd["visual_encoder.cls_token"].shape[-1]
    patch = sd["visual_encoder.patch_embed.proj.weight"].shape[-1]
    grid = int(round((sd["visual_encoder.pos_embed"].shape[1] - 1) ** 0.5))
    vision = BlipVisionConfig(
        hidden_size=width, intermediate_size=sd["visual_encoder.blocks.0.mlp.fc1.weight"].shape[0],
        num_hidden_layers=_count(sd, r"visual_encoder\.blocks\.(\d+)\."), num_attention_heads=max(1, width // HEAD_DIM),
        image_size=grid * patch, patch_size=patch, layer_norm_eps=1e-6,  # BLIP/vit.py: partial(nn.LayerNorm, eps=1e-6)
    )
    vocab, hidden = sd["text_encoder.embeddings.word_embeddings.weight"].shape
    text = BlipTextConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=sd["text_encoder.encoder.layer.0.intermediate.dense.weight"].shape[0],
        num_hidden_layers=_count(sd, r"text_encoder\.encoder\.layer\.(\d+)\."), num_attention_heads=max(1, hidden // HEAD_DIM),
        encoder_hidden_size=sd["text_encoder.encoder.layer.0.crossattention.self.key.weight"].shape[1],
        max_position_embeddings=sd["text_encoder.embeddings.position_embeddings.weight"].shape[0],
        pad_token_id=0, bos_token_id=None, sep_token_id=None,
    )
    return vision, text


# BLIP/vit.py names -> BlipVisionModel's (the transformers BLIP conversion's renames)
_BLIP_VISION = [("cls_token", "embeddings.class_embedding"), ("pos_embed", "embeddings.position_embedding"),
                ("patch_embed.proj", "embeddings.patch_embedding"), ("blocks.", "encoder.layers."),
                (".attn.proj.", ".self_attn.projection."), (".attn.qkv.", ".self_attn.qkv."), (".norm1.", ".layer_norm1."),
                (".norm2.", ".layer_norm2.")]


def blip_vision_key(key: str) -> str:
    if key.startswith("norm."):
        return "post_layernorm." + key.removeprefix("norm.")
    for old, new in _BLIP_VISION:
        key = key.replace(old, new)
    return key


class ImageRewardModel(nn.Module):
    def __init__(self, sd: dict[str, torch.Tensor], path: str):
        from transformers import BlipTextModel, BlipVisionModel

        super().__init__()
        sd = {k.removeprefix("blip."): v for k, v in sd.items()}
        try:
            vision_cfg, text_cfg = imagereward_configs(sd)
        except KeyError as e:
            raise RuntimeError(f"imagereward: '{path}' is not an ImageReward checkpoint (no {e.args[0]})") from None
        self.image_size = vision_cfg.image_size
        self.vision = BlipVisionModel(vision_cfg)
        self.text = BlipTextModel(text_cfg, add_pooling_layer=False)
        self.mlp = AestheticMLP(text_cfg.hidden_size)
        part = lambda prefix: {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}  # noqa: E731
        _load_exactly(self.vision, {blip_vision_key(k): v for k, v in part("visual_encoder.").items()}, "imagereward", path)
        _load_exactly(self.text, part("text_encoder."), "imagereward", path)
        _load_exactly(self.mlp, part("mlp."), "imagereward", path)

    def forward(self, pixels: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        image_embeds = self.vision(pixel_values=pixels).last_hidden_state
        image_atts = torch.ones(image_embeds.shape[:-1], dtype=torch.long, device=image_embeds.device)
        text = self.text(input_ids=input_ids, attention_mask=attention_mask, encoder_hidden_states=image_embeds,
                         encoder_attention_mask=image_atts, is_decoder=False)
        features = text.last_hidden_state[:, 0, :].float()
        return ((self.mlp(features) - IMAGEREWARD_MEAN) / IMAGEREWARD_STD).squeeze(-1)


def load_imagereward(path: str, tokenizer_path: str, device: Optional[str], dtype: str):
    """(model, tokenizer), cached per process."""
    from transformers import AutoTokenizer

    if dtype not in _DTYPES:
        raise ValueError(f"imagereward: dtype must be one of {', '.join(_DTYPES)}, got '{dtype}'")
    device = str(torch.device(device or default_device()))
    key = (os.path.realpath(path), os.path.realpath(tokenizer_path), device, dtype)
    with _LOCK:
        if key not in _CACHE:
            model = ImageRewardModel(read_checkpoint(path, "imagereward"), path)
            model.vision.to(_DTYPES[dtype])
            model.text.to(_DTYPES[dtype])  # the MLP stays float32, as the reference's .float() features
            try:
                tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=True)
            except Exception as e:
                raise RuntimeError(f"imagereward: could not load the tokenizer from '{tokenizer_path}': {_first_line(e)}") from e
            _CACHE[key] = (model.to(device).eval().requires_grad_(False), tokenizer)
        return _CACHE[key]


@torch.no_grad()
def imagereward(
    images: torch.Tensor,
    prompts: list,
    metadata: list,
    *,
    path: Optional[str] = None,
    tokenizer_path: Optional[str] = None,
    device: Optional[str] = None,
    dtype: str = "float32",
    batch_size: int = 32,
) -> torch.Tensor:
    """ImageReward's standardized score per image and prompt (about -2..2)."""
    if int(batch_size) < 1:
        raise ValueError(f"imagereward: batch_size must be >= 1, got {batch_size}")
    _check_inputs("imagereward", images, prompts)
    path = resolve_local_path(path, ENV_IMAGEREWARD, "imagereward")
    tokenizer_path = resolve_local_path(tokenizer_path, ENV_IMAGEREWARD_TOKENIZER, "imagereward", key="tokenizer_path")
    model, tokenizer = load_imagereward(path, tokenizer_path, device, dtype)
    dev, dt = next(model.vision.parameters()).device, next(model.vision.parameters()).dtype
    out = []
    for i in range(0, images.shape[0], int(batch_size)):
        tokens = tokenizer([str(p) for p in prompts[i:i + int(batch_size)]], padding="max_length", truncation=True,
                           max_length=IMAGEREWARD_MAX_LENGTH, return_tensors="pt")
        pixels = clip_pixels(images[i:i + int(batch_size)], model.image_size).to(dev, dt)
        out.append(model(pixels, tokens["input_ids"].to(dev), tokens["attention_mask"].to(dev)).cpu())
    return torch.cat(out) if out else torch.zeros(0)


def clear_cache() -> None:
    with _LOCK:
        _CACHE.clear()
