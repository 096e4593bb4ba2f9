"""The reward services end to end: a fully_async launcher run on the embedded model scored by a
GenEval-style flow_grpo server (remote's flow_grpo protocol), a judge behind an OpenAI-compatible
endpoint (vlm_judge) and our own reward server (`python -m async_flowgrpo.rewards.serve`, reached by
`remote`), all local. The first two send every kind of bad answer at chosen requests; each fails its
group only, counted, and the run goes on to its last step with nothing lost."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("openai")
pytestmark = pytest.mark.slow  # a launcher run and three servers

from reward_servers import FakeFlowGrpoServer, FakeJudge, completion, geneval_answer  # noqa: E402
from test_remote_flow_grpo import FORBIDDEN_MODULE, forbidden_pickle  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": "1"}
STEPS, GROUPS_PER_STEP, GROUP_SIZE = 3, 2, 2
JUDGE_TIMEOUT_S = 3.0


def start_serve(env) -> tuple[subprocess.Popen, str]:
    """Our reward server with the embedded model's own reward (partial credit), on a free port."""
    proc = subprocess.Popen([sys.executable, "-m", "async_flowgrpo.rewards.serve", "shapes", "--option", "shapes.score=partial",
                             "--port", "0", "--batch-wait-s", "0.01"], stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    line = proc.stderr.readline()
    assert "serving shapes=1 on " in line, line
    threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep its log from filling the pipe
    return proc, line.split(" on ")[1].split()[0]


@pytest.mark.timeout(600)
def test_a_run_scored_by_three_reward_services_skips_each_bad_answers_group_and_finishes(tmp_path):
    env = {**ENV, "PYTHONPATH": os.pathsep.join([str(tmp_path), REPO, ENV.get("PYTHONPATH", "")])}  # the forbidden module importable everywhere
    # flow_grpo server: one request per group; requests 1, 3 and 5 get a broken answer
    bad_geneval = {1: pickle.dumps({"scores": [0.5] * GROUP_SIZE})[:-5], 3: forbidden_pickle(tmp_path),
                   5: pickle.dumps({"scores": [0.5] * (GROUP_SIZE + 1)})}
    geneval = FakeFlowGrpoServer(lambda request, i: bad_geneval.get(i) or geneval_answer(request))

    # judge: one request per image of the groups GenEval scored; 4 apart, so no two land in one group
    def judge_answer(request, i):
        if i == 1:
            return completion("I cannot rate this.")
        if i == 5:
            return completion("Score: 11")
        if i == 9:
            return 500
        if i == 13:
            time.sleep(JUDGE_TIMEOUT_S + 2)
        return completion("Score: 7")

    judge = FakeJudge(judge_answer)
    serve, serve_url = start_serve(env)
    out = tmp_path / "run"
    args = [
        "reward.weights={geneval: 0.5, vlm_judge: 0.5, remote: 1.0}",
        f"reward.options.geneval={{url: '{geneval.url}', protocol: flow_grpo, allow_pickle: true, retries: 0}}",
        f"reward.options.vlm_judge={{base_url: '{judge.base_url}', model: judge, retries: 0, timeout_s: {JUDGE_TIMEOUT_S}}}",
        f"reward.options.remote={{url: '{serve_url}', retries: 0}}",
        "reward.max_consecutive_failures=20",
        f"rollout.group_size={GROUP_SIZE}", f"rollout.groups_per_step={GROUPS_PER_STEP}", "rollout.num_steps=4",
        "rollout.sde_window_size=1", "rollout.sde_window_range=null", "rollout.cpus_per_worker=0.25",
        "trainer.cpus_per_worker=0.25", "trainer.micro_batch_size=8", f"trainer.total_steps={STEPS}", "trainer.sample_every=0",
        "trainer.checkpoint_every=0", f"trainer.output_dir={out}", "eval.every=0", "eval.at_start_and_end=false",
        "logging.progress=false", "sync.timeout_s=120", "ray.num_cpus=2",
    ]
    try:
        proc = subprocess.run([sys.executable, os.path.join(REPO, "launch", "fully_async.py"), *args], capture_output=True,
                              text=True, timeout=540, env=env, cwd=REPO)
    finally:
        serve.terminate()
        serve.wait(timeout=30)
        geneval.close()
        judge.close()
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    last = rows[-1]
    assert last["step"] == STEPS and last["samples/consumed"] == STEPS * GROUPS_PER_STEP * GROUP_SIZE
    assert last["rollout/lost_groups"] == 0
    # every bad answer was sent and each skipped exactly its own group
    bad_sent = sum(i < geneval.count for i in bad_geneval) + sum(i < judge.count for i in (1, 5, 9, 13))
    assert bad_sent == 7, (geneval.count, judge.count)
    assert last["rewards/skipped_groups"] == bad_sent
    # the three rewards and the servers' components reached the metrics; the judge's 7/10 everywhere
    for key in ("reward/geneval", "reward/vlm_judge", "reward/remote", "reward/geneval/rewards", "reward/remote/shapes"):
        assert key in last, sorted(k for k in last if k.startswith("reward/"))
    assert all(abs(r["reward/vlm_judge"] - 0.7) < 1e-6 for r in rows)
    assert not (tmp_path / "imported").exists()  # the forbidden class was never imported, in any process
    assert FORBIDDEN_MODULE not in sys.modules
