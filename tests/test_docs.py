"""The docs cannot drift from the code: the generated config reference is current, every entry point
answers --help, and every command in a ```bash block of README.md and docs/*.md names a script or
module that exists, with flags it accepts and a config that load_config accepts. Fast: no training."""

from __future__ import annotations

import contextlib
import glob
import io
import os
import re
import runpy
import shlex
import subprocess
import sys
import warnings

import pytest

from async_flowgrpo import config_doc
from async_flowgrpo.config import MODES, load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))

LAUNCHERS = [f"launch/{m}.py" for m in MODES]
BENCHMARKS = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "benchmarks", "*.py"))
                    if not p.endswith("common.py"))
MODULES = ["async_flowgrpo.evaluation", "async_flowgrpo.config_doc", "async_flowgrpo.shapes.pretrain",
           "async_flowgrpo.shapes.evaluate", "async_flowgrpo.shapes.scenes", "async_flowgrpo.models.tiny_wan",
           "async_flowgrpo.rewards.serve"]
SCRIPTS = ["docs/make_schedules_figure.py"]


def bash_commands(path: str) -> list[list[str]]:
    """The `python ...` commands of a markdown file's ```bash blocks, continuation lines joined,
    comments and `&&` chains split off."""
    text = open(path, encoding="utf-8").read()
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            for part in line.split("&&"):
                words = shlex.split(part, comments=True)
                if words and words[0] in ("python", "python3") and words[1:3] != ["-m", "venv"]:
                    out.append(words[1:])
    return out


ALL_COMMANDS = [(os.path.relpath(p, ROOT), c) for p in DOCS for c in bash_commands(p)]


def test_config_reference_is_current():
    with open(os.path.join(ROOT, "docs", "config.md"), encoding="utf-8") as f:
        assert f.read() == config_doc.render(), "docs/config.md is stale: python -m async_flowgrpo.config_doc > docs/config.md"


def test_config_reference_describes_every_key():
    import dataclasses

    text = config_doc.render()

    def check(prefix, defaults):  # an algorithm's own section (algorithm.<name>) is a table of its own
        for field in dataclasses.fields(defaults):
            value = getattr(defaults, field.name)
            if dataclasses.is_dataclass(value):
                check(f"{prefix}.{field.name}", value)
            else:
                assert f"`{prefix}.{field.name}`" in text

    for section, cls in config_doc._sections():
        check(section, cls())


def _help_text(target: str, sub: tuple[str, ...] = ()) -> tuple[int, str]:
    """`python <target> --help` (or `python -m <target> --help`), run in this process: the heavy
    imports are already here, so the whole battery takes seconds."""
    argv, out = sys.argv, io.StringIO()
    sys.argv = [target, *sub, "--help"]
    cwd = os.getcwd()
    os.chdir(ROOT)
    code = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if target in MODULES:
                runpy.run_module(target, run_name="__main__", alter_sys=False)
            else:
                runpy.run_path(os.path.join(ROOT, target), run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = argv
        os.chdir(cwd)
    return code, out.getvalue()


def _help_texts() -> dict[str, tuple[int, str]]:
    return {t: _help_text(t) for t in LAUNCHERS + BENCHMARKS + MODULES + SCRIPTS}


@pytest.fixture(scope="module")
def help_texts():
    return _help_texts()


def test_every_entry_point_answers_help(help_texts):
    bad = {t: out[-300:] for t, (rc, out) in help_texts.items() if rc != 0 or "usage" not in out.lower()}
    assert not bad, bad


@pytest.mark.slow  # a fresh interpreter: about 5 s
def test_evaluation_cli_answers_help():
    """The end-to-end form of one of them (it once said: config error: --help: expected key=value)."""
    done = subprocess.run([sys.executable, "-m", "async_flowgrpo.evaluation", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: python -m async_flowgrpo.evaluation")


def test_doc_commands_exist_and_take_their_flags(help_texts):
    assert ALL_COMMANDS, "no ```bash commands found in the docs"
    for doc, words in ALL_COMMANDS:
        target = words[1] if words[0] == "-m" else words[0]
        if target == "pytest":
            continue
        assert target in help_texts, f"{doc}: `python {shlex.join(words)}`: {target} is not an entry point tests/test_docs.py knows"
        rc, usage = help_texts[target]
        rest = words[2:] if words[0] == "-m" else words[1:]
        if rest and re.fullmatch(r"[a-z][a-z_-]*", rest[0]) and "{" in usage:  # an argparse subcommand
            usage += _help_text(target, (rest[0],))[1]
        for flag in (w.split("=")[0] for w in words if w.startswith("--")):
            assert flag in usage, f"{doc}: `python {shlex.join(words)}`: {target} has no {flag}"


@pytest.fixture(scope="module")
def tiny_a14b_dir(tmp_path_factory):
    from async_flowgrpo.models.tiny_wan import make_tiny_wan_dir

    return make_tiny_wan_dir(str(tmp_path_factory.mktemp("tiny_a14b")), "wan22_a14b")


def tiny_wan_commands() -> dict[str, str]:
    """The directories the docs' `python -m async_flowgrpo.models.tiny_wan OUT [--variant V]` write: OUT -> V."""
    made = {}
    for _, words in ALL_COMMANDS:
        if words[:2] == ["-m", "async_flowgrpo.models.tiny_wan"] and "--help" not in words:
            rest = words[2:]
            variant = rest[rest.index("--variant") + 1] if "--variant" in rest else "wan21"
            positional = [w for i, w in enumerate(rest) if not w.startswith("-") and not (i and rest[i - 1] == "--variant")]
            made[positional[0]] = variant
    return made


def test_doc_launcher_commands_load(tiny_model_dir, tiny_a14b_dir, tmp_path_factory, monkeypatch):
    """A launcher (or evaluation) command's YAML files and overrides are a valid config. A model path
    that only exists on a GPU machine is swapped for the tiny test model (the two-expert twin for
    the two-expert preset, whose expert keys are checked against the model); one that a doc command
    writes with `async_flowgrpo.models.tiny_wan` is that twin, written here. The reward files the
    commands name (/models/...) are on the user's machine: loaded as for a joined cluster, where
    the config does not look for them."""
    from async_flowgrpo.models.tiny_wan import make_tiny_wan_dir

    monkeypatch.setenv("RAY_ADDRESS", "gpu-node:6379")

    twins = tiny_wan_commands()
    assert "outputs/tiny_ti2v" in twins  # (the README's image-to-video command: this check must see it)
    written: dict[str, str] = {}
    checked = 0
    for doc, words in ALL_COMMANDS:
        if words[0] in LAUNCHERS:
            mode, args = os.path.basename(words[0])[:-3], words[1:]
        elif words[:2] == ["-m", "async_flowgrpo.evaluation"]:
            mode, args = "fully_async", words[2:]
        else:
            continue
        if any(a in ("-h", "--help") for a in args):
            continue
        model_path = next((a.split("=", 1)[1] for a in args if a.startswith("model.path=")), None)
        args = [a for a in args if not a.startswith("model.path=")]
        if model_path in twins:
            variant = twins[model_path]
            if variant not in written:
                written[variant] = make_tiny_wan_dir(str(tmp_path_factory.mktemp(variant)), variant)
            args.append(f"model.path={written[variant]}")
        cwd = os.getcwd()
        os.chdir(ROOT)
        try:
            if any(a.startswith("config/model/") for a in args):
                two_experts = any(a.startswith("config/model/wan22_t2v_a14b") for a in args)
                args.append(f"model.path={tiny_a14b_dir if two_experts else tiny_model_dir}")
            load_config(mode, args)
        except Exception as e:  # noqa: BLE001 - the message names the command
            raise AssertionError(f"{doc}: `python {shlex.join(words)}`: {e}") from None
        finally:
            os.chdir(cwd)
        checked += 1
    assert checked >= 5


def test_test_and_install_commands_match_ci():
    ci = open(os.path.join(ROOT, ".ci", "run")).read()
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    test_command = next((line for line in ci.splitlines() if line.startswith("python -m pytest")), None)
    assert test_command and test_command in readme, f"the README's test command is not .ci/run's: {test_command}"
    for line in ("pip install torch==2.13.0", 'pip install -e ".[test]"'):
        assert line in readme
        assert line.replace("pip install ", "pip install -q ") in ci


def test_no_process_words():
    """The product cites dates and commits, not the working sessions or tracker issues that produced
    them: a target is stated in words."""
    hits = []
    for dirpath, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and not d.endswith(".egg-info") and d != "__pycache__"]
        for f in files:
            if f.endswith((".py", ".md", ".yaml", ".json", ".txt", ".cfg", ".toml")):
                path = os.path.join(dirpath, f)
                if os.path.getsize(path) > 5_000_000:
                    continue
                with open(path, encoding="utf-8", errors="replace") as fh:
                    for n, line in enumerate(fh, 1):
                        if re.search(r"session [0-9]|\bissues? [0-9]", line, flags=re.I):
                            hits.append(f"{os.path.relpath(path, ROOT)}:{n}")
    assert not hits, hits


def test_docs_link_to_files_that_exist():
    missing = []
    for path in DOCS:
        text = open(path, encoding="utf-8").read()
        for target in re.findall(r"\]\(([^)#:\s]+)(?:#[^)]*)?\)", text):
            if not os.path.exists(os.path.join(os.path.dirname(path), target)):
                missing.append(f"{os.path.relpath(path, ROOT)} -> {target}")
    assert not missing, missing
