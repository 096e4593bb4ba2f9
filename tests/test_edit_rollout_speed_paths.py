"""The image-conditioned families' denoising steps call the transformer as their diffusers pipelines
do, on tiny random twins: what made the rollout slower than the pipeline at equal FLOPs on an H200.

- Qwen-Image and Qwen-Image-Edit: no attention mask when every text token of a call is valid. A CFG
  batch joins a negative prompt shorter than the prompt; masked as one batch, every row's attention
  left SDPA's fastest kernels (the pipeline calls its halves apart, each unmasked). The rows now run
  in runs of one text length, each trimmed and unmasked, and compute what the masked batch computed;
  a batch of many text lengths keeps one masked call.
- FLUX.1 Kontext: the position ids are built once, not every step (each build copied host tensors
  to the device, a stream synchronisation per step on a GPU)."""

import pytest
import torch

from async_flowgrpo.conditioning import SOURCE_IMAGES
from async_flowgrpo.models.common import pack_latents
from async_flowgrpo.policy import DiffusionPolicy

torch.set_num_threads(1)
VOCAB = ("make", "the", "red", "blue", "square", "remove", "circle", "a")
PROMPTS = ["make the red square blue", "remove the square"]  # two text lengths, the negative shorter still
KW = dict(num_steps=3, guidance_scale=4.0, noise_level=0.7, sde_type="sde", window_size=2, seed=3)


def _image(color, size=32):
    img = torch.full((size, size, 3), 255, dtype=torch.uint8)
    img[8:16, 8:16] = torch.tensor(color, dtype=torch.uint8)
    return img


SOURCES = [{SOURCE_IMAGES: [_image((220, 30, 30))]}, {SOURCE_IMAGES: [_image((35, 70, 225))]}]


def _recording(monkeypatch, module, keys):
    """Each call of module.forward's keyword arguments `keys`, in order."""
    calls, forward = [], module.forward

    def wrapper(*args, **kwargs):
        calls.append({k: kwargs.get(k) for k in keys})
        return forward(*args, **kwargs)

    monkeypatch.setattr(module, "forward", wrapper)
    return calls


@pytest.fixture(scope="module")
def qwen_edit(tmp_path_factory):
    from async_flowgrpo.models.tiny_qwen_image_edit import make_tiny_qwen_image_edit_dir

    path = make_tiny_qwen_image_edit_dir(str(tmp_path_factory.mktemp("edit")), vocab=VOCAB)
    policy = DiffusionPolicy(path, lora_rank=4, lora_alpha=8)
    with torch.no_grad():  # the adapters off zero, so that they count
        for p in policy.trainable_parameters():
            p.normal_(0, 0.05)
    return policy


def _masked_batch(adapter, x, t, embeds, pooled, shape):
    """The previous call: the whole batch in one transformer call, its text trimmed to the longest row
    and the shorter rows masked."""
    length, (h, w) = adapter.max_sequence_length, shape[-2:]
    image_h, image_w = (int(v) for v in pooled[0, length:length + 2].tolist())
    tokens = pooled[:, length + 2:].reshape(x.shape[0], -1, x.shape[-1]).to(adapter.dtype)
    count = tokens.shape[1] // ((image_h // 2) * (image_w // 2))
    text, mask = adapter._text(embeds, pooled[:, :length])
    assert mask is not None  # the batch does mix text lengths
    shapes = [[(1, h // 2, w // 2)] + [(1, image_h // 2, image_w // 2)] * count] * x.shape[0]
    out = adapter.transformer(hidden_states=torch.cat([x, tokens], 1), timestep=t, encoder_hidden_states=text,
                              encoder_hidden_states_mask=mask, img_shapes=shapes, return_dict=False)[0]
    return out[:, : x.shape[1]]


def test_qwen_image_edit_rollout_passes_the_transformer_no_mask(qwen_edit, monkeypatch):
    calls = _recording(monkeypatch, qwen_edit.adapter.transformer, ("encoder_hidden_states_mask", "hidden_states"))
    groups = qwen_edit.generate(PROMPTS, 2, metadata=SOURCES, **KW)
    assert len(groups) == 2 and calls
    assert all(c["encoder_hidden_states_mask"] is None for c in calls)
    # per step: the negatives (one length), then each instruction's rows: 3 calls, 8 rows in all
    assert len(calls) == 3 * KW["num_steps"]
    assert sum(c["hidden_states"].shape[0] for c in calls) == 8 * KW["num_steps"]


def test_qwen_image_edit_runs_compute_what_the_masked_batch_computed(qwen_edit):
    adapter = qwen_edit.adapter
    enc = qwen_edit._encode(PROMPTS, SOURCES, cfg=True)
    # the CFG batch as guided_velocity makes it: negatives then instructions, two rows per prompt
    embeds = torch.cat([enc.negative_embeds, enc.embeds]).repeat_interleave(2, 0)
    pooled = torch.cat([enc.negative_pooled, enc.pooled]).repeat_interleave(2, 0)
    shape = (8, *adapter.latent_shape(32, 32))
    gen = torch.Generator().manual_seed(0)
    x = pack_latents(torch.randn(shape, generator=gen))
    t = torch.rand(8, generator=gen)
    with torch.no_grad():
        runs = adapter._forward(adapter.transformer, x, t, embeds, pooled, shape=torch.Size(shape), guidance_scale=4.0)
        masked = _masked_batch(adapter, x, t, embeds, pooled, shape)
    assert runs.shape == masked.shape == x.shape
    torch.testing.assert_close(runs, masked, atol=2e-6, rtol=1e-5)


def test_qwen_image_edit_a_batch_with_a_hole_in_a_mask_keeps_one_masked_call(qwen_edit, monkeypatch):
    adapter = qwen_edit.adapter
    enc = qwen_edit._encode(PROMPTS[:1], SOURCES[:1], cfg=False)
    pooled = enc.pooled.repeat(2, 1)
    pooled[1, 3] = 0.0  # a hole (no encoder makes one): the batch keeps one masked call
    shape = (2, *adapter.latent_shape(32, 32))
    x = pack_latents(torch.randn(shape, generator=torch.Generator().manual_seed(1)))
    calls = _recording(monkeypatch, adapter.transformer, ("encoder_hidden_states_mask",))
    with torch.no_grad():
        adapter._forward(adapter.transformer, x, torch.full((2,), 0.5), enc.embeds.repeat(2, 1, 1), pooled,
                         shape=torch.Size(shape), guidance_scale=1.0)
    masks = [c["encoder_hidden_states_mask"] for c in calls]
    assert len(masks) == 1 and masks[0] is not None and not bool(masks[0][1, 3]) and bool(masks[0][0, 3])


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    from async_flowgrpo.models.tiny_qwen_image import make_tiny_qwen_image_dir

    return DiffusionPolicy(make_tiny_qwen_image_dir(str(tmp_path_factory.mktemp("qwen")), vocab=VOCAB), lora_rank=4,
                           lora_alpha=8)


def test_qwen_image_calls_each_cfg_half_unmasked_as_the_masked_batch_computed(qwen, monkeypatch):
    adapter = qwen.adapter
    enc = qwen._encode(PROMPTS, [{}, {}], cfg=True)
    embeds = torch.cat([enc.negative_embeds, enc.embeds]).repeat_interleave(2, 0)
    mask = torch.cat([enc.negative_pooled, enc.pooled]).repeat_interleave(2, 0)
    shape = (8, *adapter.latent_shape(32, 32))
    gen = torch.Generator().manual_seed(0)
    x, t = pack_latents(torch.randn(shape, generator=gen)), torch.rand(8, generator=gen)
    calls = _recording(monkeypatch, adapter.transformer, ("encoder_hidden_states_mask", "hidden_states"))
    with torch.no_grad():
        runs = adapter._forward(adapter.transformer, x, t, embeds, mask, shape=torch.Size(shape), guidance_scale=4.0)
        text, text_mask = adapter._text(embeds, mask)
        masked = adapter.transformer.forward(hidden_states=x, timestep=t, encoder_hidden_states=text,
                                             encoder_hidden_states_mask=text_mask, return_dict=False,
                                             img_shapes=[[(1, shape[-2] // 2, shape[-1] // 2)]] * 8)[0]
    assert text_mask is not None and [c["encoder_hidden_states_mask"] for c in calls[:3]] == [None] * 3
    assert [c["hidden_states"].shape[0] for c in calls[:3]] == [4, 2, 2]  # the negatives, then each prompt's rows
    torch.testing.assert_close(runs, masked, atol=2e-6, rtol=1e-5)


def test_qwen_image_a_batch_of_many_text_lengths_keeps_one_masked_call(qwen, monkeypatch):
    adapter = qwen.adapter
    enc = qwen._encode(PROMPTS[:1], [{}], cfg=False)
    n = adapter.MAX_TEXT_CALLS + 1
    mask = enc.pooled.repeat(n, 1)
    length = int(mask[0].sum())
    for row in range(1, n):  # shorter texts, as prompts of other lengths would be (no holes)
        mask[row, length - row:] = 0.0
    shape = (n, *adapter.latent_shape(32, 32))
    x = pack_latents(torch.randn(shape, generator=torch.Generator().manual_seed(2)))
    calls = _recording(monkeypatch, adapter.transformer, ("encoder_hidden_states_mask",))
    with torch.no_grad():
        adapter._forward(adapter.transformer, x, torch.full((n,), 0.5), enc.embeds.repeat(n, 1, 1), mask,
                         shape=torch.Size(shape), guidance_scale=1.0)
    assert len(calls) == 1 and calls[0]["encoder_hidden_states_mask"] is not None


@pytest.fixture(scope="module")
def kontext(tmp_path_factory):
    from async_flowgrpo.models.tiny_kontext import make_tiny_kontext_dir

    return DiffusionPolicy(make_tiny_kontext_dir(str(tmp_path_factory.mktemp("kontext")), vocab=VOCAB), lora_rank=4,
                           lora_alpha=8)


def test_flux_kontext_builds_its_position_ids_once(kontext, monkeypatch):
    pipe = kontext.adapter.pipeline
    built, prepare = [], pipe._prepare_latent_image_ids

    def counting(*args, **kwargs):
        built.append(args)
        return prepare(*args, **kwargs)

    monkeypatch.setattr(pipe, "_prepare_latent_image_ids", counting)
    calls = _recording(monkeypatch, kontext.adapter.transformer, ("img_ids", "txt_ids"))
    first = kontext.generate(PROMPTS, 2, metadata=SOURCES, **KW)
    again = kontext.generate(PROMPTS, 2, metadata=SOURCES, **KW)
    assert len(calls) == 2 * KW["num_steps"]  # (true CFG, both halves in one call: the twin has no guidance embedding)
    assert len(built) <= 1  # not once per step
    # the ids the pipeline builds: the output's (0, row, col), then the source image's (1, row, col)
    h = w = kontext.adapter.latent_shape(32, 32)[-1] // 2
    ids = prepare(None, h, w, kontext.device, kontext.dtype)
    image_ids = ids.clone()
    image_ids[..., 0] = 1
    for c in calls:
        assert torch.equal(c["img_ids"], torch.cat([ids, image_ids]))
        assert not c["txt_ids"].any() and c["txt_ids"].shape[-1] == 3
    for a, b in zip(first, again):  # the same seed, the same samples
        assert torch.equal(a.latents, b.latents) and torch.equal(a.log_probs, b.log_probs)
