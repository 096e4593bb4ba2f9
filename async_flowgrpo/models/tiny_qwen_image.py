"""Build a tiny QwenImagePipeline (real Qwen-Image architecture, random weights) offline, for tests.

Parts: QwenImageTransformer2DModel, AutoencoderKLQwenImage (the causal 3-D video VAE, 16 latent
channels, one spatial downsampling), a Qwen2_5_VLForConditionalGeneration text encoder (text
model and a one-block vision tower, both tiny; only the text path runs), a word-level tokenizer and
a FlowMatchEulerDiscreteScheduler with dynamic exponential shifting as Qwen-Image's.

The tokenizer knows the words of the pipeline's prompt template and splits it like Qwen2.5's BPE
does at the template's boundaries (special tokens, words, punctuation and each newline are tokens),
so the template's prefix is 34 tokens, the pipeline's `prompt_template_encode_start_idx`; the
builder checks that and records the count in async_flowgrpo.json, which the adapter applies.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from diffusers import (
    AutoencoderKLQwenImage,
    FlowMatchEulerDiscreteScheduler,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
)
from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from async_flowgrpo.models.tiny import save_tiny

DEFAULT_VOCAB = ("a", "red", "blue", "green", "circle", "square", "triangle")
# Qwen2.5-VL's chat tokens, and the vision tokens its config must point at
QWEN_SPECIAL_TOKENS = [
    "<|endoftext|>",  # pad
    "<unk>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
_PIECES = r"'s|\w+|[^\w\s]+|\n"  # "'s" (a token of its own in Qwen2's BPE too), words, punctuation runs, newlines


@dataclass
class TinyQwenImageSpec:
    vocab: tuple[str, ...] = DEFAULT_VOCAB
    resolution: int = 32  # image side in pixels
    text_hidden: int = 32  # Qwen2.5-VL hidden size = joint_attention_dim
    text_layers: int = 2
    text_heads: int = 2
    text_kv_heads: int = 1  # grouped-query attention, as in Qwen2.5-VL
    max_sequence_length: int = 16  # text tokens after the template prefix (embeddings are padded to it)
    vae_base_dim: int = 8
    vae_dim_mult: tuple[int, ...] = (1, 2)  # len 2 -> latents at resolution / 2
    latent_channels: int = 16  # z_dim; the transformer sees 4 x 16 = 64 packed channels
    layers: int = 2
    heads: int = 2
    head_dim: int = 16
    axes_dims_rope: tuple[int, int, int] = (4, 6, 6)  # sums to head_dim
    vision_patch_size: int = 14  # the vision tower's patch side (Qwen2.5-VL's); it runs only in the edit pipelines
    seed: int = 0


def build_qwen_tokenizer(vocab: tuple[str, ...], template: str) -> PreTrainedTokenizerFast:
    text = template.replace("{}", " ")
    for special in QWEN_SPECIAL_TOKENS:  # split off first by the tokenizer, as added tokens
        text = text.replace(special, " ")
    template_words = re.findall(_PIECES, text.lower())
    words = list(dict.fromkeys(QWEN_SPECIAL_TOKENS + template_words + [w.lower() for w in vocab]))
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(_PIECES), behavior="removed", invert=True)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
        additional_special_tokens=QWEN_SPECIAL_TOKENS[2:],
        model_max_length=2048,
    )


def _text_encoder(spec: TinyQwenImageSpec, tokenizer) -> Qwen2_5_VLForConditionalGeneration:
    ids = tokenizer.convert_tokens_to_ids
    head_dim = spec.text_hidden // spec.text_heads
    quarter = head_dim // 2 // 4
    cfg = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer),
            hidden_size=spec.text_hidden,
            intermediate_size=2 * spec.text_hidden,
            num_hidden_layers=spec.text_layers,
            num_attention_heads=spec.text_heads,
            num_key_value_heads=spec.text_kv_heads,
            max_position_embeddings=256,
            # multimodal RoPE sections (temporal, height, width) over head_dim / 2 frequencies
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 1000000.0,
                "mrope_section": [head_dim // 2 - 2 * quarter, quarter, quarter],
            },
            pad_token_id=ids("<|endoftext|>"),
            bos_token_id=ids("<|endoftext|>"),
            eos_token_id=ids("<|im_end|>"),
        ),
        vision_config=dict(
            depth=1,
            hidden_size=16,
            intermediate_size=32,
            num_heads=2,
            out_hidden_size=spec.text_hidden,
            patch_size=spec.vision_patch_size,
            fullatt_block_indexes=[0],
        ),
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
    )
    return Qwen2_5_VLForConditionalGeneration(cfg)


def build_tiny_qwen_image(spec: TinyQwenImageSpec, pipeline_class=QwenImagePipeline, **components) -> QwenImagePipeline:
    """`pipeline_class` and `components`: a pipeline over the same parts with more of them (the edit pipelines' processor)."""
    torch.manual_seed(spec.seed)
    transformer = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=4 * spec.latent_channels,
        out_channels=spec.latent_channels,
        num_layers=spec.layers,
        attention_head_dim=spec.head_dim,
        num_attention_heads=spec.heads,
        joint_attention_dim=spec.text_hidden,
        axes_dims_rope=spec.axes_dims_rope,
    )
    vae = AutoencoderKLQwenImage(
        base_dim=spec.vae_base_dim,
        z_dim=spec.latent_channels,
        dim_mult=list(spec.vae_dim_mult),
        num_res_blocks=1,
        temperal_downsample=[False] * (len(spec.vae_dim_mult) - 1),
    )
    scheduler = FlowMatchEulerDiscreteScheduler(  # Qwen-Image's scheduler settings
        shift=1.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=0.9,
        base_image_seq_len=256,
        max_image_seq_len=8192,
        shift_terminal=0.02,
        time_shift_type="exponential",
    )
    pipe = pipeline_class(scheduler=scheduler, vae=vae, text_encoder=None, tokenizer=None, transformer=transformer,
                          **components)
    # the prompt template is the pipeline's own (an instance attribute set in __init__)
    tokenizer = build_qwen_tokenizer(spec.vocab, pipe.prompt_template_encode)
    pipe.register_modules(text_encoder=_text_encoder(spec, tokenizer), tokenizer=tokenizer)
    return pipe


def template_prefix_length(pipe: QwenImagePipeline) -> int:
    """Tokens of the prompt template before the prompt and its image (what the pipeline drops)."""
    prefix = pipe.prompt_template_encode.split("{}")[0].split("<|vision_start|>")[0]
    return len(pipe.tokenizer(prefix).input_ids)


def make_tiny_qwen_image_dir(path: str, **spec_kw) -> str:
    """Build, save and return a tiny random Qwen-Image model directory (for tests; a few seconds)."""
    spec = TinyQwenImageSpec(**spec_kw)
    pipe = build_tiny_qwen_image(spec)
    drop = template_prefix_length(pipe)
    if drop != pipe.prompt_template_encode_start_idx:
        raise RuntimeError(
            f"tiny tokenizer splits the template prefix into {drop} tokens, the pipeline drops "
            f"{pipe.prompt_template_encode_start_idx}"
        )
    return save_tiny(pipe, path, "qwen_image", spec, resolution=spec.resolution,
                     max_sequence_length=spec.max_sequence_length, prompt_template_encode_start_idx=drop)
