"""vlm_judge against a local OpenAI-compatible endpoint: what is sent, how the reply becomes a score,
and every bad answer failing its group (one line, bounded retries and time)."""

from __future__ import annotations

import sys
import time

import numpy as np
import pytest
import torch

pytest.importorskip("openai")

from reward_servers import FakeJudge, completion, request_images  # noqa: E402

from async_flowgrpo.config import ConfigError, load_config  # noqa: E402
from async_flowgrpo.rewards import CombinedReward, RewardError, get_reward  # noqa: E402
from async_flowgrpo.rewards import vlm_judge as judge_mod  # noqa: E402

PROMPTS = ["a red circle", "a blue square", "a green triangle"]


def _images(n=3, size=16, frames=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (n, size, size, 3) if frames is None else (n, frames, size, size, 3)
    return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)


@pytest.fixture
def judge_server():
    servers = []

    def make(answer, delay_s=0.0):
        servers.append(FakeJudge(answer, delay_s))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


def test_number_mode_sends_each_image_and_prompt_and_scales_the_first_number(judge_server):
    def answer(request, index):  # 3 x the prompt's index, so each score shows which request it answered
        prompt = request["messages"][-1]["content"][-1]["text"].split('"')[1]
        return completion(f"Score: {PROMPTS.index(prompt) * 3} / 10, good")

    server = judge_server(answer)
    images = _images()
    fn = get_reward("vlm_judge", base_url=server.base_url, model="judge-7b", prompt_template='Rate "{prompt}" 0-{max_score}.',
                    system_prompt="You are a strict judge.")
    scores = fn(images, PROMPTS, [{}] * 3)
    assert torch.allclose(scores, torch.tensor([0.0, 0.3, 0.6]))
    assert len(server.requests) == 3
    by_prompt = {r["messages"][-1]["content"][-1]["text"]: r for r in server.requests}
    for i, prompt in enumerate(PROMPTS):
        request = by_prompt[f'Rate "{prompt}" 0-10.']
        assert request["model"] == "judge-7b" and request["temperature"] == 0
        assert request["messages"][0] == {"role": "system", "content": "You are a strict judge."}
        (sent,) = request_images(request)
        assert np.array_equal(sent, images[i].numpy())  # PNG data URL: lossless


def test_logprob_mode_is_the_answer_tokens_probability_over_its_spellings(judge_server):
    yes, yes2, no = -0.3, -2.5, -1.6
    server = judge_server(lambda req, i: completion("Yes", [("Yes", yes), (" yes", yes2), ("No", no)]))
    scores = get_reward("vlm_judge", base_url=server.base_url, model="m", score="logprob")(_images(2), PROMPTS[:2], [{}] * 2)
    assert torch.allclose(scores, torch.full((2,), float(np.exp(yes) + np.exp(yes2))))
    request = server.requests[0]
    assert request["logprobs"] is True and request["top_logprobs"] == 20 and request["max_tokens"] == 1
    assert "Please answer yes or no" in request["messages"][-1]["content"][-1]["text"]
    # the answer not among the listed tokens: probability 0 (not an error)
    server = judge_server(lambda req, i: completion("No", [("No", -0.1), ("Maybe", -3.0)]))
    assert get_reward("vlm_judge", base_url=server.base_url, model="m", score="logprob")(_images(1), PROMPTS[:1], [{}]).tolist() == [0.0]


def test_score_regex_finds_the_score_after_the_reasoning(judge_server):
    reply = "1. Alignment: good. 2. Quality: sharp.\nFinal Score: 4.5"
    server = judge_server(lambda req, i: completion(reply))
    fn = get_reward("vlm_judge", base_url=server.base_url, model="m", max_score=5, score_regex=r"Final Score:\s*([0-9.]+)")
    assert torch.allclose(fn(_images(1), PROMPTS[:1], [{}]), torch.tensor([0.9]))
    assert judge_mod.score_number(reply, 5) == 0.2  # without it: the first number, "1."
    with pytest.raises(judge_mod.VLMJudgeError, match="no number matching 'Final Score:"):
        judge_mod.score_number("Final verdict: good", 5, r"Final Score:\s*([0-9.]+)")


def test_api_key_from_the_named_env_var_and_video_frames(judge_server, monkeypatch):
    server = judge_server(lambda req, i: completion("7"))
    monkeypatch.setenv("MY_JUDGE_KEY", "sk-test-123")
    videos = _images(2, frames=6)
    scores = get_reward("vlm_judge_video", base_url=server.base_url, model="m", api_key_env="MY_JUDGE_KEY", frames=3)(
        videos, PROMPTS[:2], [{}] * 2)
    assert torch.allclose(scores, torch.full((2,), 0.7))
    assert all(h.get("authorization") == "Bearer sk-test-123" for h in server.headers)
    sent = [request_images(r) for r in server.requests]
    assert sorted(len(s) for s in sent) == [3, 3]
    firsts = {s[0].tobytes() for s in sent}
    assert firsts == {videos[0, 0].numpy().tobytes(), videos[1, 0].numpy().tobytes()}  # frames 0, 2/3, 5 of each
    monkeypatch.delenv("MY_JUDGE_KEY")
    with pytest.raises(judge_mod.VLMJudgeError, match=r"\$MY_JUDGE_KEY .* is not set"):
        get_reward("vlm_judge", base_url=server.base_url, model="m", api_key_env="MY_JUDGE_KEY")(_images(1), PROMPTS[:1], [{}])


@pytest.mark.parametrize("answer,message", [
    (lambda req, i: completion("I would rather not say."), "no number in the reply 'I would rather not say.'"),
    (lambda req, i: completion("Score: 12 out of 10"), "the reply's number 12 is outside [0, 10]"),
    (lambda req, i: completion("Yes"), "no logprobs in the reply 'Yes'"),
    (lambda req, i: 500, "HTTP 500: "),
    (lambda req, i: 404, "HTTP 404: "),
])
def test_a_bad_answer_fails_only_its_group_with_one_line(judge_server, answer, message):
    """The same group is scored by a good endpoint and by one sending the bad answer: only the
    latter fails, as a RewardError of one line (the rollout worker then skips and counts it)."""
    bad = judge_server(answer)
    good = judge_server(lambda req, i: completion("Yes 5", [("Yes", -0.5)]))
    score = "logprob" if "logprobs" in message else "number"
    reward_bad = CombinedReward({"vlm_judge": 1.0}, {"vlm_judge": {"base_url": bad.base_url, "model": "m", "retries": 1, "score": score}})
    reward_good = CombinedReward({"vlm_judge": 1.0}, {"vlm_judge": {"base_url": good.base_url, "model": "m", "score": score}})
    ok = reward_good.score_groups([(_images(2), PROMPTS[:2], [{}] * 2)])[0]
    assert isinstance(ok, tuple) and ok[0].shape == (2,)
    (failed,) = reward_bad.score_groups([(_images(2), PROMPTS[:2], [{}] * 2)])
    assert isinstance(failed, RewardError)
    assert message in str(failed) and len(str(failed).splitlines()) == 1 and "vlm_judge" in str(failed)
    retried = isinstance(answer(None, 0), int) and answer(None, 0) >= 500
    # 5xx: one more attempt (retries=1) per image; others none. After the first failure the
    # group's requests not yet sent are dropped, so fewer may reach the server.
    assert (2 if retried else 1) <= len(bad.requests) <= (4 if retried else 2)


def test_a_timeout_is_retried_a_bounded_number_of_times(judge_server):
    slow = judge_server(lambda req, i: completion("5"), delay_s=6.0)
    fn = get_reward("vlm_judge", base_url=slow.base_url, model="m", timeout_s=0.3, retries=1)
    start = time.monotonic()
    with pytest.raises(judge_mod.VLMJudgeError, match=r"timed out after 0.3s \(2 attempt\(s\)\)"):
        fn(_images(1), PROMPTS[:1], [{}])
    assert time.monotonic() - start < 4.5  # two 0.3 s attempts and the client's short backoff, not the 6 s answer


def test_requests_of_a_batch_run_at_once(judge_server):
    server = judge_server(lambda req, i: completion("5"), delay_s=1.0)
    fn = get_reward("vlm_judge", base_url=server.base_url, model="m", max_concurrency=8)
    start = time.monotonic()
    fn(_images(8, size=8), ["x"] * 8, [{}] * 8)
    assert time.monotonic() - start < 5.0  # 8 x 1 s one after another would be 8 s


def test_config_checks_options_and_a_missing_package_is_one_line(monkeypatch):
    base = ["reward.weights={vlm_judge: 1.0}", "reward.options.vlm_judge.model=m"]
    cfg = load_config("sync", base + ["reward.options.vlm_judge.score=logprob"])
    assert cfg.reward.options["vlm_judge"]["score"] == "logprob"
    with pytest.raises(ConfigError, match="reward.options.vlm_judge: .*score must be one of number, logprob"):
        load_config("sync", base + ["reward.options.vlm_judge.score=probability"])
    with pytest.raises(ConfigError, match="reward.options.vlm_judge: .*max_score must be > 0"):
        load_config("sync", base + ["reward.options.vlm_judge.max_score=0"])
    with pytest.raises(ConfigError, match=r"score_regex '\(' is not a regular expression"):
        load_config("sync", base + ["reward.options.vlm_judge.score_regex=("])
    with pytest.raises(ConfigError, match="reward.options.vlm_judge: .*model is required"):
        load_config("sync", ["reward.weights={vlm_judge: 1.0}", "reward.options.vlm_judge.base_url=http://localhost:8000/v1"])
    monkeypatch.setitem(sys.modules, "openai", None)  # as if not installed
    with pytest.raises(ConfigError, match=r"vlm_judge needs the openai package: pip install 'async_flowgrpo\[rewards\]'"):
        load_config("sync", base)
