"""HPSv2 and ImageReward from local files, on tiny random models of the same architectures.

Neither reference package can build its model here: hpsv2 and image-reward (PyPI) need torchvision
and timm, which this environment does not install (and pin pytest 7.2 / timm 0.6.13 / fairscale).
So each tiny checkpoint is written in the reference's own key layout (open_clip's for HPSv2,
BLIP/vit.py + med.py + the MLP for ImageReward, the names quoted in preference.py) from a tiny
transformers model, and the reward loading that file must score exactly as that model does: the
renaming, the q/k/v split and the projections' transposes are what is checked, and the scoring
recipe (cosine; [CLS] features -> MLP -> standardized) against the model computed by hand here.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from async_flowgrpo.rewards import CombinedReward, RewardError, get_reward
from async_flowgrpo.rewards import preference as pref

VOCAB = ("a", "red", "blue", "green", "circle", "square", "triangle", "photo", "of")
PROMPTS = ["a red circle", "a blue square", "a green triangle"]


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    for env in (pref.ENV_HPSV2, pref.ENV_HPSV2_PROCESSOR, pref.ENV_IMAGEREWARD, pref.ENV_IMAGEREWARD_TOKENIZER):
        monkeypatch.delenv(env, raising=False)
    yield
    pref.clear_cache()
    from async_flowgrpo.rewards import clip_score

    clip_score.clear_cache()


def _images(n=3, size=40, seed=0):
    return torch.randint(0, 256, (n, size, size, 3), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


# -- HPSv2 ------------------------------------------------------------------------------------------
def clip_to_openclip(sd: dict) -> dict:
    """transformers CLIPModel keys -> open_clip's (open_clip/transformer.py, model.py names)."""
    top = {"vision_model.embeddings.class_embedding": "visual.class_embedding",
           "vision_model.embeddings.position_embedding.weight": "visual.positional_embedding",
           "vision_model.embeddings.patch_embedding.weight": "visual.conv1.weight",
           "text_model.embeddings.token_embedding.weight": "token_embedding.weight",
           "text_model.embeddings.position_embedding.weight": "positional_embedding", "logit_scale": "logit_scale"}
    norms = {"vision_model.pre_layrnorm": "visual.ln_pre", "vision_model.post_layernorm": "visual.ln_post",
             "text_model.final_layer_norm": "ln_final"}
    block = {"layer_norm1": "ln_1", "layer_norm2": "ln_2", "self_attn.out_proj": "attn.out_proj", "mlp.fc1": "mlp.c_fc",
             "mlp.fc2": "mlp.c_proj"}
    out = {}
    for key, v in sd.items():
        if key in top:
            out[top[key]] = v
        elif key == "visual_projection.weight":
            out["visual.proj"] = v.t()
        elif key == "text_projection.weight":
            out["text_projection"] = v.t()
        elif ".encoder.layers." in key:
            tower, rest = key.split(".encoder.layers.")
            i, rest = rest.split(".", 1)
            prefix = ("visual." if tower == "vision_model" else "") + f"transformer.resblocks.{i}."
            if rest.startswith("self_attn.") and rest.split(".")[1] in ("q_proj", "k_proj", "v_proj"):
                if rest.startswith("self_attn.q_proj"):
                    kind = rest.rsplit(".", 1)[1]
                    qkv = [sd[f"{tower}.encoder.layers.{i}.self_attn.{p}_proj.{kind}"] for p in "qkv"]
                    out[f"{prefix}attn.in_proj_{kind}"] = torch.cat(qkv)
                continue
            head, leaf = rest.rsplit(".", 1)
            out[f"{prefix}{block[head]}.{leaf}"] = v
        elif key.rsplit(".", 1)[0] in norms:
            head, leaf = key.rsplit(".", 1)
            out[f"{norms[head]}.{leaf}"] = v
        elif not key.endswith("position_ids"):
            raise KeyError(key)
    return out


@pytest.fixture(scope="module")
def hps_files(tmp_path_factory):
    """(HPS-style .pt, the processor directory, the CLIPModel it came from)."""
    from test_model_rewards import _word_tokenizer
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel

    tok = _word_tokenizer(VOCAB, max_length=12)
    common = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, hidden_act="gelu")
    cfg = CLIPConfig(text_config=dict(vocab_size=len(tok), max_position_embeddings=12, pad_token_id=0, bos_token_id=2,
                                      eos_token_id=3, **common),
                     vision_config=dict(image_size=28, patch_size=14, **common), projection_dim=16)
    torch.manual_seed(0)
    model = CLIPModel(cfg).eval()
    for p in model.parameters():  # not the init's zeros / ones: every weight must land where it belongs
        p.data.normal_(0, 0.2)
    root = tmp_path_factory.mktemp("hps")
    processor = root / "clip_vit_h14"
    cfg.save_pretrained(processor)  # config, tokenizer and processor: no weights, as the checkpoint brings them
    tok.save_pretrained(processor)
    CLIPImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}).save_pretrained(processor)
    ckpt = root / "HPS_v2.1_compressed.pt"
    torch.save({"state_dict": clip_to_openclip(model.state_dict())}, ckpt)
    return str(ckpt), str(processor), model


def test_hpsv2_scores_the_open_clip_checkpoint_as_the_model_it_holds(hps_files):
    from transformers import AutoTokenizer

    ckpt, processor, model = hps_files
    images = _images()
    scores = get_reward("hpsv2", path=ckpt, processor_path=processor)(images, PROMPTS, [{}] * 3)
    # by hand: HPS's score, the diagonal of normalized image features @ normalized text features
    enc = pref.load_clip_encoder(ckpt, processor, "cpu", "float32", "torch", "hpsv2")  # the cached encoder: its pixels
    pixels = enc.pixel_values(images)
    tokens = AutoTokenizer.from_pretrained(processor)(PROMPTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        img = F.normalize(model.visual_projection(model.vision_model(pixel_values=pixels).pooler_output), dim=-1)
        txt = F.normalize(model.text_projection(model.text_model(**tokens).pooler_output), dim=-1)
    expected = torch.diagonal(img @ txt.T)
    assert torch.allclose(scores, expected, atol=1e-5), (scores, expected)
    assert scores.std() > 1e-3  # different prompts and images: not a constant


def test_hpsv2_errors_are_one_line(hps_files, tmp_path):
    ckpt, processor, _ = hps_files
    cases = [
        (dict(), f"no local path given: set reward.options.hpsv2.path or ${pref.ENV_HPSV2}"),
        (dict(path=str(tmp_path / "nope.pt"), processor_path=processor), "nope.pt' does not exist"),
        (dict(path=ckpt), "set reward.options.hpsv2.processor_path"),
    ]
    bad = tmp_path / "bad.pt"
    torch.save({"state_dict": {"foo.weight": torch.zeros(1)}}, bad)
    cases.append((dict(path=str(bad), processor_path=processor), "is not an open_clip CLIP checkpoint: unexpected open_clip key foo.weight"))
    for options, needle in cases:
        result = CombinedReward({"hpsv2": 1.0}, {"hpsv2": options}).score_groups([(_images(1), PROMPTS[:1], [{}])])[0]
        assert isinstance(result, RewardError) and needle in str(result) and len(str(result).splitlines()) == 1, str(result)


# -- ImageReward ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def imagereward_files(tmp_path_factory):
    """(ImageReward-style .pt, a BERT tokenizer directory, the transformers modules it came from)."""
    from transformers import BertTokenizer, BlipTextModel, BlipVisionModel

    root = tmp_path_factory.mktemp("imagereward")
    (root / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *VOCAB]) + "\n")
    tok_dir = root / "bert-base-uncased"
    BertTokenizer(vocab_file=str(root / "vocab.txt")).save_pretrained(tok_dir)
    # ViT "large" and BERT-base shrunk: 64-channel heads, as preference.py reads the head count
    sd = {"visual_encoder.cls_token": torch.randn(1, 1, 128), "visual_encoder.pos_embed": torch.randn(1, 5, 128),
          "visual_encoder.patch_embed.proj.weight": torch.randn(128, 3, 16, 16), "visual_encoder.blocks.0.mlp.fc1.weight": torch.randn(256, 128),
          "text_encoder.embeddings.word_embeddings.weight": torch.randn(16, 64),
          "text_encoder.encoder.layer.0.intermediate.dense.weight": torch.randn(96, 64),
          "text_encoder.encoder.layer.0.crossattention.self.key.weight": torch.randn(64, 128),
          "text_encoder.embeddings.position_embeddings.weight": torch.randn(40, 64),
          "visual_encoder.blocks.1.norm1.weight": torch.ones(128), "text_encoder.encoder.layer.1.output.dense.weight": torch.ones(1)}
    vision_cfg, text_cfg = pref.imagereward_configs(sd)
    assert (vision_cfg.image_size, vision_cfg.num_hidden_layers, vision_cfg.num_attention_heads) == (32, 2, 2)
    assert (text_cfg.hidden_size, text_cfg.num_hidden_layers, text_cfg.encoder_hidden_size, text_cfg.num_attention_heads) == (64, 2, 128, 1)
    torch.manual_seed(0)
    vision, text, mlp = BlipVisionModel(vision_cfg).eval(), BlipTextModel(text_cfg, add_pooling_layer=False).eval(), pref.AestheticMLP(64).eval()
    for module in (vision, text, mlp):
        for p in module.parameters():
            p.data.normal_(0, 0.2)
    blip_vision = {"embeddings.class_embedding": "cls_token", "embeddings.position_embedding": "pos_embed",
                   "post_layernorm.weight": "norm.weight", "post_layernorm.bias": "norm.bias"}

    def to_blip(key):  # BlipVisionModel -> BLIP/vit.py names
        if key in blip_vision:
            return blip_vision[key]
        return (key.replace("embeddings.patch_embedding", "patch_embed.proj").replace("encoder.layers.", "blocks.")
                .replace("self_attn.projection", "attn.proj").replace("self_attn.qkv", "attn.qkv")
                .replace("layer_norm1", "norm1").replace("layer_norm2", "norm2"))

    ckpt = {f"blip.visual_encoder.{to_blip(k)}": v for k, v in vision.state_dict().items()}
    ckpt.update({f"blip.text_encoder.{k}": v for k, v in text.state_dict().items()})
    ckpt["blip.text_encoder.embeddings.position_ids"] = torch.arange(40).unsqueeze(0)  # med.py's persistent buffer
    ckpt.update({f"mlp.{k}": v for k, v in mlp.state_dict().items()})
    ckpt.update({"blip.vision_proj.weight": torch.zeros(8, 128), "blip.text_proj.weight": torch.zeros(8, 64)})  # unused heads
    path = root / "ImageReward.pt"
    torch.save(ckpt, path)
    return str(path), str(tok_dir), (vision, text, mlp)


def test_imagereward_scores_as_the_reference_recipe(imagereward_files):
    from transformers import AutoTokenizer

    path, tok_dir, (vision, text, mlp) = imagereward_files
    images = _images(3, size=48)
    scores = get_reward("imagereward", path=path, tokenizer_path=tok_dir)(images, PROMPTS, [{}] * 3)
    # by hand, as ImageReward.score: [CLS] of the text encoder attending to the image -> MLP -> standardized
    tokens = AutoTokenizer.from_pretrained(tok_dir)(PROMPTS, padding="max_length", truncation=True, max_length=35, return_tensors="pt")
    assert tokens["input_ids"].shape == (3, 35)
    pixels = pref.clip_pixels(images, 32)
    with torch.no_grad():
        embeds = vision(pixel_values=pixels).last_hidden_state
        hidden = text(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"], encoder_hidden_states=embeds,
                      encoder_attention_mask=torch.ones(embeds.shape[:-1], dtype=torch.long), is_decoder=False).last_hidden_state
        expected = ((mlp(hidden[:, 0].float()) - 0.16717362830052426) / 1.0333394966054072).squeeze(-1)
    assert torch.allclose(scores, expected, atol=1e-5), (scores, expected)
    assert scores.std() > 1e-3


def test_clip_pixels_resize_the_short_side_and_crop_the_centre():
    image = torch.zeros(1, 40, 80, 3, dtype=torch.uint8)
    image[0, :, 30:50] = 255  # a white band at the centre of a wide image
    x = pref.clip_pixels(image, 20)
    assert x.shape == (1, 3, 20, 20)
    white = (1 - np.array(pref.CLIP_MEAN)) / np.array(pref.CLIP_STD)
    assert torch.allclose(x[0, :, 10, 10], torch.tensor(white, dtype=torch.float32), atol=1e-4)  # centre: white
    assert x[0, 0, 10, 0] < 0 and x[0, 0, 10, 19] < 0  # the crop's edges: the black sides (the band is 10 of 20 wide)


def test_imagereward_errors_are_one_line(imagereward_files, tmp_path):
    path, tok_dir, _ = imagereward_files
    bad = tmp_path / "not_imagereward.pt"
    torch.save({"weight": torch.zeros(2)}, bad)
    for options, needle in [
        (dict(tokenizer_path=tok_dir), f"set reward.options.imagereward.path or ${pref.ENV_IMAGEREWARD}"),
        (dict(path=path), f"set reward.options.imagereward.tokenizer_path or ${pref.ENV_IMAGEREWARD_TOKENIZER}"),
        (dict(path=str(bad), tokenizer_path=tok_dir), "is not an ImageReward checkpoint (no visual_encoder.cls_token)"),
    ]:
        result = CombinedReward({"imagereward": 1.0}, {"imagereward": options}).score_groups([(_images(1), PROMPTS[:1], [{}])])[0]
        assert isinstance(result, RewardError) and needle in str(result) and len(str(result).splitlines()) == 1, str(result)
