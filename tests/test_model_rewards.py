"""Model-based and HTTP rewards: tiny random CLIP / aesthetic MLP saved locally, a local test server."""

from __future__ import annotations

import functools
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch

from async_flowgrpo import rewards
from async_flowgrpo.rewards import CombinedReward, RewardError, get_reward, register_reward
from async_flowgrpo.rewards import aesthetic as aesthetic_mod
from async_flowgrpo.rewards import clip_score as clip_mod
from async_flowgrpo.rewards import remote as remote_mod

VOCAB = ("a", "red", "blue", "green", "circle", "square", "triangle", "photo", "of")
PROMPTS = ["a red circle", "a blue square", "a green triangle", "a photo of a red square"]


# ------------------------------------------------------------------------------------------------
# fixtures
# ------------------------------------------------------------------------------------------------
def _word_tokenizer(vocab, max_length):
    """As models/tiny_sd3.build_tokenizer (a WordLevel tokenizer), without importing diffusers."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<unk>", "<bos>", "<eos>", *vocab]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A <eos>", special_tokens=[("<bos>", 2), ("<eos>", 3)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>", pad_token="<pad>",
        model_max_length=max_length,
    )


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    """A tiny random CLIPModel + word-level tokenizer + CLIPImageProcessor, saved like a real one."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel

    tok = _word_tokenizer(VOCAB, max_length=12)
    common = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    cfg = CLIPConfig(
        text_config=dict(
            vocab_size=len(tok), max_position_embeddings=12, pad_token_id=0, bos_token_id=2, eos_token_id=3, **common
        ),
        vision_config=dict(image_size=24, patch_size=8, **common),
        projection_dim=16,
    )
    torch.manual_seed(0)
    model = CLIPModel(cfg).eval()
    path = tmp_path_factory.mktemp("tiny_clip")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    CLIPImageProcessor(size={"shortest_edge": 24}, crop_size={"height": 24, "width": 24}).save_pretrained(path)
    yield str(path)
    aesthetic_mod.clear_cache()


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    for env in (
        clip_mod.ENV_CLIP,
        clip_mod.ENV_PICKSCORE,
        aesthetic_mod.ENV_PREDICTOR,
        aesthetic_mod.ENV_CLIP,
        remote_mod.ENV_REMOTE,
        remote_mod.ENV_OCR,
        remote_mod.ENV_GENEVAL,
        remote_mod.ENV_REMOTE_VIDEO,
    ):
        monkeypatch.delenv(env, raising=False)


def _images(n: int = 4, size: int = 32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, size, size, 3), generator=g, dtype=torch.uint8)


# ------------------------------------------------------------------------------------------------
# CLIP score / PickScore
# ------------------------------------------------------------------------------------------------
def test_clip_and_pickscore(clip_dir):
    images = _images()
    meta = [{}] * 4
    s1 = clip_mod.clip_score(images, PROMPTS, meta, path=clip_dir, device="cpu")
    s2 = clip_mod.clip_score(images, PROMPTS, meta, path=clip_dir, device="cpu", batch_size=3)
    assert s1.shape == (4,) and s1.dtype == torch.float32 and torch.isfinite(s1).all()
    assert torch.allclose(s1, s2, atol=1e-5)  # deterministic, independent of batching
    assert s1.abs().max() <= 1.0 + 1e-5  # a cosine

    other = clip_mod.clip_score(images, PROMPTS[::-1], meta, path=clip_dir, device="cpu")
    assert not torch.allclose(s1, other)  # the prompt matters
    same_img = images[:1].expand(4, -1, -1, -1)
    per_prompt = clip_mod.clip_score(same_img, PROMPTS, meta, path=clip_dir, device="cpu")
    assert len(set(per_prompt.tolist())) == 4

    enc = clip_mod.load_clip_encoder(clip_dir, device="cpu")
    assert clip_mod.load_clip_encoder(clip_dir, device="cpu") is enc  # cached per process
    pick = clip_mod.pickscore(images, PROMPTS, meta, path=clip_dir, device="cpu")
    assert torch.allclose(pick, enc.logit_scale * s1, atol=1e-4)
    assert clip_mod.pickscore(images[:0], [], [], path=clip_dir, device="cpu").shape == (0,)


def test_torch_preprocessing_matches_processor(clip_dir):
    images = _images(3)
    proc = clip_mod.load_clip_encoder(clip_dir, device="cpu", preprocess="processor")
    tch = clip_mod.load_clip_encoder(clip_dir, device="cpu", preprocess="torch")
    a, b = proc.pixel_values(images), tch.pixel_values(images)
    assert a.shape == b.shape == (3, 3, 24, 24)
    assert (a - b).abs().mean() < 0.05  # PIL bicubic vs torch bicubic+antialias
    s_a = clip_mod.clip_score(images, PROMPTS[:3], [{}] * 3, path=clip_dir, device="cpu")
    s_b = clip_mod.clip_score(images, PROMPTS[:3], [{}] * 3, path=clip_dir, device="cpu", preprocess="torch")
    assert torch.allclose(s_a, s_b, atol=0.05)


def test_env_var_path_through_combined_reward(clip_dir, monkeypatch):
    monkeypatch.setenv(clip_mod.ENV_PICKSCORE, clip_dir)
    monkeypatch.setenv(clip_mod.ENV_CLIP, clip_dir)
    combined = CombinedReward({"pickscore": 0.5, "clip_score": 2.0})
    images = _images()
    total, comps = combined(images, PROMPTS, [{}] * 4)
    assert set(comps) == {"pickscore", "clip_score"}
    assert torch.allclose(total, 0.5 * comps["pickscore"] + 2.0 * comps["clip_score"])


def test_options_bound_with_partial(clip_dir, monkeypatch):
    """What `reward.options` will do: bind keyword options to the registered function."""
    monkeypatch.setitem(rewards._REGISTRY, "pick_opts", functools.partial(get_reward("pickscore"), path=clip_dir, mode="cosine"))
    total, comps = CombinedReward({"pick_opts": 1.0})(_images(), PROMPTS, [{}] * 4)
    assert comps["pick_opts"].abs().max() <= 1.0 + 1e-5


def test_missing_paths_are_one_line_errors(clip_dir, tmp_path, monkeypatch):
    images = _images(2)
    with pytest.raises(FileNotFoundError, match=r"reward.options.pickscore.path or \$ASYNC_FLOWGRPO_PICKSCORE_PATH"):
        clip_mod.pickscore(images, PROMPTS[:2], [{}] * 2)
    with pytest.raises(FileNotFoundError, match="does not exist") as e:
        clip_mod.clip_score(images, PROMPTS[:2], [{}] * 2, path=str(tmp_path / "nope"))
    assert "\n" not in str(e.value) and "nope" in str(e.value)
    with pytest.raises(RuntimeError, match="could not load a CLIPModel") as e:
        clip_mod.clip_score(images, PROMPTS[:2], [{}] * 2, path=str(tmp_path), device="cpu")
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="mode"):
        clip_mod.clip_score(images, PROMPTS[:2], [{}] * 2, path=clip_dir, mode="nope")

    monkeypatch.setenv(clip_mod.ENV_PICKSCORE, str(tmp_path / "missing"))
    with pytest.raises(RewardError, match="reward 'pickscore' failed: FileNotFoundError") as e:
        CombinedReward({"jpeg_compressibility": 1.0, "pickscore": 1.0})(images, PROMPTS[:2], [{}] * 2)
    assert e.value.name == "pickscore"


# ------------------------------------------------------------------------------------------------
# aesthetic predictor
# ------------------------------------------------------------------------------------------------
def test_aesthetic_layout_matches_public_predictor():
    keys = set(aesthetic_mod.AestheticMLP(768).state_dict())
    assert keys == {f"layers.{i}.{p}" for i in (0, 2, 4, 6, 7) for p in ("weight", "bias")}
    assert [m.out_features for m in aesthetic_mod.AestheticMLP(768).layers if hasattr(m, "out_features")] == [1024, 128, 64, 16, 1]


def test_aesthetic(clip_dir, tmp_path, monkeypatch):
    torch.manual_seed(1)
    mlp = aesthetic_mod.AestheticMLP(16).eval()
    pth = tmp_path / "aesthetic.pth"
    torch.save(mlp.state_dict(), pth)
    images = _images()
    s = aesthetic_mod.aesthetic(images, PROMPTS, [{}] * 4, path=str(pth), clip_path=clip_dir, device="cpu")
    assert s.shape == (4,) and torch.isfinite(s).all()
    assert torch.equal(s, aesthetic_mod.aesthetic(images, PROMPTS[::-1], [{}] * 4, path=str(pth), clip_path=clip_dir, device="cpu"))
    with torch.no_grad():
        emb = clip_mod.load_clip_encoder(clip_dir, device="cpu").embed_images(images)
        assert torch.allclose(s, mlp(emb).squeeze(-1), atol=1e-5)

    bad = tmp_path / "bad.pth"
    torch.save(aesthetic_mod.AestheticMLP(8).state_dict(), bad)
    with pytest.raises(ValueError, match="takes 8-d embeddings"):
        aesthetic_mod.aesthetic(images, PROMPTS, [{}] * 4, path=str(bad), clip_path=clip_dir, device="cpu")
    with pytest.raises(FileNotFoundError, match="ASYNC_FLOWGRPO_AESTHETIC_CLIP_PATH"):
        aesthetic_mod.aesthetic(images, PROMPTS, [{}] * 4, path=str(pth))

    monkeypatch.setenv(aesthetic_mod.ENV_PREDICTOR, str(pth))
    monkeypatch.setenv(aesthetic_mod.ENV_CLIP, clip_dir)
    total, comps = CombinedReward({"aesthetic": 1.0})(images, PROMPTS, [{}] * 4)
    assert torch.allclose(total, s.to(total.device), atol=1e-5)


# ------------------------------------------------------------------------------------------------
# remote (HTTP) rewards
# ------------------------------------------------------------------------------------------------
class _Server:
    """A local reward server; `script` is a list of behaviours, one per request (the last repeats)."""

    def __init__(self):
        self.script: list[str] = ["ok"]
        self.requests: list[dict] = []
        self.release = threading.Event()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append(body)
                action = server.script[min(len(server.requests), len(server.script)) - 1]
                # a video is the list of its frames; it gets one score, the mean over its frames
                samples = body["images"] if "images" in body else body["videos"]
                n = len(samples)
                if action == "sleep":
                    server.release.wait(5.0)
                    return
                if action == "500":
                    self.send_error(500, "boom")
                    return
                if action == "404":
                    self.send_error(404, "no such reward")
                    return
                if action == "ok":
                    scores = [float(np.mean([decode(f) for f in s] if isinstance(s, list) else decode(s))) / 255.0
                              for s in samples]
                    payload = json.dumps({"scores": scores, "accuracy": [1] * n, "text": ["x"] * n}).encode()
                elif action == "not_json":
                    payload = b"<html>oops</html>"
                elif action == "no_scores":
                    payload = json.dumps({"score": [0.0] * n}).encode()
                elif action == "short":
                    payload = json.dumps({"scores": [0.0] * (n - 1)}).encode()
                elif action == "per_frame":  # a server that scores frames, not videos
                    payload = json.dumps({"scores": [0.0] * sum(map(len, samples))}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        decode = remote_mod.decode_png
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/score"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def close(self):
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    s = _Server()
    yield s
    s.close()


FAST = dict(timeout_s=2.0, retries=2, backoff_s=0.01)


def test_remote_success(server):
    images = _images(3)
    meta = [{"tag": i, "obj": object()} for i in range(3)]  # non-JSON values are sent as strings
    out = remote_mod.remote(images, PROMPTS[:3], meta, url=server.url, **FAST)
    assert set(out) == {"score", "remote/accuracy"}  # non-numeric lists are ignored
    expected = images.float().mean(dim=(1, 2, 3)) / 255.0
    assert torch.allclose(out["score"], expected, atol=1e-6)  # images arrive losslessly
    body = server.requests[0]
    assert body["prompts"] == PROMPTS[:3] and body["metadata"][1]["tag"] == 1
    assert np.array_equal(remote_mod.decode_png(body["images"][2]), images[2].numpy())


def test_remote_retries_500_then_succeeds(server):
    server.script = ["500", "500", "ok"]
    out = remote_mod.remote(_images(2), PROMPTS[:2], [{}] * 2, url=server.url, **FAST)
    assert out["score"].shape == (2,) and len(server.requests) == 3


def test_remote_timeout_fails_after_retries_in_bounded_time(server):
    server.script = ["sleep"]
    t0 = time.monotonic()
    with pytest.raises(remote_mod.RemoteRewardError, match="timed out") as e:
        remote_mod.remote(_images(2), PROMPTS[:2], [{}] * 2, url=server.url, timeout_s=0.3, retries=1, backoff_s=0.05)
    assert time.monotonic() - t0 < 3.0
    assert server.url in str(e.value) and "2 attempt(s)" in str(e.value)
    assert len(server.requests) == 2


def test_remote_client_error_is_not_retried(server):
    server.script = ["404"]
    with pytest.raises(remote_mod.RemoteRewardError, match="HTTP 404") as e:
        remote_mod.remote(_images(2), PROMPTS[:2], [{}] * 2, url=server.url, **FAST)
    assert server.url in str(e.value) and len(server.requests) == 1


@pytest.mark.parametrize(
    "action,message", [("not_json", "not JSON"), ("no_scores", "no 'scores'"), ("short", "'scores' has 1 values for 2")]
)
def test_remote_malformed_response(server, action, message):
    server.script = [action]
    with pytest.raises(remote_mod.RemoteRewardError, match=message) as e:
        remote_mod.remote(_images(2), PROMPTS[:2], [{}] * 2, url=server.url, **FAST)
    assert server.url in str(e.value) and len(server.requests) == 1


def test_remote_unreachable_and_missing_url():
    s = _Server()
    url = s.url
    s.close()  # nothing listens on the port any more
    with pytest.raises(remote_mod.RemoteRewardError, match="failed after 2 attempt") as e:
        remote_mod.remote(_images(1), PROMPTS[:1], [{}], url=url, timeout_s=1.0, retries=1, backoff_s=0.01)
    assert url in str(e.value)
    with pytest.raises(remote_mod.RemoteRewardError, match=r"reward.options.ocr.url or \$ASYNC_FLOWGRPO_OCR_URL"):
        remote_mod.ocr(_images(1), PROMPTS[:1], [{}])


@pytest.mark.parametrize("reward", ["remote", "ocr", "geneval", "remote_video"])
def test_a_remote_rewards_unusable_request_settings_are_config_errors(reward):
    """A URL without a scheme, or numbers no request can use, stop the launcher with one line (exit 2)
    instead of failing every group on the rollout actors until reward.max_consecutive_failures."""
    from async_flowgrpo.config import ConfigError, load_config

    family = ["model.family=wan"] if reward == "remote_video" else []  # a video reward needs a video model
    base = [f"reward.weights={{{reward}: 1.0}}", *family]
    for option, message in [("url=localhost:8000/score", "url must start with http:// or https://, got 'localhost:8000/score'"),
                            ("timeout_s=0", "timeout_s > 0"), ("retries=-1", "retries >= 0"),
                            ("max_concurrency=0", "max_concurrency >= 1")]:
        with pytest.raises(ConfigError, match=f"reward.options.{reward}: .*{message}"):
            load_config("sync", [*base, f"reward.options.{reward}.{option}"])
    load_config("sync", [*base, f"reward.options.{reward}.url=http://127.0.0.1:1/score"])  # usable: no error


class _KeepAliveServer:
    """An HTTP/1.1 reward server that keeps connections open; records the connections it saw, the
    most requests it held at once, and answers 429 (Retry-After 0) to each connection's first request
    when `throttle`. A request is held until `gather` requests are in (at most `hold_s`)."""

    def __init__(self, hold_s: float = 0.0, throttle: bool = False, gather: int = 1):
        self.ports: list[int] = []
        self.in_flight = self.most_in_flight = 0
        self.gathered = False
        self.lock = threading.Condition()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    first = self.client_address[1] not in server.ports
                    server.ports.append(self.client_address[1])
                    server.in_flight += 1
                    server.most_in_flight = max(server.most_in_flight, server.in_flight)
                    server.gathered |= server.in_flight >= gather  # released together: not one by one
                    server.lock.notify_all()
                    server.lock.wait_for(lambda: server.gathered, timeout=hold_s)
                    server.in_flight -= 1
                if throttle and first:
                    payload, code = b"slow down", 429
                else:
                    payload, code = json.dumps({"scores": [0.5] * len(body["images"])}).encode(), 200
                self.send_response(code)
                if code == 429:
                    self.send_header("Retry-After", "0")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/score"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def _score_from_threads(url: str, threads: int, calls: int = 1, **options) -> list:
    results = []

    def score():
        for _ in range(calls):
            results.append(remote_mod.remote(_images(2), PROMPTS[:2], [{}] * 2, url=url, **{**FAST, **options}))

    workers = [threading.Thread(target=score) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(10)
    return results


def test_remote_sends_several_requests_at_once_up_to_its_concurrency_limit():
    s = _KeepAliveServer(hold_s=5.0, gather=4)
    try:
        assert len(_score_from_threads(s.url, 4, timeout_s=10.0)) == 4
        assert s.most_in_flight == 4  # four scoring threads, four requests in flight together
    finally:
        s.close()
    s = _KeepAliveServer(hold_s=0.5, gather=3)  # would hold 3 together: the limit lets 2 in
    try:
        assert len(_score_from_threads(s.url, 4, max_concurrency=2)) == 4
        assert s.most_in_flight == 2
    finally:
        s.close()


def test_remote_reuses_each_threads_connection_and_reopens_one_the_server_closed():
    s = _KeepAliveServer()
    try:
        assert len(_score_from_threads(s.url, 2, calls=3)) == 6
        assert len(set(s.ports)) == 2  # one connection per thread, three requests on each
    finally:
        s.close()
    s2 = _KeepAliveServer()  # a kept connection whose server has gone: reopened, not a failed attempt
    try:
        remote_mod.remote(_images(2), PROMPTS[:2], [{}] * 2, url=s2.url, retries=0)
        netloc = s2.url.split("/")[2]
        remote_mod._connections.by_server[("http", netloc)].sock.shutdown(2)  # the connection is dead, as after an idle timeout
        remote_mod.remote(_images(2), PROMPTS[:2], [{}] * 2, url=s2.url, retries=0)
        assert len(set(s2.ports)) == 2
    finally:
        s2.close()


def test_remote_goes_through_the_environments_http_proxy(monkeypatch):
    """As urllib did: HTTP_PROXY takes the request with the whole URL (NO_PROXY empty here)."""
    paths = []

    class Proxy(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):
            paths.append(self.path)
            n = len(json.loads(self.rfile.read(int(self.headers["Content-Length"])))["images"])
            payload = json.dumps({"scores": [0.25] * n}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

    proxy = ThreadingHTTPServer(("127.0.0.1", 0), Proxy)
    threading.Thread(target=proxy.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        monkeypatch.setenv("http_proxy", f"http://127.0.0.1:{proxy.server_address[1]}")
        monkeypatch.delenv("no_proxy", raising=False)
        monkeypatch.delenv("NO_PROXY", raising=False)
        out = remote_mod.remote(_images(2), PROMPTS[:2], [{}] * 2, url="http://judge.invalid:8000/score?v=2", retries=0)
        assert out["score"].tolist() == [0.25, 0.25] and paths == ["http://judge.invalid:8000/score?v=2"]
    finally:
        proxy.shutdown()
        proxy.server_close()


def test_remote_429_backs_off_and_retries_under_concurrency():
    s = _KeepAliveServer(throttle=True)
    try:
        results = _score_from_threads(s.url, 3, retries=1, backoff_s=5.0)  # Retry-After 0 replaces the 5 s
        assert len(results) == 3 and len(s.ports) == 6  # each thread: a 429, then its retry
    finally:
        s.close()


def test_remote_through_combined_reward(server, monkeypatch):
    monkeypatch.setenv(remote_mod.ENV_OCR, server.url)
    images = _images(2)
    total, comps = CombinedReward({"ocr": 2.0, "jpeg_compressibility": 0.0})(images, PROMPTS[:2], [{}] * 2)
    assert set(comps) == {"ocr", "ocr/accuracy", "jpeg_compressibility"}
    assert torch.allclose(total, 2.0 * comps["ocr"])

    server.script = ["404"]
    with pytest.raises(RewardError, match=r"reward 'ocr' failed: RemoteRewardError: http://127.0.0.1") as e:
        CombinedReward({"ocr": 1.0})(images, PROMPTS[:2], [{}] * 2)
    assert e.value.name == "ocr"


def test_remote_video_sends_each_videos_frames_and_checks_one_score_per_video(server, monkeypatch):
    videos = _images(2 * 3, seed=1).view(2, 3, 32, 32, 3)  # 2 videos of 3 frames
    out = remote_mod.remote_video(videos, PROMPTS[:2], [{}] * 2, url=server.url, **FAST)
    assert torch.allclose(out["score"], videos.float().mean(dim=(1, 2, 3, 4)) / 255.0, atol=1e-6)
    body = server.requests[0]
    assert "images" not in body and [len(v) for v in body["videos"]] == [3, 3]
    assert np.array_equal(remote_mod.decode_png(body["videos"][1][2]), videos[1, 2].numpy())  # frames arrive losslessly

    for action, count in (("short", 1), ("per_frame", 6)):  # the reply must have one score per video
        server.script = [action]
        with pytest.raises(remote_mod.RemoteRewardError, match=f"'scores' has {count} values for 2 videos"):
            remote_mod.remote_video(videos, PROMPTS[:2], [{}] * 2, url=server.url, **FAST)

    server.script = ["ok"]
    monkeypatch.setenv(remote_mod.ENV_REMOTE_VIDEO, server.url)
    total, comps = CombinedReward({"remote_video": 1.0})(videos, PROMPTS[:2], [{}] * 2)
    assert set(comps) == {"remote_video", "remote_video/accuracy"} and torch.equal(total, comps["remote_video"])
    with pytest.raises(RewardError, match=r"takes videos \[n, F, H, W, 3\], got images"):
        CombinedReward({"remote_video": 1.0})(videos[:, 0], PROMPTS[:2], [{}] * 2)
    with pytest.raises(ValueError, match="remote_video: takes videos"):
        remote_mod.remote_video(videos[:, 0], PROMPTS[:2], [{}] * 2, url=server.url)


@pytest.mark.parametrize("bad,message", [
    (lambda n: torch.full((n,), float("nan")), "non-finite score"),
    (lambda n: torch.tensor([1.0] * (n - 1) + [float("inf")]), "non-finite score"),
    (lambda n: torch.ones(n - 1), "'score' has 2 values for 3 images"),
    (lambda n: {"score": torch.ones(n), "parts": torch.ones(n + 1)}, "'parts' has 4 values for 3 images"),
])
def test_a_model_reward_returning_nan_inf_or_the_wrong_count_fails_naming_itself(bad, message):
    """CombinedReward checks what any reward returns; the rollout worker turns the error into a
    skipped, counted group (tests/test_run.py runs it end to end)."""
    name = f"bad_reward_{id(bad)}"  # one registry entry per case
    register_reward(name, lambda images, prompts, metadata: bad(images.shape[0]))
    reward = CombinedReward({"jpeg_compressibility": 1.0, name: 1.0})
    images = torch.zeros(3, 8, 8, 3, dtype=torch.uint8)
    with pytest.raises(RewardError, match=f"reward '{name}' failed: .*{message}"):
        reward(images, ["p"] * 3, [{}] * 3)
