"""kill -9 at random points inside a step and inside a save (at least 20 trials each): the newest
checkpoint `latest` names always loads, and the run resumed from it ends bit for bit where an
uninterrupted run ends. The killed processes are forked by a warm zygote (crash_worker.py)."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time

import crash_worker as W
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("deepspeed")

TRIALS = 20  # kills that land inside the phase, per kind


class Zygote:
    def __init__(self):
        here = os.path.dirname(os.path.abspath(__file__))
        # its own one-process group: not this process's (whose port is taken: initialize set it up)
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        }
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(here, "crash_worker.py"), "zygote"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=here, env=env,
        )  # fmt: skip
        line = self._answer()
        if line != "ready":
            raise RuntimeError(f"the crash test's zygote did not start: {line!r}")

    def _answer(self) -> str:
        """The next line the zygote meant for us (libraries print to stdout too)."""
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError("the crash test's zygote exited")
            if line.startswith("@@ "):
                return line[3:].strip()

    def ask(self, line: str) -> str:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def close(self) -> None:
        self.proc.stdin.write("quit\n")
        self.proc.stdin.flush()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def zygote():
    z = Zygote()
    yield z
    z.close()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run's final weights, and how long its steps and its saves take here."""
    n = torch.get_num_threads()
    root = str(tmp_path_factory.mktemp("reference"))
    times: list = []
    try:
        W.train(root, clip=1.0, times=times)
        start, want = W.resume(root, os.path.join(root, "nvme-resume"), clip=1.0)  # from after the last step
    finally:
        torch.set_num_threads(n)
    assert start == W.STEPS
    spans = {W.STEP: [], W.SAVE: []}
    for (p, t0), (_, t1) in zip(times, times[1:]):
        if p in spans:
            spans[p].append(t1 - t0)
    return want, {p: sorted(v)[len(v) // 2] for p, v in spans.items()}


def _kill_during(zygote: Zygote, root: str, target: int, nth: int, window_s: float, sig=signal.SIGKILL,
                 run: str = "run") -> tuple[int, int]:  # fmt: skip
    """Starts a training child, sends it `sig` U(0, window_s) after it entered phase `target` for
    the nth time; returns the phase it was in then (-1: it finished first; for SIGINT, the phase
    its KeyboardInterrupt was raised in, which may come after the mark) and its exit status."""
    os.makedirs(root)
    path = os.path.join(root, "marks")
    with open(path, "wb") as f:
        f.write(bytes(W.Marks.SIZE))
    marks = W.Marks(path)
    pid = int(zygote.ask(f"{run} {root} 1.0 {path}"))
    seen, last, at = 0, 0, -1
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        phase, count = marks.get()
        if count != last:
            last = count
            if phase == target:
                seen += 1
                if seen == nth:
                    time.sleep(random.uniform(0, window_s))
                    at = marks.get()[0]
                    os.kill(pid, sig)
                    break
        if phase == W.IDLE and count == 2 * (2 * W.STEPS + 1):  # every mark made: done
            break
        time.sleep(0.0002)
    status = int(zygote.ask(f"wait {pid}"))
    if sig == signal.SIGINT and at != -1:
        at = marks.landed()
    return at, status


@pytest.mark.parametrize("target", [W.STEP, W.SAVE], ids=["in-step", "in-save"])
def test_kill_minus_nine_then_resume_is_bit_identical(zygote, reference, tmp_path, target):
    want, phase_s = reference
    rng = random.Random(target)
    hits = 0
    n = torch.get_num_threads()
    try:
        for trial in range(3 * TRIALS):
            if hits >= TRIALS:
                break
            root = str(tmp_path / f"t{trial}")
            at, _ = _kill_during(
                zygote, root, target, nth=rng.randint(1, W.STEPS), window_s=0.9 * phase_s[target]
            )
            hits += at == target
            if not os.path.exists(os.path.join(root, "ckpt", "latest")):
                continue  # killed before the first checkpoint was named: nothing to resume
            start, got = W.resume(root, os.path.join(root, "nvme-resume"), clip=1.0)
            assert 0 <= start <= W.STEPS
            bad = [k for k in want if not torch.equal(got[k], want[k])]
            assert not bad, (
                f"trial {trial} (killed in phase {at}, resumed from step {start}): {bad[:3]} differ"
            )
            leftovers = [p for p in os.listdir(os.path.join(root, "ckpt")) if p.endswith(".partial")]
            assert len(leftovers) <= 1  # at most the save the kill interrupted
            shutil.rmtree(root, ignore_errors=True)
    finally:
        torch.set_num_threads(n)
    assert hits >= TRIALS, f"only {hits} kills landed inside the phase"


INT_TRIALS = 10  # Ctrl-C that lands inside the phase, per kind


@pytest.mark.parametrize("target", [W.STEP, W.SAVE], ids=["in-step", "in-save"])
def test_ctrl_c_exits_with_a_keyboard_interrupt_and_resumes_bit_identically(
    zygote, reference, tmp_path, target
):
    """SIGINT at random points inside a step and inside a save: the process ends with Python's
    KeyboardInterrupt (killed by SIGINT after a clean shutdown: the open engine is closed at exit),
    never torch's C++ abort (`terminate called ... c10::Error ... python_variable.cpp`, rc -6),
    and the newest tag resumes bit for bit."""
    want, phase_s = reference
    rng = random.Random(10 + target)
    hits = 0
    n = torch.get_num_threads()
    try:
        for trial in range(3 * INT_TRIALS):
            if hits >= INT_TRIALS:
                break
            root = str(tmp_path / f"t{trial}")
            at, status = _kill_during(zygote, root, target, nth=rng.randint(1, W.STEPS),
                                      window_s=0.9 * phase_s[target], sig=signal.SIGINT, run="runint")  # fmt: skip
            if at != target:
                shutil.rmtree(root, ignore_errors=True)
                continue
            hits += 1
            err = open(os.path.join(root, "stderr")).read()
            assert "terminate called" not in err and "c10::Error" not in err, err[-3000:]
            assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGINT, (status, err[-3000:])
            assert "KeyboardInterrupt" in err and "offloadpp: interrupted (KeyboardInterrupt)" in err, err[
                -3000:
            ]
            if not os.path.exists(os.path.join(root, "ckpt", "latest")):
                continue  # interrupted in the first save: nothing to resume
            start, got = W.resume(root, os.path.join(root, "nvme-resume"), clip=1.0)
            bad = [k for k in want if not torch.equal(got[k], want[k])]
            assert not bad, (
                f"trial {trial} (interrupted in phase {at}, resumed from step {start}): {bad[:3]} differ"
            )
            shutil.rmtree(root, ignore_errors=True)
    finally:
        torch.set_num_threads(n)
    assert hits >= INT_TRIALS, f"only {hits} interrupts landed inside the phase"
