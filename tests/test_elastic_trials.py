"""scripts/elastic_trials.py's harness, on fake jobs (a few printed lines, no torch): a trial whose
kill lands after the victim finished its work makes no restart and is marked as not landed (it
is drawn again), without waiting out the timeout; a job killed and restarted is timed."""

from __future__ import annotations

import importlib.util
import os
import random
import sys
import textwrap
import time
from types import SimpleNamespace

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _harness():
    spec = importlib.util.spec_from_file_location(
        "elastic_trials", os.path.join(REPO, "scripts", "elastic_trials.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _fake_job(tmp_path, body: str) -> list[str]:
    """A job printing the example's lines: `say(rank, attempt, what)` (what: 'pid P at step S' or
    'done step N')."""
    script = tmp_path / "job.py"
    script.write_text(
        "import os, sys, time\n"
        "def say(rank, attempt, what):\n"
        "    sys.stdout.write(f'elastic: rank {rank} attempt {attempt} {what} t={time.time():.3f}\\n')\n"
        "    sys.stdout.flush()\n" + textwrap.dedent(body)
    )
    return [sys.executable, str(script)]


def _trial(mod, tmp_path, monkeypatch, body: str) -> tuple[dict, float]:
    cmd = _fake_job(tmp_path, body)
    monkeypatch.setattr(mod, "command", lambda args, work: cmd)
    args = SimpleNamespace(steps=2, timeout=60.0)
    t0 = time.time()
    out = mod.trial(args, str(tmp_path), random.Random(0), world=1)
    return out, time.time() - t0


def test_a_kill_after_the_job_ended_is_not_a_trial_and_does_not_wait_out_the_timeout(tmp_path, monkeypatch):
    """The victim's pid is a process that has already exited (the job is done): no restart
    comes; the trial returns as soon as the job's output ends and says the kill did not land."""
    mod = _harness()
    out, took = _trial(mod, tmp_path, monkeypatch, """
        import subprocess
        child = subprocess.Popen([sys.executable, '-c', 'pass']); child.wait()
        say(0, 0, f'pid {child.pid} at step 0')
        say(0, 0, 'done step 1'); say(0, 0, 'done step 2')
    """)  # fmt: skip
    assert out["landed"] is False and out["restart_s"] is None and out["rc"] == 0, out
    assert took < 20  # (the harness waited its 180 s timeout for a restart that could not come)


def test_a_killed_and_restarted_job_is_timed(tmp_path, monkeypatch):
    """The victim is the job's own child, killed while it runs; the job starts attempt 1."""
    mod = _harness()
    out, _ = _trial(mod, tmp_path, monkeypatch, """
        import subprocess
        child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])
        say(0, 0, f'pid {child.pid} at step 0')
        say(0, 0, 'done step 1')
        assert child.wait() == -9
        say(0, 1, f'pid {os.getpid()} at step 1')
        say(0, 1, 'done step 2')
    """)  # fmt: skip
    assert out["landed"] is True and out["restart_s"] is not None and out["resumed_at"] == 1, out
    assert 0 <= out["restart_s"] < 20 and out["rc"] == 0
