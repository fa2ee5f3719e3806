"""Elastic restarts, measured: examples/elastic_finetune.py under `torchrun --max-restarts 1`
(or scripts/multinode.sh, --nodes 2), once uninterrupted and then in TRIALS runs where one
random rank is killed with SIGKILL at a random point (after a random step, a random 0-2 of the
victim's mean step times later: in the next step or its save). Each trial must end with status
0 and final weights bit-identical to the uninterrupted run's; reported per trial: the rank, the
point, the seconds from the kill until every rank of the new group has resumed from its
checkpoint (target <= 30 s), and the step it resumed at.

    .venv/bin/python scripts/elastic_trials.py [--trials 10] [--nproc 2] [--nodes 1] [--steps 12]
        [--save-every 3] [--seed 0] [--node-local] [--json runs/elastic/trials.json]

make elastic-trials runs it (under the heavy-run lock: 10 trials take about 8 minutes here).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(REPO, "examples", "elastic_finetune.py")
LINE = re.compile(
    r"elastic: rank (\d+) attempt (\d+) (?:pid (\d+) at step (\d+)|done step (\d+)).*? t=(\d+\.\d{3})"
)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(args, work: str) -> list[str]:
    os.makedirs(os.path.join(work, "nvme"), exist_ok=True)
    script = [EXAMPLE, "--nvme", os.path.join(work, "nvme"), "--save", os.path.join(work, "ckpt"),
              "--out", os.path.join(work, "out"), "--steps", str(args.steps), "--save-every", str(args.save_every),
              "--batch", str(args.nproc * args.nodes * 2)]  # fmt: skip
    if args.nodes > 1:  # each node its own swap folder at the same path; the checkpoints shared,
        # or with --node-local each node's own too
        binds = ["--bind", os.path.join(work, "nvme")]
        if args.node_local:
            binds += ["--bind", os.path.join(work, "ckpt")]
            script.append("--node-local")
        return [os.path.join(REPO, "scripts", "multinode.sh"), "--nodes", str(args.nodes), "--nproc-per-node",
                str(args.nproc), "--root", os.path.join(work, "nodes"), *binds,
                "--max-restarts", "1", "--", *script]  # fmt: skip
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    # A c10d rendezvous, not the static one --master_port gives: a static group restarted reuses
    # the agent's store, where the first attempt's gloo addresses are still written, and the new
    # ranks may connect to the dead ones' ports ("connectFullMesh failed ... Connection refused").
    return [torchrun, "--nproc_per_node", str(args.nproc), "--max-restarts", "1", "--rdzv_backend", "c10d",
            "--rdzv_endpoint", f"127.0.0.1:{_port()}", *script]  # fmt: skip


class Run:
    """One job, its output parsed as it comes: each rank's pid and start per attempt, its steps."""

    def __init__(self, cmd: list[str], log_path: str):
        env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
        env.setdefault("OMP_NUM_THREADS", "1")
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)  # fmt: skip
        self.starts: dict[tuple[int, int], tuple[int, int, float]] = {}  # (attempt, rank): (pid, step, t)
        self.done: dict[tuple[int, int], tuple[int, float]] = {}  # (attempt, rank): (last step, t)
        self.cond = threading.Condition()
        self.ended = False
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.log.write(line)
            for m in LINE.finditer(line):  # (two ranks' lines may share one)
                self._note(*m.groups())
        with self.cond:  # (the job's output ended: whoever waits for a line waits no more)
            self.ended = True
            self.cond.notify_all()

    def _note(self, rank, attempt, pid, start, done, t) -> None:
        with self.cond:
            key = (int(attempt), int(rank))
            if pid is not None:
                self.starts[key] = (int(pid), int(start), float(t))
            else:
                self.done[key] = (int(done), float(t))
            self.cond.notify_all()

    def wait_for(self, pred, timeout: float) -> bool:
        """pred() came true, or the job's output ended first (False then), or the timeout."""
        with self.cond:
            return self.cond.wait_for(lambda: pred() or self.ended, timeout) and pred()

    def finish(self, timeout: float) -> int:
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            rc = self.proc.wait()
        self._reader.join(10)
        self.log.close()
        return rc


def weights(work: str) -> dict:
    import torch

    return torch.load(os.path.join(work, "out", "weights.pt"))


def identical(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def trial(args, work: str, rng: random.Random, world: int) -> dict:
    run = Run(command(args, work), os.path.join(work, "log.txt"))
    victim = rng.randrange(world)
    after = rng.randrange(1, args.steps)  # kill after this step is done...
    # ...and a random fraction of two of its steps later (the next step, or into a save): a
    # fixed 0-1 s put most kills past the last checkpoint of a job whose steps take 0.1-0.3 s
    frac = rng.uniform(0.0, 2.0)
    out = {"rank": victim, "after_step": after}
    if not run.wait_for(lambda: run.done.get((0, victim), (0, 0))[0] >= after, args.timeout):
        out["error"] = "the rank never reached the step"
    else:
        step_s = (run.done[(0, victim)][1] - run.starts[(0, victim)][2]) / run.done[(0, victim)][0]
        out["delay_s"] = round(frac * step_s, 3)
        time.sleep(out["delay_s"])
        pid = run.starts[(0, victim)][0]
        t_kill = time.time()
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:  # (it had ended already)
            pass
        back = lambda: all((1, r) in run.starts for r in range(world))  # noqa: E731
        if run.wait_for(back, args.timeout):
            out["restart_s"] = round(max(run.starts[(1, r)][2] for r in range(world)) - t_kill, 2)
            out["resumed_at"] = run.starts[(1, 0)][1]
        else:
            out["restart_s"] = out["resumed_at"] = None
    out["rc"] = run.finish(args.timeout)
    # A kill that lands once the victim's work is done (after the last step, in its exit) makes
    # no restart: the job ends as if untouched. Such a trial tests nothing and is drawn again.
    out["landed"] = out.get("restart_s") is not None or out["rc"] != 0 or "error" in out
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--nproc", type=int, default=2, help="ranks per node")
    ap.add_argument("--nodes", type=int, default=1, help="> 1: simulated nodes (scripts/multinode.sh)")
    ap.add_argument(
        "--node-local", action="store_true", help="(--nodes > 1) checkpoints on each node's own disk"
    )
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--save-every", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=180.0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--keep", action="store_true", help="keep the runs' folders (logs, checkpoints)")
    args = ap.parse_args(argv)
    world = args.nproc * args.nodes
    rng = random.Random(args.seed)
    root = tempfile.mkdtemp(prefix="offloadpp-elastic-")
    try:
        base = os.path.join(root, "uninterrupted")
        os.makedirs(base)
        t0 = time.time()
        rc = Run(command(args, base), os.path.join(base, "log.txt")).finish(args.timeout)
        if rc != 0:
            print(f"the uninterrupted run failed ({rc}): {base}/log.txt", file=sys.stderr)
            print(open(os.path.join(base, "log.txt")).read()[-4000:], file=sys.stderr)
            return 1
        want = weights(base)
        print(f"uninterrupted: {args.steps} steps, {world} ranks, {time.time() - t0:.1f} s")
        results = []
        print(f"{'trial':>5} {'rank':>4} {'after':>5} {'delay s':>7} {'restart s':>9} {'resumed':>7} "
              f"{'rc':>3} identical")  # fmt: skip
        i, redrawn = 0, []
        while len(results) < args.trials:
            work = os.path.join(root, f"trial{i}")
            os.makedirs(work)
            r = trial(args, work, rng, world)
            i += 1
            if not r["landed"]:
                print(f"(drawn again: rank {r['rank']} killed {r.get('delay_s')} s after step {r['after_step']} had "
                      "finished its work, no restart)", flush=True)  # fmt: skip
                redrawn.append(r)
                shutil.rmtree(work, ignore_errors=True)
                continue
            r["identical"] = r["rc"] == 0 and identical(weights(work), want)
            results.append(r)
            print(f"{len(results) - 1:>5} {r['rank']:>4} {r['after_step']:>5} {str(r.get('delay_s')):>7} {str(r.get('restart_s')):>9} "
                  f"{str(r.get('resumed_at')):>7} {r['rc']:>3} {r['identical']}", flush=True)  # fmt: skip
            if not r["identical"]:
                print(open(os.path.join(work, "log.txt")).read()[-6000:], file=sys.stderr)
            if not args.keep:
                shutil.rmtree(work, ignore_errors=True)
        times = [r["restart_s"] for r in results if r.get("restart_s") is not None]
        ok = sum(r["identical"] for r in results)
        summary = {"trials": args.trials, "completed_identical": ok, "world": world, "nodes": args.nodes,
                   "restart_s_median": statistics.median(times) if times else None,
                   "restart_s_max": max(times) if times else None, "results": results, "redrawn": redrawn}  # fmt: skip
        print(
            f"{ok}/{args.trials} completed with bit-identical weights; kill to restart "
            f"median {summary['restart_s_median']} s, max {summary['restart_s_max']} s (target <= 30 s)"
        )
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(summary, f, indent=1)
        return 0 if ok == args.trials and all(t <= 30 for t in times) else 1
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
