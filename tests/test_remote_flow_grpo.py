"""`remote` with protocol flow_grpo (the GenEval / OCR / DeQA reward servers users run) and the
restricted unpickler its answers go through."""

from __future__ import annotations

import io
import os
import pickle
import pickletools
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image
from reward_servers import FakeFlowGrpoServer, geneval_answer

from async_flowgrpo.config import ConfigError, load_config
from async_flowgrpo.rewards import CombinedReward, RewardError, get_reward
from async_flowgrpo.rewards.remote import RemoteRewardError, remote
from async_flowgrpo.rewards.safe_pickle import ForbiddenPickleError, restricted_loads

FORBIDDEN_MODULE = "af_forbidden_reward_module"


def _images(n=4, size=16):
    images = torch.zeros(n, size, size, 3, dtype=torch.uint8)
    for i in range(n):
        images[i, ..., 0] = 60 * i  # red level: what the fake GenEval server scores
    return images


def forbidden_pickle(tmp_path) -> bytes:
    """A pickle whose answer builds af_forbidden_reward_module.Evil: importing that module (put on
    sys.path here) would write a marker file, so the test can tell it was never imported."""
    (tmp_path / f"{FORBIDDEN_MODULE}.py").write_text(
        f"open({str(tmp_path / 'imported')!r}, 'w').close()\nclass Evil:\n    pass\n")
    # protocol 2: GLOBAL 'module name', EMPTY_TUPLE, NEWOBJ ... as pickle writes a class instance
    return b"\x80\x02}q\x00X\x06\x00\x00\x00scoresq\x01c" + FORBIDDEN_MODULE.encode() + b"\nEvil\nq\x02)\x81q\x03s."


@pytest.fixture
def flow_grpo_server():
    servers = []

    def make(answer):
        servers.append(FakeFlowGrpoServer(answer))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


def test_the_request_and_answer_are_the_flow_grpo_servers(flow_grpo_server):
    server = flow_grpo_server(lambda request, i: geneval_answer(request))
    images = _images()
    metadata = [{"tag": "single_object", "include": [{"class": "cup", "count": 1}]}] * 4
    out = get_reward("geneval", url=server.url, protocol="flow_grpo", allow_pickle=True, only_strict=False)(
        images, ["a cup"] * 4, metadata)
    assert torch.allclose(out["score"], torch.tensor([60 * i / 255 for i in range(4)]), atol=0.02)
    assert out["geneval/rewards"].tolist() == [1.0] * 4 and out["geneval/strict_rewards"].tolist() == [0.0] * 4
    assert not any("group" in k for k in out)  # per-tag dicts are not per image
    (request,) = server.requests
    assert set(request) == {"images", "meta_datas", "only_strict"} and request["only_strict"] is False
    assert request["meta_datas"] == metadata
    decoded = [Image.open(io.BytesIO(b), formats=["jpeg"]) for b in request["images"]]  # as the server opens them
    assert [im.size for im in decoded] == [(16, 16)] * 4
    assert server.headers[0]["content-type"] == "application/octet-stream"


def test_numpy_answers_and_another_score_key(flow_grpo_server):
    """DeQA answers {"outputs": ...}; a server may send numpy arrays or scalars."""
    server = flow_grpo_server(lambda request, i: pickle.dumps({"outputs": np.array([0.25, 0.5], dtype=np.float32),
                                                               "extra": [np.float64(1.0), np.int64(2)]}))
    out = get_reward("remote", url=server.url, protocol="flow_grpo", allow_pickle=True, score_key="outputs")(
        _images(2), ["x"] * 2, [{}] * 2)
    assert out["score"].tolist() == [0.25, 0.5] and out["remote/extra"].tolist() == [1.0, 2.0]


def test_unpickling_must_be_turned_on(flow_grpo_server):
    base = ["reward.weights={geneval: 1.0}", "reward.options.geneval.url=http://127.0.0.1:1/", "reward.options.geneval.protocol=flow_grpo"]
    with pytest.raises(ConfigError, match="reward.options.geneval: .*set allow_pickle: true"):
        load_config("sync", base)
    assert load_config("sync", base + ["reward.options.geneval.allow_pickle=true"]).reward.options["geneval"]["allow_pickle"] is True
    with pytest.raises(ConfigError, match="allow_pickle apply to protocol: flow_grpo only"):
        load_config("sync", ["reward.weights={geneval: 1.0}", "reward.options.geneval.allow_pickle=true"])
    server = flow_grpo_server(lambda request, i: geneval_answer(request))
    with pytest.raises(ValueError, match="set allow_pickle: true"):
        get_reward("remote", url=server.url, protocol="flow_grpo")
    with pytest.raises(RemoteRewardError, match="allow_pickle=true"):  # the function called directly, no registry
        remote(_images(1), ["x"], [{}], url=server.url, protocol="flow_grpo")
    assert not server.requests


@pytest.mark.parametrize("bad", ["truncated", "forbidden", "wrong_count", "http_500", "not_a_dict", "object_array"])
def test_each_bad_answer_fails_its_group_only_in_one_line(flow_grpo_server, tmp_path, monkeypatch, bad):
    monkeypatch.syspath_prepend(str(tmp_path))  # the forbidden module is importable: it must not be imported
    answers = {
        "truncated": pickle.dumps({"scores": [0.5] * 4})[:-7],
        "forbidden": forbidden_pickle(tmp_path),
        "wrong_count": pickle.dumps({"scores": [0.5] * 3}),
        "http_500": 500,
        "not_a_dict": pickle.dumps([0.5] * 4),
        "object_array": pickle.dumps({"scores": np.array([0.5, "x", 1, 2], dtype=object)}),
    }
    messages = {
        "truncated": "pickle: UnpicklingError: pickle data was truncated",
        "forbidden": f"pickle names {FORBIDDEN_MODULE}.Evil, which is not allowed",
        "wrong_count": "'scores' has 3 values for 4 images",
        "http_500": "failed after 2 attempt(s): HTTP 500",
        "not_a_dict": "no 'scores' list (got list)",
        "object_array": "numpy array of Python objects",
    }
    # the second group (its metadata says so) gets the bad answer, every attempt; groups 0 and 2 are scored
    server = flow_grpo_server(lambda request, i: answers[bad] if request["meta_datas"][0]["group"] == 1 else geneval_answer(request))
    reward = CombinedReward({"geneval": 1.0}, {"geneval": {"url": server.url, "protocol": "flow_grpo", "allow_pickle": True,
                                                           "retries": 1, "backoff_s": 0.01}})
    results = [reward.score_groups([(_images(), ["x"] * 4, [{"group": g}] * 4)])[0] for g in range(3)]
    assert isinstance(results[0], tuple) and isinstance(results[2], tuple)
    assert isinstance(results[1], RewardError)
    line = str(results[1])
    assert messages[bad] in line and len(line.splitlines()) == 1 and "geneval" in line, line
    assert not (tmp_path / "imported").exists() and FORBIDDEN_MODULE not in sys.modules


def test_restricted_unpickler_round_trips_plain_data_and_numpy_in_every_protocol():
    data = {"a": [1, 2.5, True, None, "s", b"b"], "t": (1, 2), "set": {1, 2}, "c": complex(1, 2),
            "arr": np.arange(6, dtype=np.float32).reshape(2, 3), "str_arr": np.array(["x", "yz"]),
            "scalars": [np.float64(1.5), np.int64(3), np.bool_(True), np.float32(2.0)], "nested": {"k": [{"v": 1}]}}
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        out = restricted_loads(pickle.dumps(data, protocol=protocol))
        assert out["a"] == data["a"] and out["t"] == (1, 2) and out["set"] == {1, 2} and out["c"] == complex(1, 2)
        assert np.array_equal(out["arr"], data["arr"]) and out["arr"].dtype == np.float32
        assert list(out["str_arr"]) == ["x", "yz"] and out["scalars"] == data["scalars"] and out["nested"] == data["nested"]


def test_restricted_unpickler_refuses_code_and_never_imports(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    refused = [pickle.dumps(os.system), pickle.dumps(subprocess.Popen), pickle.dumps(np.ma.array([1.0])),
               forbidden_pickle(tmp_path), pickle.dumps(np.array([1, "x"], dtype=object)),
               b"cos\nsystem\n(S'echo pwned'\ntR."]  # the classic exploit: os.system('echo pwned')
    for data in refused:
        with pytest.raises(ForbiddenPickleError) as e:
            restricted_loads(data)
        assert len(str(e.value).splitlines()) == 1
    assert not (tmp_path / "imported").exists() and FORBIDDEN_MODULE not in sys.modules
    # numpy 1 writes numpy.core.* (what a reward server on numpy 1 sends): accepted as numpy 2's numpy._core.*
    numpy1 = pickle.dumps(np.arange(3.0), protocol=2).replace(b"numpy._core.multiarray", b"numpy.core.multiarray")
    assert b"numpy.core.multiarray" in numpy1 and pickletools.dis(numpy1, out=io.StringIO()) is None
    assert restricted_loads(numpy1).tolist() == [0.0, 1.0, 2.0]
