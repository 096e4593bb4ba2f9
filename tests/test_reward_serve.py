"""python -m async_flowgrpo.rewards.serve: registered rewards over the remote protocol, requests of
many clients batched, bad requests answered 4xx in one line, the server going on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import pytest
import torch

from async_flowgrpo.conditioning import SOURCE_IMAGES
from async_flowgrpo.rewards import CombinedReward, RewardError, get_reward, register_reward
from async_flowgrpo.rewards.remote import _payload
from async_flowgrpo.rewards.serve import RewardService, make_server

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def mean_red(images, prompts, metadata):
    """A test reward: each image's mean red level (so a score shows which image it came from)."""
    if any(m.get("fail") for m in metadata):
        raise RuntimeError("asked to fail\nsecond line")
    return images[..., 0].float().mean(dim=(1, 2)) / 255


register_reward("test_mean_red", mean_red)


def source_red(images, prompts, metadata):
    """A test edit reward: the red level of each sample's first input image."""
    return torch.stack([m[SOURCE_IMAGES][0][..., 0].float().mean() / 255 for m in metadata])


register_reward("test_source_red", source_red)


def _images(n, level=0, size=8):
    images = torch.zeros(n, size, size, 3, dtype=torch.uint8)
    for i in range(n):
        images[i, ..., 0] = level + i
    return images


@pytest.fixture
def serve():
    started = []

    def start(weights, batch_size=64, batch_wait_s=0.05, max_request_mb=512.0):
        service = RewardService(CombinedReward(weights), batch_size, batch_wait_s)
        server = make_server(service, "127.0.0.1", 0, max_request_mb)
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        started.append(server)
        return service, f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in started:
        server.shutdown()
        server.server_close()


def _post(url, body: bytes, timeout=30):
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=body, method="POST"), timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_remote_scores_through_the_server_as_in_process(serve):
    service, url = serve({"test_mean_red": 2.0, "jpeg_compressibility": 0.5})
    images = _images(3, level=100)
    got = get_reward("remote", url=f"{url}/score", retries=0)(images, ["a", "b", "c"], [{}] * 3)
    want_total, want_parts = CombinedReward({"test_mean_red": 2.0, "jpeg_compressibility": 0.5})(images, ["a", "b", "c"], [{}] * 3)
    assert torch.allclose(got["score"], want_total)
    assert torch.allclose(got["remote/test_mean_red"], want_parts["test_mean_red"])
    with urllib.request.urlopen(f"{url}/health", timeout=10) as r:
        health = json.loads(r.read())
    assert health["status"] == "ok" and health["rewards"] == {"test_mean_red": 2.0, "jpeg_compressibility": 0.5}
    assert health["requests"] == 1 and health["batches"] == 1


def test_an_edit_models_source_images_reach_the_served_reward(serve):
    service, url = serve({"test_source_red": 1.0})
    sources = [[_images(1, level=40 + 10 * i)[0]] for i in range(2)]
    metadata = [{"tag": "x", SOURCE_IMAGES: s} for s in sources]
    got = get_reward("remote", url=url, retries=0)(_images(2), ["a", "b"], metadata)["score"]
    assert torch.allclose(got, source_red(None, None, metadata))


def test_requests_from_many_workers_are_batched_and_each_gets_its_own_scores(serve):
    service, url = serve({"test_mean_red": 1.0}, batch_size=32, batch_wait_s=0.5)
    results, fn = {}, get_reward("remote", url=url, retries=0)

    def worker(k):  # each worker's group has its own red levels: 10k, 10k + 1
        results[k] = fn(_images(2, level=10 * k), ["x"] * 2, [{}] * 2)["score"]

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    for k in range(8):
        assert torch.allclose(results[k], torch.tensor([10 * k, 10 * k + 1]) / 255)
    batches = service.health()["batches"]
    assert batches < 8, batches  # several workers' groups scored in one call


def test_bad_requests_get_a_4xx_in_one_line_and_the_server_goes_on(serve):
    service, url = serve({"test_mean_red": 1.0}, max_request_mb=0.01)
    good = _payload(_images(2), ["a", "b"], [{}, {}])
    mixed_sizes = json.loads(good)
    mixed_sizes["images"][1] = json.loads(_payload(_images(1, size=4), ["b"], [{}]))["images"][0]
    bad = {
        "not json": b"{not json",
        "a list": b"[1, 2]",
        "no images": json.dumps({"prompts": ["a"]}).encode(),
        "count mismatch": json.dumps({**json.loads(good), "prompts": ["a"]}).encode(),
        "not base64": json.dumps({**json.loads(good), "images": ["%%%", "%%%"]}).encode(),
        "not a png": json.dumps({**json.loads(good), "images": ["aGVsbG8=", "aGVsbG8="]}).encode(),
        "mixed sizes": json.dumps(mixed_sizes).encode(),
        "bad source_images": json.dumps({**json.loads(good), "source_images": ["x", "y"]}).encode(),
        "too large": b"x" * 20000,
    }
    for what, body in bad.items():
        status, answer = _post(f"{url}/score", body)
        assert 400 <= status < 500, (what, status, answer)
        assert set(answer) == {"error"} and len(answer["error"].splitlines()) == 1, (what, answer)
    status, answer = _post(f"{url}/nowhere", good)
    assert status == 404
    status, answer = _post(f"{url}/score", good)
    assert status == 200 and len(answer["scores"]) == 2
    assert service.health()["bad_requests"] == len(bad) + 1


def test_a_failing_reward_fails_its_request_with_500_and_is_retried_a_bounded_number_of_times(serve):
    service, url = serve({"test_mean_red": 1.0}, batch_size=0)
    status, answer = _post(url, _payload(_images(1), ["a"], [{"fail": True}]))
    assert status == 500 and "asked to fail" in answer["error"] and "second line" not in answer["error"]
    fn = CombinedReward({"remote": 1.0}, {"remote": {"url": url, "retries": 1, "backoff_s": 0.01}})
    (failed,) = fn.score_groups([(_images(1), ["a"], [{"fail": True}])])
    assert isinstance(failed, RewardError) and "failed after 2 attempt(s): HTTP 500" in str(failed)
    (ok,) = fn.score_groups([(_images(1), ["a"], [{}])])
    assert isinstance(ok, tuple)
    assert service.health()["failed"] == 3


@pytest.mark.slow  # starts the server's process five times
def test_cli_serves_a_module_function_and_refuses_bad_input_with_exit_2(tmp_path):
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}", "HF_HUB_OFFLINE": "1"}
    (tmp_path / "my_rewards.py").write_text(
        "import torch\n\ndef brightness(images, prompts, metadata, *, scale=1.0):\n"
        "    return scale * images.float().mean(dim=(1, 2, 3)) / 255\n")
    for args, needle in [(["nope"], "unknown reward 'nope'"), (["my_rewards:missing"], "cannot import missing from my_rewards"),
                         (["my_rewards:brightness", "--option", "my_rewards:brightness.colour=1"], "does not take option(s) colour"),
                         (["jpeg_compressibility", "--option", "oops"], "expected NAME.KEY=VALUE")]:
        proc = subprocess.run([sys.executable, "-m", "async_flowgrpo.rewards.serve", *args], capture_output=True, text=True,
                              timeout=120, env=env)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and needle in proc.stderr, proc.stderr
    proc = subprocess.Popen([sys.executable, "-m", "async_flowgrpo.rewards.serve", "my_rewards:brightness=2",
                             "--option", "my_rewards:brightness.scale=0.5", "--port", "0"],
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stderr.readline()
        assert "serving my_rewards:brightness=2 on http://127.0.0.1:" in line, line
        url = line.split(" on ")[1].split()[0]
        scores = get_reward("remote", url=url, retries=0)(_images(2, level=51), ["a", "b"], [{}, {}])["score"]
        images = _images(2, level=51)
        assert torch.allclose(scores, 2 * 0.5 * images.float().mean(dim=(1, 2, 3)) / 255)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
