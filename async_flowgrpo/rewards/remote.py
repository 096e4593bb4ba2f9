"""Rewards served over HTTP (OCR, GenEval, ... servers), stdlib only.

Request:  POST <url>, Content-Type: application/json,
          {"prompts": [str]*n, "metadata": [dict]*n, "images": [base64 PNG]*n}
          or, for videos (`remote_video`), "videos": [[base64 PNG]*F]*n in place of "images":
          each video as the list of its F frames (lossless, so a server sees what was sampled).
          An edit model's requests add "source_images": [[base64 PNG]*k]*n, each sample's k input
          images (taken out of its metadata), so a server can judge the edit against its source.
Response: {"scores": [float]*n, <other>: [number]*n, ...}, one value per image or video
          "scores" is the reward; every other list of n numbers is returned as the component
          "<name>/<other>"; other keys (strings, nested objects) are ignored.

Connection errors, timeouts, HTTP 5xx and 429 are retried `retries` times with exponential backoff
(backoff_s, 2*backoff_s, ...; a 429's Retry-After when the server sends one); other HTTP errors and
malformed responses fail at once. Every error names the URL.

Several groups are scored at once (the rollout worker's scoring threads, a reward actor's calls):
each thread keeps its connection to the server open between requests, and at most
`max_concurrency` requests per URL are in flight from one process.

The flow_grpo reward server's protocol (`protocol: flow_grpo`; the GenEval, OCR and DeQA servers
of github.com/yifan123/reward-server, unchanged):
Request:  POST <url>, a pickled dict {"images": [JPEG bytes]*n, "meta_datas": [dict]*n,
          "only_strict": bool} (JPEG at PIL's default quality, as flow_grpo sends them).
Response: a pickled dict of lists; `score_key` ("scores" for GenEval, "outputs" for DeQA) is the
          reward, every other list of n numbers a component as above (GenEval's "rewards",
          "strict_rewards"); nested dicts (its per-tag "group_rewards") are ignored.
The answer is unpickled only when `allow_pickle` is on, and then only through a restricted
unpickler (`safe_pickle`: containers, numbers, strings, numpy arrays; any other class is refused
with one line and never imported). Images only (a video reward uses the JSON protocol).

Keyword options (`reward.options.<name>`):
    url         the endpoint (or the env var: $ASYNC_FLOWGRPO_REMOTE_URL, _OCR_URL, _GENEVAL_URL,
                _REMOTE_VIDEO_URL)
    timeout_s   per attempt (default 60)
    retries     extra attempts after the first (default 2)
    backoff_s   first backoff (default 1.0)
    headers     extra HTTP headers, e.g. {"Authorization": "Bearer ..."}
    max_concurrency  requests to the URL in flight at once from one process (default 8)
    protocol    "json" (default) | "flow_grpo"
    allow_pickle  flow_grpo only: unpickle the server's answer (restricted; default false, required)
    score_key   flow_grpo only: the response's key holding the scores (default "scores")
    only_strict  flow_grpo only: sent as the request's "only_strict" (default true, as flow_grpo trains)
"""

from __future__ import annotations

import base64
import functools
import http.client
import io
import json
import math
import os
import socket
import threading
import time
import urllib.parse
import urllib.request
from typing import Literal, Optional

import torch
from PIL import Image

from async_flowgrpo.conditioning import SOURCE_IMAGES
from async_flowgrpo.rewards.safe_pickle import restricted_loads

ENV_REMOTE = "ASYNC_FLOWGRPO_REMOTE_URL"
ENV_OCR = "ASYNC_FLOWGRPO_OCR_URL"
ENV_GENEVAL = "ASYNC_FLOWGRPO_GENEVAL_URL"
ENV_REMOTE_VIDEO = "ASYNC_FLOWGRPO_REMOTE_VIDEO_URL"


class RemoteRewardError(RuntimeError):
    """The reward server could not be reached or answered something unusable."""


def encode_png(image) -> str:
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def decode_png(data: str):
    """The inverse of encode_png (a uint8 numpy array [H, W, 3]); for servers and tests."""
    import numpy as np

    return np.asarray(Image.open(io.BytesIO(base64.b64decode(data))).convert("RGB"))


def _kind(samples: torch.Tensor) -> str:
    return "videos" if samples.dim() == 5 else "images"  # [n, F, H, W, 3] or [n, H, W, 3]


def _payload(samples: torch.Tensor, prompts: list, metadata: list) -> bytes:
    arrays = samples.detach().cpu().numpy()
    metadata = [dict(m) if m is not None else {} for m in metadata]
    sources = [m.pop(SOURCE_IMAGES, None) for m in metadata]
    body = {
        "prompts": [str(p) for p in prompts],
        "metadata": metadata,
        _kind(samples): ([[encode_png(frame) for frame in video] for video in arrays] if samples.dim() == 5
                         else [encode_png(img) for img in arrays]),
    }
    if any(s is not None for s in sources):  # an edit model's input images, beside what it made of them
        body["source_images"] = [[encode_png(img.cpu().numpy()) for img in s or []] for s in sources]
    return json.dumps(body, default=str).encode("utf-8")


def _flow_grpo_payload(images: torch.Tensor, metadata: list, only_strict: bool) -> bytes:
    """The flow_grpo reward server's request: a pickle of plain data (we send, never load, it)."""
    import pickle

    jpegs = []
    for image in images.detach().cpu().numpy():
        buf = io.BytesIO()
        Image.fromarray(image).save(buf, format="JPEG")
        jpegs.append(buf.getvalue())
    meta = [{k: v for k, v in (m or {}).items() if k != SOURCE_IMAGES} for m in metadata]  # (its servers take no inputs)
    body = {"images": jpegs, "meta_datas": meta, "only_strict": bool(only_strict)}
    return pickle.dumps(body, protocol=4)


def _is_number(x) -> bool:
    return isinstance(x, (int, float))  # bools count (e.g. GenEval's per-image "correct")


class _Connections(threading.local):
    """This thread's kept-alive connection per server (scoring threads each hold their own)."""

    def __init__(self):
        self.by_server: dict[tuple[str, str], http.client.HTTPConnection] = {}


_connections = _Connections()
_limits: dict[tuple[str, int], threading.BoundedSemaphore] = {}  # (url, limit) -> its requests in flight here
_limits_lock = threading.Lock()


def _limit(url: str, max_concurrency: int) -> threading.BoundedSemaphore:
    with _limits_lock:
        return _limits.setdefault((url, max_concurrency), threading.BoundedSemaphore(max_concurrency))


def _connection(parts: urllib.parse.SplitResult, timeout_s: float) -> http.client.HTTPConnection:
    """This thread's connection to the server, through the scheme's proxy from the environment
    (HTTP_PROXY / HTTPS_PROXY, NO_PROXY honoured) as urllib would go."""
    key = (parts.scheme, parts.netloc)
    conn = _connections.by_server.get(key)
    if conn is None:
        cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        proxy = urllib.request.getproxies().get(parts.scheme)
        if proxy and not urllib.request.proxy_bypass(parts.hostname or ""):
            via = urllib.parse.urlsplit(proxy if "://" in proxy else f"http://{proxy}").netloc
            if parts.scheme == "https":  # a CONNECT tunnel through the proxy, TLS to the server
                conn = cls(via, timeout=timeout_s)
                conn.set_tunnel(parts.netloc)
            else:  # the proxy takes the whole URL
                conn = http.client.HTTPConnection(via, timeout=timeout_s)
                conn.via_proxy = True
        else:
            conn = cls(parts.netloc, timeout=timeout_s)
        _connections.by_server[key] = conn
    conn.timeout = timeout_s
    if conn.sock is not None:
        conn.sock.settimeout(timeout_s)
    return conn


def _drop(parts: urllib.parse.SplitResult) -> None:
    conn = _connections.by_server.pop((parts.scheme, parts.netloc), None)
    if conn is not None:
        conn.close()


def _send(parts: urllib.parse.SplitResult, data: bytes, headers: dict, timeout_s: float) -> http.client.HTTPResponse:
    """One POST on this thread's connection to the server, its body read. A kept-alive connection
    that the server closed while idle is reopened once (that is not a failed attempt)."""
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    for reopened in (False, True):
        conn = _connection(parts, timeout_s)
        reused = conn.sock is not None
        if getattr(conn, "via_proxy", False):
            path = urllib.parse.urlunsplit(parts)
        try:
            conn.request("POST", path, body=data, headers=headers)
            resp = conn.getresponse()
            resp.body = resp.read()
            return resp
        except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
            _drop(parts)
            if not reused or reopened:
                raise
        except BaseException:
            _drop(parts)  # a timed-out or half-read connection is not reused
            raise


def _retry_after(resp: http.client.HTTPResponse) -> float | None:
    try:
        return max(0.0, float(resp.headers.get("Retry-After", "")))
    except ValueError:
        return None


def _post(url: str, data: bytes, headers: dict, timeout_s: float, retries: int, backoff_s: float,
          max_concurrency: int = 8) -> bytes:
    """POST with retries. At most `max_concurrency` requests to `url` at once from this process
    (the others wait; a request backing off gives its place up while it sleeps)."""
    parts = urllib.parse.urlsplit(url)
    hdrs = {"Content-Type": "application/json", "Accept": "application/json", **{str(k): str(v) for k, v in headers.items()}}
    last, wait = "", None
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(wait if wait is not None else backoff_s * 2 ** (attempt - 1))
        wait = None
        with _limit(url, max_concurrency):
            try:
                resp = _send(parts, data, hdrs, timeout_s)
            except (socket.timeout, TimeoutError) as e:
                last = f"timed out after {timeout_s:g}s ({type(e).__name__})"
                continue
            except (OSError, http.client.HTTPException) as e:  # refused, reset mid-response, remote closed, ...
                last = f"{type(e).__name__}: {e}"
                continue
        if 200 <= resp.status < 300:
            return resp.body
        detail = resp.body[:200].decode("utf-8", "replace").strip().replace("\n", " ")
        last = f"HTTP {resp.status} {resp.reason}" + (f": {detail}" if detail else "")
        if resp.status < 500 and resp.status != 429:
            raise RemoteRewardError(f"{url}: {last}") from None
        if resp.status == 429:
            wait = _retry_after(resp)  # the server's own back-off, when it gives one
    raise RemoteRewardError(f"{url}: failed after {retries + 1} attempt(s): {last}")


def _parse(url: str, raw: bytes, n: int, name: str, kind: str = "images") -> dict:
    try:
        body = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RemoteRewardError(f"{url}: malformed response (not JSON: {e}): {raw[:80]!r}") from None
    return _scores(url, body, n, name, kind)


def _parse_flow_grpo(url: str, raw: bytes, n: int, name: str, score_key: str) -> dict:
    """The flow_grpo server's pickled answer, through the restricted unpickler, as _parse's body."""
    import numpy as np

    try:
        body = restricted_loads(raw)
    except Exception as e:  # a refused class, a truncated or broken pickle: one line, nothing imported
        raise RemoteRewardError(f"{url}: malformed response (pickle: {type(e).__name__}: {e})") from None
    if not isinstance(body, dict) or score_key not in body:
        keys = sorted(map(str, body)) if isinstance(body, dict) else type(body).__name__
        raise RemoteRewardError(f"{url}: malformed response: no '{score_key}' list (got {keys}); set score_key")

    def plain(value):  # numpy arrays and scalars as the Python lists and numbers _scores checks
        value = value.tolist() if isinstance(value, (np.ndarray, np.generic)) else value
        return [v.item() if isinstance(v, np.generic) else v for v in value] if isinstance(value, list) else value

    out = {str(k): plain(v) for k, v in body.items() if k != score_key and k != "scores"}
    out["scores"] = plain(body[score_key])
    return _scores(url, out, n, name, "images")


def _scores(url: str, body, n: int, name: str, kind: str) -> dict:
    if not isinstance(body, dict) or "scores" not in body:
        keys = sorted(body) if isinstance(body, dict) else type(body).__name__
        raise RemoteRewardError(f"{url}: malformed response: no 'scores' list (got {keys})")
    out = {}
    for key, value in body.items():
        is_numeric_list = isinstance(value, list) and all(_is_number(v) for v in value)
        if key == "scores":
            if not isinstance(value, list) or not is_numeric_list:
                raise RemoteRewardError(f"{url}: malformed response: 'scores' must be a list of numbers")
        elif not is_numeric_list:
            continue
        if len(value) != n:
            raise RemoteRewardError(f"{url}: malformed response: '{key}' has {len(value)} values for {n} {kind}")
        t = torch.tensor([float(v) for v in value], dtype=torch.float32)
        if key == "scores" and not all(math.isfinite(v) for v in t.tolist()):
            raise RemoteRewardError(f"{url}: malformed response: non-finite score")
        out["score" if key == "scores" else f"{name}/{key}"] = t
    return out


Protocol = Literal["json", "flow_grpo"]


def check_request(options: dict) -> None:
    """Request settings no call can use (a URL without its scheme, numbers out of range): raised at
    config time (`rewards.check_options`) and again in each call, where the URL may come from the
    environment."""
    url = options.get("url")
    if url is not None and not str(url).startswith(("http://", "https://")):
        raise ValueError(f"url must start with http:// or https://, got '{url}'")
    if (float(options.get("timeout_s", 60.0)) <= 0 or int(options.get("retries", 2)) < 0
            or float(options.get("backoff_s", 1.0)) < 0 or int(options.get("max_concurrency", 8)) < 1):
        raise ValueError("need timeout_s > 0, retries >= 0, backoff_s >= 0, max_concurrency >= 1")


def check_protocol(options: dict) -> None:
    """Config-time check (`rewards.check_options`): the request settings (`check_request`); the
    flow_grpo protocol answers with a pickle, loaded only when the user turned allow_pickle on; its
    other options need that protocol."""
    check_request(options)
    if options.get("protocol", "json") == "flow_grpo":
        if options.get("allow_pickle") is not True:
            raise ValueError("protocol flow_grpo answers with a pickle: set allow_pickle: true to unpickle it "
                             "(restricted to containers, numbers, strings and numpy arrays)")
    else:
        given = sorted({"allow_pickle", "score_key", "only_strict"} & set(options))
        if given:
            raise ValueError(f"{', '.join(given)} apply to protocol: flow_grpo only")


def remote_reward(
    images: torch.Tensor,
    prompts: list,
    metadata: list,
    *,
    url: Optional[str] = None,
    timeout_s: float = 60.0,
    retries: int = 2,
    backoff_s: float = 1.0,
    headers: Optional[dict] = None,
    name: str = "remote",
    env: str = ENV_REMOTE,
    max_concurrency: int = 8,
    protocol: Protocol = "json",
    allow_pickle: bool = False,
    score_key: str = "scores",
    only_strict: bool = True,
) -> dict:
    """POST the batch (images [n, H, W, 3] or videos [n, F, H, W, 3]) to `url`; returns
    {"score": [n], "<name>/<component>": [n], ...}, one value per image or video."""
    url = url or os.environ.get(env)
    if not url:
        raise RemoteRewardError(f"{name}: no URL given: set reward.options.{name}.url or ${env}")
    try:
        check_request(dict(url=url, timeout_s=timeout_s, retries=retries, backoff_s=backoff_s,
                           max_concurrency=max_concurrency))
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None
    if protocol not in ("json", "flow_grpo"):
        raise ValueError(f"{name}: protocol must be json or flow_grpo, got {protocol!r}")
    if protocol == "flow_grpo" and allow_pickle is not True:
        raise RemoteRewardError(f"{name}: protocol flow_grpo answers with a pickle: set reward.options.{name}.allow_pickle=true")
    n, kind = images.shape[0], _kind(images)
    if len(prompts) != n or len(metadata) != n:
        raise ValueError(f"{name}: {len(prompts)} prompts / {len(metadata)} metadata for {n} {kind}")
    if protocol == "flow_grpo" and kind == "videos":
        raise ValueError(f"{name}: protocol flow_grpo sends images; videos go over the json protocol")
    if n == 0:
        return {"score": torch.zeros(0)}
    post = functools.partial(_post, str(url), timeout_s=float(timeout_s), retries=int(retries), backoff_s=float(backoff_s),
                             max_concurrency=int(max_concurrency))
    if protocol == "flow_grpo":
        pickled = {"Content-Type": "application/octet-stream", "Accept": "*/*"}
        raw = post(_flow_grpo_payload(images, metadata, only_strict), {**pickled, **dict(headers or {})})
        return _parse_flow_grpo(str(url), raw, n, name, str(score_key))
    raw = post(_payload(images, prompts, metadata), dict(headers or {}))
    return _parse(str(url), raw, n, name, kind)


def remote(
    images, prompts, metadata, *, url=None, timeout_s=60.0, retries=2, backoff_s=1.0, headers=None, name="remote",
    max_concurrency=8, protocol: Protocol = "json", allow_pickle=False, score_key="scores", only_strict=True,
) -> dict:
    """Generic HTTP reward: url from the option or $ASYNC_FLOWGRPO_REMOTE_URL; components "<name>/<key>"."""
    return remote_reward(
        images, prompts, metadata, url=url, timeout_s=timeout_s, retries=retries, backoff_s=backoff_s,
        headers=headers, name=name, env=ENV_REMOTE, max_concurrency=max_concurrency, protocol=protocol,
        allow_pickle=allow_pickle, score_key=score_key, only_strict=only_strict,
    )


def ocr(images, prompts, metadata, *, url=None, timeout_s=60.0, retries=2, backoff_s=1.0, headers=None,
        max_concurrency=8, protocol: Protocol = "json", allow_pickle=False, score_key="scores", only_strict=True) -> dict:
    """An OCR reward server: url from the option or $ASYNC_FLOWGRPO_OCR_URL."""
    return remote_reward(
        images, prompts, metadata, url=url, timeout_s=timeout_s, retries=retries, backoff_s=backoff_s,
        headers=headers, name="ocr", env=ENV_OCR, max_concurrency=max_concurrency, protocol=protocol,
        allow_pickle=allow_pickle, score_key=score_key, only_strict=only_strict,
    )


def geneval(images, prompts, metadata, *, url=None, timeout_s=60.0, retries=2, backoff_s=1.0, headers=None,
            max_concurrency=8, protocol: Protocol = "json", allow_pickle=False, score_key="scores", only_strict=True) -> dict:
    """A GenEval reward server: url from the option or $ASYNC_FLOWGRPO_GENEVAL_URL."""
    return remote_reward(
        images, prompts, metadata, url=url, timeout_s=timeout_s, retries=retries, backoff_s=backoff_s,
        headers=headers, name="geneval", env=ENV_GENEVAL, max_concurrency=max_concurrency, protocol=protocol,
        allow_pickle=allow_pickle, score_key=score_key, only_strict=only_strict,
    )


for _fn in (remote, ocr, geneval):
    _fn.check_options = check_protocol


def remote_video(videos, prompts, metadata, *, url=None, timeout_s=60.0, retries=2, backoff_s=1.0, headers=None,
                 name="remote_video", max_concurrency=8) -> dict:
    """A video reward server: each video's frames in the request, one score per video back; url
    from the option or $ASYNC_FLOWGRPO_REMOTE_VIDEO_URL."""
    if videos.dim() != 5:
        raise ValueError(f"{name}: takes videos [n, F, H, W, 3], got {list(videos.shape)}")
    return remote_reward(
        videos, prompts, metadata, url=url, timeout_s=timeout_s, retries=retries, backoff_s=backoff_s,
        headers=headers, name=name, env=ENV_REMOTE_VIDEO, max_concurrency=max_concurrency,
    )


remote_video.check_options = check_request
