"""A judge behind any OpenAI-compatible chat-completions endpoint (vLLM, SGLang, a hosted API):
UnifiedReward, a Qwen-VL judge, a GenEval2-style Yes/No VQA score.

Each image goes in one chat request (a video: `frames` frames, evenly spaced, in one request), as
data URLs, with the prompt template; the requests of a batch run at once, `max_concurrency` at a
time. The reply becomes a score:

    score: number    the first number in the reply (or the first group of `score_regex`)
                     divided by max_score; a number outside [0, max_score] is an error
    score: logprob   the probability of `answer` as the reply's first token, summed over the
                     spellings among the endpoint's top_logprobs (" Yes", "yes", ...; case and
                     spaces ignored); 0 when none is listed (the VQAScore convention)

A reply with no score (no number, no logprobs) fails the call, and so its group, with one line
that shows the reply's start. Requests go through the `openai` client: its connection pool, its
per-request timeout and its retries of connection errors, timeouts, 408/409/429 and 5xx, at most
`retries` times. Nothing is retried forever, and a reply without a score is not retried.

Keyword options (`reward.options.vlm_judge`):
    base_url         e.g. http://localhost:8000/v1 (or $ASYNC_FLOWGRPO_VLM_JUDGE_URL)
    model            the served model's name (required)
    api_key_env      the name of the environment variable holding the API key (default: none;
                     the key "EMPTY" is sent, as a local vLLM/SGLang server expects)
    prompt_template  the question; "{prompt}" becomes the image's prompt, "{max_score}" max_score
    system_prompt    an optional system message
    score            "number" (default) | "logprob"
    max_score        number mode: the scale's top (default 10)
    score_regex      number mode: where the number is, e.g. "Final Score:\\s*([0-9.]+)" for a judge
                     that reasons first (default: the reply's first number)
    answer           logprob mode: the answer token scored (default "Yes")
    frames           videos (vlm_judge_video): frames sent per video (default 4)
    image_format     "png" (default, lossless) | "jpeg"
    max_tokens       reply length (default 64 for number, 1 for logprob)
    top_logprobs     logprob mode: alternatives listed per token (default 20)
    temperature      default 0
    timeout_s        per attempt (default 60)
    retries          extra attempts after the first (default 2)
    max_concurrency  requests in flight at once per call (default 16)
    extra_body       extra request fields the server takes, e.g. {"top_k": 1} or {"chat_template_kwargs": {...}}
"""

from __future__ import annotations

import base64
import functools
import io
import math
import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Literal, Optional

import torch
from PIL import Image

ENV_URL = "ASYNC_FLOWGRPO_VLM_JUDGE_URL"
NUMBER_TEMPLATE = ('Rate from 0 to {max_score} how well this image matches the description "{prompt}" '
                   "(alignment and visual quality). Answer with the number only.")
YES_NO_TEMPLATE = 'Does this image show "{prompt}"? Please answer yes or no.'
_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")

_clients: dict[tuple, object] = {}
_clients_lock = threading.Lock()


class VLMJudgeError(RuntimeError):
    """The judge could not be reached or its reply held no usable score."""


def _openai():
    try:
        import openai
    except ImportError:
        raise ImportError("vlm_judge needs the openai package: pip install 'async_flowgrpo[rewards]'") from None
    return openai


def _client(base_url: str, api_key: str, timeout_s: float, retries: int):
    """One client per endpoint and settings in this process: its connection pool is shared by
    every scoring thread."""
    key = (base_url, api_key, timeout_s, retries)
    with _clients_lock:
        if key not in _clients:
            _clients[key] = _openai().OpenAI(base_url=base_url, api_key=api_key, timeout=timeout_s, max_retries=retries)
        return _clients[key]


def data_url(image, image_format: str = "png") -> str:
    """A uint8 array [H, W, 3] as a data URL."""
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format=image_format.upper())
    return f"data:image/{image_format};base64,{base64.b64encode(buf.getvalue()).decode('ascii')}"


def _reply_start(text: Optional[str]) -> str:
    return repr((text or "")[:80])


def score_number(reply: Optional[str], max_score: float, score_regex: Optional[str] = None) -> float:
    """The first number in the reply (in score_regex's first group, when given) / max_score;
    VLMJudgeError when there is none or it is out of range."""
    found = re.search(score_regex, reply or "") if score_regex else None
    text = (found.group(1) if found.groups() else found.group()) if found else ("" if score_regex else reply or "")
    match = _NUMBER.search(text)
    if match is None:
        where = f"matching {score_regex!r} " if score_regex else ""
        raise VLMJudgeError(f"no number {where}in the reply {_reply_start(reply)}")
    value = float(match.group())
    if not 0 <= value <= max_score:
        raise VLMJudgeError(f"the reply's number {match.group()} is outside [0, {max_score:g}]: {_reply_start(reply)}")
    return value / max_score


def score_logprob(choice, answer: str) -> float:
    """P(answer) as the first reply token, from its top_logprobs (0 when the answer is not listed)."""
    content = getattr(getattr(choice, "logprobs", None), "content", None)
    if not content:
        reply = getattr(getattr(choice, "message", None), "content", None)
        raise VLMJudgeError(f"no logprobs in the reply {_reply_start(reply)} (does the endpoint support logprobs/top_logprobs?)")
    first = content[0]
    alternatives = list(first.top_logprobs or []) or [first]
    want = answer.strip().lower()
    return float(sum(math.exp(alt.logprob) for alt in alternatives if alt.token.strip().lower() == want))


def _frames(video: torch.Tensor, frames: int) -> list:
    idx = torch.linspace(0, video.shape[0] - 1, min(frames, video.shape[0])).round().long()
    return list(video[idx].numpy())


def vlm_judge(
    images: torch.Tensor,
    prompts: list,
    metadata: list,
    *,
    base_url: Optional[str] = None,
    model: Optional[str] = None,
    api_key_env: Optional[str] = None,
    prompt_template: Optional[str] = None,
    system_prompt: Optional[str] = None,
    score: Literal["number", "logprob"] = "number",
    max_score: float = 10.0,
    score_regex: Optional[str] = None,
    answer: str = "Yes",
    frames: int = 4,
    image_format: Literal["png", "jpeg"] = "png",
    max_tokens: Optional[int] = None,
    top_logprobs: int = 20,
    temperature: float = 0.0,
    timeout_s: float = 60.0,
    retries: int = 2,
    max_concurrency: int = 16,
    extra_body: Optional[dict] = None,
) -> torch.Tensor:
    """One score in [0, 1] per image [n, H, W, 3] (or video [n, F, H, W, 3])."""
    base_url = base_url or os.environ.get(ENV_URL)
    if not base_url:
        raise VLMJudgeError(f"vlm_judge: no endpoint given: set reward.options.vlm_judge.base_url or ${ENV_URL}")
    if not model:
        raise VLMJudgeError("vlm_judge: no model given: set reward.options.vlm_judge.model (the served model's name)")
    api_key = "EMPTY"
    if api_key_env:
        api_key = os.environ.get(str(api_key_env), "")
        if not api_key:
            raise VLMJudgeError(f"vlm_judge: ${api_key_env} (reward.options.vlm_judge.api_key_env) is not set")
    if len(prompts) != images.shape[0]:
        raise ValueError(f"vlm_judge: {len(prompts)} prompts for {images.shape[0]} images")
    if images.shape[0] == 0:
        return torch.zeros(0)
    template = prompt_template or (YES_NO_TEMPLATE if score == "logprob" else NUMBER_TEMPLATE)
    client = _client(str(base_url), api_key, float(timeout_s), int(retries))
    openai = _openai()
    arrays = images.detach().cpu()

    def judge(i: int) -> float:
        pictures = _frames(arrays[i], int(frames)) if arrays.dim() == 5 else [arrays[i].numpy()]
        question = template.replace("{prompt}", str(prompts[i])).replace("{max_score}", f"{max_score:g}")
        content = [{"type": "image_url", "image_url": {"url": data_url(p, image_format)}} for p in pictures]
        messages = ([{"role": "system", "content": system_prompt}] if system_prompt else [])
        messages.append({"role": "user", "content": [*content, {"type": "text", "text": question}]})
        request = dict(model=str(model), messages=messages, temperature=float(temperature),
                       max_tokens=int(max_tokens or (1 if score == "logprob" else 64)))
        if score == "logprob":
            request.update(logprobs=True, top_logprobs=int(top_logprobs))
        if extra_body:
            request["extra_body"] = dict(extra_body)
        try:
            reply = client.chat.completions.create(**request)
        except openai.APITimeoutError:
            raise VLMJudgeError(f"{base_url}: timed out after {float(timeout_s):g}s ({int(retries) + 1} attempt(s))") from None
        except openai.APIStatusError as e:
            detail = re.sub(r"^Error code: \d+ - ", "", str(getattr(e, "message", e))).strip().splitlines()
            raise VLMJudgeError(f"{base_url}: HTTP {e.status_code}: {detail[0][:160] if detail else ''}") from None
        except openai.APIError as e:  # connection refused / reset, a malformed answer
            raise VLMJudgeError(f"{base_url}: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}") from None
        if not reply.choices:
            raise VLMJudgeError(f"{base_url}: the reply has no choices")
        choice = reply.choices[0]
        if score == "logprob":
            return score_logprob(choice, answer)
        return score_number(choice.message.content, float(max_score), score_regex)

    n = images.shape[0]
    with ThreadPoolExecutor(max_workers=max(1, min(n, int(max_concurrency)))) as pool:
        return torch.tensor(list(pool.map(judge, range(n))), dtype=torch.float32)


def check_options(options: dict) -> None:
    """Config time: the package is there and the numbers make sense (the endpoint is only met at run time)."""
    try:
        _openai()
    except ImportError as e:
        raise ValueError(str(e)) from None
    if not options.get("model"):
        raise ValueError("model is required: the served model's name (as the endpoint's /v1/models lists it)")
    if options.get("score_regex"):
        try:
            re.compile(options["score_regex"])
        except re.error as e:
            raise ValueError(f"score_regex {options['score_regex']!r} is not a regular expression: {e}") from None
    if float(options.get("max_score", 10.0)) <= 0:
        raise ValueError("max_score must be > 0")
    for key in ("frames", "max_concurrency", "top_logprobs"):
        if key in options and int(options[key]) < 1:
            raise ValueError(f"{key} must be >= 1")
    if "retries" in options and int(options["retries"]) < 0:
        raise ValueError("retries must be >= 0")
    if "timeout_s" in options and float(options["timeout_s"]) <= 0:
        raise ValueError("timeout_s must be > 0")


vlm_judge.check_options = check_options


@functools.wraps(vlm_judge)  # the same options, checked the same way at config time
def vlm_judge_video(videos, prompts, metadata, **options) -> torch.Tensor:
    """vlm_judge on videos [n, F, H, W, 3]: `frames` frames of each, in one request."""
    if videos.dim() != 5:
        raise ValueError(f"vlm_judge_video: takes videos [n, F, H, W, 3], got {list(videos.shape)}")
    return vlm_judge(videos, prompts, metadata, **options)
