"""Serve registered rewards over HTTP, in the `remote` reward's JSON protocol (remote.py), so a
reward runs in its own environment (GenEval's mmdet stack) or on its own GPU node, and the
trainer's `remote` reward points at it.

    python -m async_flowgrpo.rewards.serve pickscore --port 8000 \\
        --option pickscore.path=/models/PickScore_v1 --option pickscore.processor_path=/models/CLIP-ViT-H-14
    python -m async_flowgrpo.rewards.serve mypkg.rewards:my_reward=1.0 jpeg_compressibility=0.1 --port 8000

    # the trainer:
    python launch/fully_async.py 'reward.weights={remote: 1.0}' reward.options.remote.url=http://host:8000/score

A reward is a registered name or `module:function` (a callable taking images [n, H, W, 3] uint8,
prompts and metadata; imported here), optionally `=weight` (default 1); several are summed by
weight as in the trainer. `--option NAME.KEY=VALUE` sets a reward's keyword option (the value read
as YAML: numbers, booleans, lists).

Routes:
    POST / or /score   the remote protocol's request -> {"scores": [n], "<reward>": [n], ...}
                       (an edit model's "source_images" reach the reward as in process, in its metadata)
    GET /health        {"status": "ok", "rewards": {...}, "requests": n, "batches": n, "bad_requests": n, "failed": n}

Requests that arrive at about the same time (from many rollout workers) are scored in one call of
each reward (`Batcher`: up to --batch-size images, or --batch-wait-s after the first arrived), and
each gets its own scores back; requests with images of another size go to batches of their own. A
bad request (not JSON, a missing field, counts that do not match, an undecodable image, too large)
gets a 4xx with one line; a reward failing on a batch answers 500 with one line to each of its
requests (the client retries, a bounded number of times). The server goes on either way.
"""

from __future__ import annotations

import argparse
import binascii
import importlib
import json
import logging
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from async_flowgrpo.conditioning import SOURCE_IMAGES
from async_flowgrpo.rewards import CombinedReward, RewardError, register_reward
from async_flowgrpo.rewards.batching import Batcher
from async_flowgrpo.rewards.remote import decode_png

logger = logging.getLogger(__name__)


class BadRequest(ValueError):
    """The request cannot be scored as sent: answered 4xx, one line."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def parse_request(body: bytes) -> tuple[torch.Tensor, list, list]:
    """The remote protocol's request as (images [n, H, W, 3] or videos [n, F, H, W, 3] uint8, prompts, metadata)."""
    try:
        request = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadRequest(f"body is not JSON: {e}") from None
    if not isinstance(request, dict):
        raise BadRequest(f"body must be a JSON object, got {type(request).__name__}")
    kinds = [k for k in ("images", "videos") if k in request]
    if len(kinds) != 1:
        raise BadRequest("body needs exactly one of 'images' (base64 PNGs) or 'videos' (lists of base64 PNG frames)")
    kind, samples = kinds[0], request[kinds[0]]
    prompts, metadata = request.get("prompts"), request.get("metadata")
    if not isinstance(samples, list) or not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise BadRequest(f"'{kind}' must be a list and 'prompts' a list of strings")
    if metadata is None:
        metadata = [{} for _ in samples]
    if not isinstance(metadata, list) or not all(isinstance(m, dict) for m in metadata):
        raise BadRequest("'metadata' must be a list of objects")
    if not len(samples) == len(prompts) == len(metadata):
        raise BadRequest(f"{len(samples)} {kind}, {len(prompts)} prompts and {len(metadata)} metadata: the counts must match")
    if not samples:
        raise BadRequest(f"no {kind} to score")
    try:
        if kind == "images":
            arrays = [torch.from_numpy(decode_png(s).copy()) for s in samples]
        else:
            arrays = [torch.stack([torch.from_numpy(decode_png(f).copy()) for f in video]) for video in samples]
    except (TypeError, ValueError, OSError, binascii.Error, RuntimeError) as e:  # not base64, not an image, an empty video
        raise BadRequest(f"an entry of '{kind}' is not a base64 PNG {'image' if kind == 'images' else 'frame list'}: {type(e).__name__}: {e}") from None
    shapes = {tuple(a.shape) for a in arrays}
    if len(shapes) != 1:
        raise BadRequest(f"the {kind} of one request must share a shape, got {sorted(shapes)}")
    if "source_images" in request:  # an edit model's inputs: back under the metadata key its reward reads
        sources = request["source_images"]
        if not isinstance(sources, list) or len(sources) != len(samples) or not all(isinstance(s, list) for s in sources):
            raise BadRequest(f"'source_images' must be a list of {len(samples)} lists of base64 PNGs")
        try:
            metadata = [{**m, SOURCE_IMAGES: [torch.from_numpy(decode_png(x).copy()) for x in s]} for m, s in zip(metadata, sources)]
        except (TypeError, ValueError, OSError, binascii.Error) as e:
            raise BadRequest(f"an entry of 'source_images' is not a base64 PNG: {type(e).__name__}: {e}") from None
    return torch.stack(arrays), prompts, metadata


class RewardService:
    """The scoring side, without HTTP: requests batched per sample shape, counters for /health."""

    def __init__(self, reward: CombinedReward, batch_size: int, batch_wait_s: float):
        self.reward, self.batch_size, self.batch_wait_s = reward, batch_size, batch_wait_s
        self._batchers: dict[tuple, Batcher] = {}
        self._lock = threading.Lock()
        self.counts = {"requests": 0, "batches": 0, "bad_requests": 0, "failed": 0}

    def count(self, key: str) -> None:
        with self._lock:
            self.counts[key] += 1

    def _batcher(self, shape: tuple) -> Batcher:
        with self._lock:
            if shape not in self._batchers:
                self._batchers[shape] = Batcher(self._score_batch, self.batch_size, self.batch_wait_s)
            return self._batchers[shape]

    def _score_batch(self, groups: list) -> list:
        self.count("batches")
        return self.reward.score_groups(groups)

    def score(self, samples: torch.Tensor, prompts: list, metadata: list) -> dict:
        """{"scores": [n], <component>: [n]}; raises RewardError when the reward failed on this request."""
        result = self._batcher(tuple(samples.shape[1:])).submit((samples, prompts, metadata), samples.shape[0])
        if isinstance(result, RewardError):
            raise result
        total, components = result
        return {"scores": total.tolist(), **{name: value.tolist() for name, value in components.items()}}

    def health(self) -> dict:
        with self._lock:
            return {"status": "ok", "rewards": dict(self.reward.weights), **self.counts}


def make_server(service: RewardService, host: str, port: int, max_request_mb: float) -> ThreadingHTTPServer:
    max_bytes = int(max_request_mb * 2**20)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _send(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode("utf-8")
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client gave up (its timeout); nothing to answer

        def _error(self, status: int, message: str) -> None:
            line = message.strip().splitlines()[0] if message.strip() else "error"
            self.close_connection = status >= 400 and status != 500  # an unread or oversized body: start clean
            self._send(status, {"error": line})

        def do_GET(self):
            if self.path.split("?")[0].rstrip("/") == "/health":
                self._send(200, service.health())
            else:
                self._error(404, f"no route GET {self.path}: GET /health, POST /score")

        def do_POST(self):
            if self.path.split("?")[0].rstrip("/") not in ("", "/score"):
                service.count("bad_requests")
                return self._error(404, f"no route POST {self.path}: POST /score")
            try:
                length = int(self.headers.get("Content-Length", ""))
            except ValueError:
                service.count("bad_requests")
                return self._error(411, "a Content-Length header is required")
            if length > max_bytes:
                service.count("bad_requests")
                return self._error(413, f"request of {length} bytes is over --max-request-mb ({max_request_mb:g} MiB)")
            service.count("requests")
            try:
                samples, prompts, metadata = parse_request(self.rfile.read(length))
                self._send(200, service.score(samples, prompts, metadata))
            except BadRequest as e:
                service.count("bad_requests")
                logger.warning("bad request from %s: %s", self.client_address[0], e)
                self._error(e.status, str(e))
            except Exception as e:  # the reward failed on this batch: this request fails, the server goes on
                service.count("failed")
                logger.warning("scoring failed: %s", str(e).splitlines()[0] if str(e) else type(e).__name__)
                self._error(500, str(e) if isinstance(e, RewardError) else f"{type(e).__name__}: {e}")

        def log_message(self, format, *args):
            logger.debug("%s " + format, self.client_address[0], *args)

    server = _Server((host, port), Handler)
    server.daemon_threads = True
    return server


class _Server(ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        """A client gone mid-request (its worker stopped, its timeout): one line, not socketserver's traceback."""
        error = sys.exc_info()[1]
        logger.warning("connection from %s ended: %s: %s", client_address[0], type(error).__name__, error)


def _reward_spec(spec: str) -> tuple[str, float]:
    """NAME or NAME=WEIGHT; a `module:function` name is imported and registered under that name."""
    name, _, weight = spec.rpartition("=") if "=" in spec else (spec, "", "1")
    try:
        weight = float(weight)
    except ValueError:
        raise ValueError(f"reward '{spec}': the weight after '=' must be a number") from None
    if ":" in name:
        module, _, attr = name.partition(":")
        try:
            fn = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"reward '{name}': cannot import {attr} from {module}: {e}") from None
        if not callable(fn):
            raise ValueError(f"reward '{name}': {module}.{attr} is not callable")
        register_reward(name, fn)
    return name, weight


def _option(text: str) -> tuple[str, str, object]:
    """NAME.KEY=VALUE, the value read as YAML."""
    import yaml

    lhs, eq, value = text.partition("=")
    name, dot, key = lhs.rpartition(".")
    if not eq or not dot or not name or not key:
        raise ValueError(f"--option '{text}': expected NAME.KEY=VALUE, e.g. pickscore.path=/models/PickScore_v1")
    try:
        return name, key, yaml.safe_load(value)
    except yaml.YAMLError as e:
        raise ValueError(f"--option '{text}': the value is not YAML: {str(e).splitlines()[0]}") from None


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m async_flowgrpo.rewards.serve", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    ap.add_argument("rewards", nargs="+", metavar="REWARD[=WEIGHT]", help="a registered reward or module:function")
    ap.add_argument("--option", action="append", default=[], metavar="NAME.KEY=VALUE", help="a reward's keyword option")
    ap.add_argument("--host", default="127.0.0.1", help="0.0.0.0 to serve other machines")
    ap.add_argument("--port", type=int, default=8000, help="0 = any free port (printed)")
    ap.add_argument("--batch-size", type=int, default=64, help="images per reward call at most (0: one request per call)")
    ap.add_argument("--batch-wait-s", type=float, default=0.05, help="how long the first request of a batch waits for more")
    ap.add_argument("--max-request-mb", type=float, default=512.0)
    ap.add_argument("--log-level", default="INFO")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(message)s")
    try:
        if args.batch_size < 0 or args.batch_wait_s < 0 or args.max_request_mb <= 0:
            raise ValueError("--batch-size and --batch-wait-s must be >= 0, --max-request-mb > 0")
        weights = dict(_reward_spec(spec) for spec in args.rewards)
        options: dict[str, dict] = {}
        for text in args.option:
            name, key, value = _option(text)
            options.setdefault(name, {})[key] = value
        reward = CombinedReward(weights, options)
        server = make_server(RewardService(reward, args.batch_size, args.batch_wait_s), args.host, args.port, args.max_request_mb)
    except (ValueError, KeyError, OSError) as e:  # a bad reward, option or address: one line, exit 2
        print(f"serve: {e.args[0] if isinstance(e, KeyError) else e}", file=sys.stderr)
        return 2
    host, port = server.server_address[:2]
    print(f"serving {', '.join(f'{n}={w:g}' for n, w in weights.items())} on http://{host}:{port}/score "
          f"(GET /health)", file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
