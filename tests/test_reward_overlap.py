"""The reward-overlap runs (tests/reward_overlap_cases.py) in a pytest process of their own.

In the full suite, in-process, the first of them lost its Ray: the GCS that the module's cluster
fixture started died seconds after a second Ray session appeared in the same process, and Ray's
GCS client ended the whole pytest process with exit 1 a minute later, with no report. Alone the
module passes (7 tests, about 90 s). Until the cause is found, the cases run in a fresh process,
so that they are still checked and the rest of the suite still reports."""

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_reward_overlap_cases_pass_in_a_process_of_their_own():
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.join(HERE, "reward_overlap_cases.py")],
                          cwd=os.path.dirname(HERE), capture_output=True, text=True, timeout=840)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout.splitlines()[-1] and "failed" not in proc.stdout.splitlines()[-1]
