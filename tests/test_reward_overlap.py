"""Rewards scored while the next group generates (reward.overlap), end to end on Ray with the tiny
model: the same rewards as the blocking path, and the failure semantics kept (a failed, timed-out
or lost score skips its group, counted, never trained on, never scored twice; a stop with groups
waiting for a score loses nothing a resume cannot regenerate). A reward service's every kind of bad
answer (NaN, inf, a wrong number of scores, a hang, a lost worker) is one run per mode here; a
reward that raises inside the rollout, and rewards that fail until the run stops, run in
tests/test_run.py, whose runs take the overlap default."""

import json
import os
import signal
import threading
import time

import psutil
import pytest

from async_flowgrpo import checkpoint
from async_flowgrpo.driver.run import Run, checkpointer
from async_flowgrpo.modes import run
from async_flowgrpo.stop import Stopped

from test_run import prompt_file, read_metrics, small_config  # noqa: F401  (prompt_file: a fixture)


def scoring_server(handle):
    """A local reward service: POST {"prompts": [...]} -> {"scores": handle(prompts, client port)}."""
    import http.server

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            scores = handle(body["prompts"], self.client_address[1])
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(json.dumps({"scores": scores}).encode())

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/score"


def remote(url, *extra):
    return ("reward.weights={remote: 1.0}", f"reward.options={{remote: {{url: '{url}', retries: 0}}}}", *extra)


def test_sync_gives_the_same_rewards_step_for_step_with_overlap_on_and_off(ray_cluster, tiny_model_dir, prompt_file, tmp_path):
    rows = {}
    for overlap in ("true", "false"):
        out = str(tmp_path / overlap)
        run(small_config("sync", tiny_model_dir, prompt_file, out, f"reward.overlap={overlap}", "trainer.total_steps=3"))
        rows[overlap] = read_metrics(out)
    for key in ("reward/mean", "reward/std", "loss/policy"):
        assert [r[key] for r in rows["true"]] == [r[key] for r in rows["false"]], key
    assert len({r["reward/mean"] for r in rows["true"]}) > 1  # the rewards moved: the comparison means something
    for r in rows["true"]:
        assert r["reward/pending"] == 0 and r["reward/latency_s"] > 0 and 0 <= r["perf/reward_wait_frac"] <= 1


# What the reward service of the next test does with each prompt's groups
MISBEHAVING = {"a blue square": "NaN", "a red circle": "an inf", "a red square": "one score short",
               "a green circle": "hangs past reward.timeout_s once", "a green square": "kills the reward actor once"}
WELL_SCORED = ["a blue circle", "a red triangle", "a blue triangle"]


@pytest.mark.parametrize("mode", ["sync", "fully_async"])
def test_a_reward_service_answering_nan_inf_too_few_scores_hanging_or_losing_its_worker_skips_those_groups_only(
        ray_cluster, tiny_model_dir, tmp_path, mode):
    """reward.num_workers=1, reward.timeout_s=3 (MISBEHAVING): NaN, an inf or one score short for a
    prompt's every group; a hang past the timeout (the pool kills the actor) and the reward actor's
    process killed mid-call, each the first time only: the actor comes back for the next groups.
    Each failed group is skipped and counted, the run goes on, only well-scored groups are trained
    on (no NaN, inf or 1.0 reaches a batch), no group is sent for scoring twice, and the rollout
    actor never restarts. (One run per mode for what were three: starting the actors is most of a
    run's cost.)"""
    requests, killed = [], []

    def handle(prompts, client_port):
        prompt, n = prompts[0], len(prompts)
        first = prompt not in requests
        requests.append(prompt)
        kind = MISBEHAVING.get(prompt, "")
        if kind == "NaN":
            return [float("nan")] * n
        if kind == "an inf":
            return [float("inf")] + [1.0] * (n - 1)
        if kind == "one score short":
            return [1.0] * (n - 1)
        if kind.startswith("hangs") and first:
            time.sleep(8)
        if kind.startswith("kills") and first:
            pid = next(c.pid for c in psutil.net_connections("tcp")
                       if c.pid and c.laddr == ("127.0.0.1", client_port) and c.raddr and c.raddr[1] == server_port[0])
            killed.append(pid)
            os.kill(pid, signal.SIGKILL)
        return [0.5] * n

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join([*MISBEHAVING, *WELL_SCORED]) + "\n")
    server, url = scoring_server(handle)
    server_port = [server.server_address[1]]
    per_step = 8 if mode == "sync" else 4  # sync: every prompt once a step
    try:
        run(small_config(mode, tiny_model_dir, str(prompts), str(tmp_path / "run"), "trainer.total_steps=2",
                         f"rollout.groups_per_step={per_step}", "reward.num_workers=1", "reward.cpus_per_worker=0.1",
                         "reward.timeout_s=3", "reward.max_consecutive_failures=50", *remote(url)))
    finally:
        server.shutdown()
    rows = read_metrics(str(tmp_path / "run"))
    last = rows[-1]
    assert killed and len(rows) == 2 and last["rollout/restarts"] == 0  # the reward actor died, not the rollout
    assert last["rewards/errors"] >= 5 and last["rewards/skipped_groups"] == last["rewards/errors"]
    assert all(r["reward/mean"] == 0.5 for r in rows)  # no NaN, inf or 1.0 reached a batch
    assert last["samples/consumed"] == sum(r["samples/trained"] for r in rows)
    if mode == "sync":  # 2 steps x 8 groups, each sent at most once (not at all while the actor was down);
        # the first step loses its 5 misbehaving groups, the second the 3 that misbehave every time
        assert len(requests) <= 16 and all(requests.count(p) <= 2 for p in MISBEHAVING)
        assert last["rewards/errors"] >= 8
        assert last["samples/consumed"] == (16 - last["rewards/errors"]) * 2
    else:  # every batch full of well-scored groups
        assert last["samples/consumed"] == 2 * 4 * 2


def test_a_reward_actor_scores_groups_of_two_rollout_workers_in_one_request(ray_cluster, tiny_model_dir, prompt_file, tmp_path):
    """reward.batch_size: groups that reach the reward actor together go out as one request (up to
    batch_size images); every group is scored once and trained."""
    sizes = []
    server, url = scoring_server(lambda prompts, _: sizes.append(len(prompts)) or [0.5] * len(prompts))
    try:
        run(small_config("sync", tiny_model_dir, prompt_file, str(tmp_path), "trainer.total_steps=2", "rollout.groups_per_step=4",
                         "rollout.num_workers=2", "reward.num_workers=1", "reward.cpus_per_worker=0.1",
                         "reward.batch_size=4", "reward.batch_wait_s=1.0", *remote(url)))
    finally:
        server.shutdown()
    rows = read_metrics(str(tmp_path))
    assert max(sizes) == 4 and sum(sizes) == 2 * 4 * 2  # two groups of 2 images per request; each image once
    assert rows[-1]["samples/consumed"] == 2 * 4 * 2 and rows[-1]["rewards/errors"] == 0


def test_a_stop_with_groups_waiting_for_a_score_loses_and_repeats_nothing(
        ray_cluster, tiny_model_dir, prompt_file, tmp_path, monkeypatch):
    """fully_async with a slow reward (0.4 s a group, longer than the tiny model takes to generate
    one): at a stop, groups handed to scoring are in flight, listed in the checkpoint and
    regenerated by the resumed run, whose counts are exact; staleness stays within the bound."""
    server, url = scoring_server(lambda prompts, _: time.sleep(0.4) or [0.5] * len(prompts))
    original = Run.end_step

    def end_step(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if self.step == 2:
            self.stop.request(signal.SIGTERM)

    out = str(tmp_path)
    try:
        monkeypatch.setattr(Run, "end_step", end_step)
        cfg = small_config("fully_async", tiny_model_dir, prompt_file, out, "trainer.total_steps=6",
                           "trainer.checkpoint_every=0", *remote(url))
        with pytest.raises(Stopped):
            run(cfg)
        path, _ = checkpointer(cfg).find("latest")
        stopped_at = int(os.path.basename(path).split("_")[1])
        saved = checkpoint.load(path)["queue"]
        assert saved["in_flight_tickets"]  # generated or being scored at the stop: regenerated on resume
        monkeypatch.undo()
        run(small_config("fully_async", tiny_model_dir, prompt_file, out, f"trainer.total_steps={stopped_at + 2}",
                         "trainer.checkpoint_every=0", "trainer.resume=latest", *remote(url)))
    finally:
        server.shutdown()
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(1, stopped_at + 3))
    last = rows[-1]
    assert last["samples/consumed"] == 4 * (stopped_at + 2)
    assert last["groups/produced"] == last["groups/consumed"] + last["groups/dropped_stale"] + last["queue/size"]
    assert all(r["staleness/max"] <= 1 for r in rows)
    assert any(r["reward/latency_s"] >= 0.4 for r in rows)
