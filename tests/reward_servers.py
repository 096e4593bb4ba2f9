"""Local stand-ins for the reward services users run, for tests: an OpenAI-compatible chat endpoint
and the flow_grpo reward server (a pickle in, a pickle out). Each answers from a function the test
gives, so a test can send bad answers at chosen requests."""

from __future__ import annotations

import base64
import io
import json
import pickle
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

import numpy as np
from PIL import Image


class _Server:
    """A threaded local HTTP server; `handle(path, body bytes) -> (status, content type, bytes)`."""

    def __init__(self, handle: Callable[[str, bytes], tuple[int, str, bytes]]):
        self.requests: list = []
        self.headers: list = []
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with server.lock:
                    server.headers.append({k.lower(): v for k, v in self.headers.items()})
                status, ctype, data = handle(self.path, body)
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", ctype)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (its timeout)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()
        self.port = self.server.server_address[1]

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def completion(content: str, top_logprobs: list[tuple[str, float]] | None = None) -> dict:
    """A chat.completion body; top_logprobs [(token, logprob)] of the first reply token."""
    choice = {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop", "logprobs": None}
    if top_logprobs is not None:
        first = {"token": top_logprobs[0][0], "logprob": top_logprobs[0][1], "bytes": None,
                 "top_logprobs": [{"token": t, "logprob": lp, "bytes": None} for t, lp in top_logprobs]}
        choice["logprobs"] = {"content": [first]}
    return {"id": "chatcmpl-test", "object": "chat.completion", "created": 0, "model": "judge", "choices": [choice],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}


class FakeJudge(_Server):
    """POST /v1/chat/completions. `answer(request: dict, index: int) -> dict | int` gives the
    completion body, or an HTTP status to fail with; `delay_s` seconds before each answer."""

    def __init__(self, answer: Callable[[dict, int], dict | int], delay_s: float = 0.0):
        self.delay_s = delay_s
        self.count = 0

        def handle(path, body):
            request = json.loads(body)
            with self.lock:
                index = self.count
                self.count += 1
                self.requests.append(request)
            time.sleep(self.delay_s)
            out = answer(request, index)
            if isinstance(out, int):
                return out, "application/json", json.dumps({"error": {"message": f"injected {out}"}}).encode()
            return 200, "application/json", json.dumps(out).encode()

        super().__init__(handle)
        self.base_url = f"http://127.0.0.1:{self.port}/v1"


def request_images(request: dict) -> list[np.ndarray]:
    """The images of a chat request (data URLs), decoded."""
    out = []
    for part in request["messages"][-1]["content"]:
        if part["type"] == "image_url":
            data = part["image_url"]["url"].split(",", 1)[1]
            out.append(np.asarray(Image.open(io.BytesIO(base64.b64decode(data))).convert("RGB")))
    return out


class FakeFlowGrpoServer(_Server):
    """The flow_grpo reward server's protocol: `answer(request: dict, index) -> bytes | int` is the
    response body (normally pickle.dumps of a dict of lists) or an HTTP status. The request is
    unpickled here with plain pickle: it comes from our own client in the same test."""

    def __init__(self, answer: Callable[[dict, int], bytes | int]):
        self.count = 0

        def handle(path, body):
            request = pickle.loads(body)
            with self.lock:
                index = self.count
                self.count += 1
                self.requests.append(request)
            out = answer(request, index)
            if isinstance(out, int):
                return out, "text/plain", b"Traceback (most recent call last):\n  injected\nRuntimeError: injected"
            return 200, "application/octet-stream", out

        super().__init__(handle)
        self.url = f"http://127.0.0.1:{self.port}/"


def geneval_answer(request: dict) -> bytes:
    """What the GenEval server sends back: scores = the mean red level of each JPEG, and its other keys."""
    n = len(request["images"])
    scores = [float(np.asarray(Image.open(io.BytesIO(b)).convert("RGB"))[..., 0].mean() / 255) for b in request["images"]]
    return pickle.dumps({"scores": scores, "rewards": [1.0] * n, "strict_rewards": [0.0] * n,
                         "group_rewards": {"single_object": [1.0]}, "group_strict_rewards": {"single_object": [0.0]}})
