"""Parts the tiny random builders share (tiny_sd3, tiny_flux, tiny_qwen_image, tiny_wan): word-level
tokenizers made offline, a small AutoencoderKL, and saving a built pipeline with its settings.

A word-level tokenizer (tokenizers.WordLevel wrapped as PreTrainedTokenizerFast) avoids the BPE
merge rules or sentencepiece model a hand-made vocab of the real tokenizers would need.
"""

from __future__ import annotations

from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from async_flowgrpo.models.common import write_model_settings

SPECIAL_TOKENS = ["<pad>", "<unk>", "<bos>", "<eos>"]  # ids 0..3


def _word_level(vocab: tuple[str, ...]) -> Tokenizer:
    words = list(dict.fromkeys(SPECIAL_TOKENS + [w.lower() for w in vocab]))
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


def build_tokenizer(vocab: tuple[str, ...], max_length: int) -> PreTrainedTokenizerFast:
    """Word-level stand-in for CLIP's tokenizer: <bos> words <eos>, pad id 0."""
    tok = _word_level(vocab)
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A <eos>", special_tokens=[("<bos>", 2), ("<eos>", 3)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=max_length,
        do_lower_case=True,
    )


def build_t5_tokenizer(vocab: tuple[str, ...], max_length: int) -> PreTrainedTokenizerFast:
    """Word-level stand-in for T5's (and UMT5's) tokenizer: no bos, an eos at the end, pad id 0."""
    tok = _word_level(vocab)
    tok.normalizer = normalizers.Lowercase()
    tok.post_processor = processors.TemplateProcessing(single="$A <eos>", special_tokens=[("<eos>", 3)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>", pad_token="<pad>", model_max_length=max_length
    )


def t5_config(vocab_size: int, hidden: int) -> dict:
    """A one-layer T5 encoder's config (T5Config or UMT5Config keywords) for `build_t5_tokenizer`'s ids."""
    return dict(
        vocab_size=vocab_size,
        d_model=hidden,
        d_kv=hidden // 4,
        d_ff=2 * hidden,
        num_layers=1,
        num_heads=4,
        relative_attention_num_buckets=8,
        feed_forward_proj="gated-gelu",
        pad_token_id=0,
        eos_token_id=3,
        decoder_start_token_id=0,
    )


def tiny_autoencoder_kl(channels: tuple[int, ...], latent_channels: int, resolution: int, **kwargs):
    """A small AutoencoderKL: len(channels) blocks, latents at resolution / 2 ** (len(channels) - 1)."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * len(channels),
        up_block_types=("UpDecoderBlock2D",) * len(channels),
        block_out_channels=channels,
        latent_channels=latent_channels,
        layers_per_block=1,
        norm_num_groups=8,
        sample_size=resolution,
        **kwargs,
    )


def save_tiny(pipe, path: str, family: str, spec, **settings) -> str:
    """save_pretrained plus our settings in async_flowgrpo.json; returns path."""
    pipe.save_pretrained(path)
    write_model_settings(path, family, spec, **settings)
    return path
