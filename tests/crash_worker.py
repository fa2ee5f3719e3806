"""The processes tests/test_crash.py kills: each trains a small model through offloadpp.initialize,
saving a checkpoint after every step, and says through a shared memory page where it is (in a
step, in a save) so that the test can land its kill -9 inside one or the other.

They are forked by a zygote (`python crash_worker.py zygote`): a process that imported torch,
transformers, DeepSpeed and offloadpp and ran a training step once, so a trial costs a fork
instead of an interpreter's start. The zygote runs torch on one thread only, so its children
inherit no thread pool (a fork must not copy one), and without tqdm's monitor thread (a fork
must not copy a lock some thread holds)."""

from __future__ import annotations

import os
import shutil
import time

IDLE, STEP, SAVE = 0, 1, 2
STEPS = 6


def warm_up() -> None:
    """What the first engine of a process pays once (imports, the I/O backend probe), paid in
    the fork server so that every killed child starts warm."""
    import tempfile

    import deepspeed.runtime.config  # noqa: F401
    import transformers.models.gpt2.modeling_gpt2  # noqa: F401

    import offloadpp.assemble  # noqa: F401
    import offloadpp.integrations.deepspeed.build  # noqa: F401
    import offloadpp.integrations.deepspeed.engine  # noqa: F401
    from offloadpp.io import IOConfig, resolve_backend

    with tempfile.TemporaryDirectory() as d:
        resolve_backend(IOConfig(), d)


def model():
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, n_positions=32, vocab_size=128,
                                  resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg)


def config(nvme: str, clip: float) -> dict:
    os.makedirs(nvme, exist_ok=True)
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": clip,
        "steps_per_print": 0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": nvme},
                              "offload_optimizer": {"device": "nvme", "nvme_path": nvme}},
        "offloadpp": {"enabled": True, "ssd_read_gbps": 1.0, "ssd_write_gbps": 1.0},  # no SSD probe at start
    }  # fmt: skip


def batch(i: int):
    import torch

    return torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1000 + i))


def step(engine, i: int) -> float:
    x = batch(i)
    loss = engine(input_ids=x, labels=x).loss
    engine.backward(loss)
    engine.step()
    return loss.item()


class Marks:
    """(phase, count, landed) in a 24-byte file the test maps too: written by the child at each
    change; `landed` is 1 + the phase a Ctrl-C was raised in (0: none yet)."""

    SIZE = 24

    def __init__(self, path: str):
        import mmap

        self._f = open(path, "r+b")
        self._m = mmap.mmap(self._f.fileno(), self.SIZE)

    def set(self, phase: int) -> None:
        import struct

        count = struct.unpack_from("<q", self._m, 8)[0]
        struct.pack_into("<qq", self._m, 0, phase, count + 1)

    def get(self) -> tuple[int, int]:
        import struct

        return struct.unpack_from("<qq", self._m, 0)

    def set_landed(self, phase: int) -> None:
        import struct

        struct.pack_into("<q", self._m, 16, phase + 1)

    def landed(self) -> int:
        """The phase the child's KeyboardInterrupt was raised in; -1: none was."""
        import struct

        return struct.unpack_from("<q", self._m, 16)[0] - 1


def note_where_interrupted(marks: Marks, e: KeyboardInterrupt) -> None:
    """Notes where a Ctrl-C's KeyboardInterrupt was raised: in the marked phase if offloadpp's
    code was on the stack (its traceback passes through the package), else IDLE. The mark alone
    cannot say: a signal sent while the child was marked in a step may be raised a moment later,
    after the step returned (in the test's own code, where the engine has nothing to report).
    Read from the traceback, not in a SIGINT handler of the test's own: the runtime holds Ctrl-C
    in a step's end only under Python's default handler (transaction.holding_interrupts), as a
    script run from a terminal has it."""
    import offloadpp

    pkg = os.path.dirname(offloadpp.__file__) + os.sep
    tb = e.__traceback__
    while tb is not None and not tb.tb_frame.f_code.co_filename.startswith(pkg):
        tb = tb.tb_next
    marks.set_landed(marks.get()[0] if tb is not None else IDLE)


def train(root: str, clip: float, marks: Marks | None = None, times=None) -> None:
    """Steps 0..STEPS-1, a checkpoint `s{k}` after step k-1 (k steps done) and at the start, the
    tags before the newest removed once `latest` names it."""
    import torch

    import offloadpp

    torch.set_num_threads(1)
    engine, *_ = offloadpp.initialize(model=model(), config=config(os.path.join(root, "nvme"), clip))
    ckpt = os.path.join(root, "ckpt")

    def mark(p: int) -> None:
        if times is not None:
            times.append((p, time.perf_counter()))
        if marks is not None:
            marks.set(p)

    def save(k: int) -> None:
        mark(SAVE)
        engine.save_checkpoint(ckpt, tag=f"s{k}")
        mark(IDLE)
        for name in os.listdir(ckpt):
            if name.startswith("s") and name != f"s{k}":
                shutil.rmtree(os.path.join(ckpt, name), ignore_errors=True)

    save(0)
    for i in range(STEPS):
        mark(STEP)
        step(engine, i)
        mark(IDLE)
        save(i + 1)
    engine.close()


def resume(root: str, nvme: str, clip: float):
    """Loads `latest` under root/ckpt and trains to STEPS: (steps it started from, weights)."""
    import torch

    import offloadpp

    torch.set_num_threads(1)
    engine, *_ = offloadpp.initialize(model=model(), config=config(nvme, clip))
    try:
        engine.load_checkpoint(os.path.join(root, "ckpt"))
        start = engine.global_steps
        for i in range(start, STEPS):
            step(engine, i)
        return start, {k: v.clone() for k, v in engine.module.state_dict().items()}
    finally:
        engine.close()


def _own_tqdm_lock() -> None:
    """A forked child's progress bars take a lock of its own. tqdm's default lock includes a
    multiprocessing semaphore, shared with every process forked from the zygote: a child killed
    by -9 while it held it (a progress bar's update) left it taken, and the next child waited
    on it forever at its first progress bar (seen: a hung suite)."""
    import threading

    import tqdm

    tqdm.tqdm.set_lock(threading.RLock())


def zygote() -> None:
    """Serves the test on stdin/stdout. `run ROOT CLIP MARKS` forks a child that trains (prints
    its pid); `runint ...` one whose errors end its interpreter as a script's do (its stderr in
    ROOT/stderr); `wait PID` reaps it (prints its exit status); `quit` ends."""
    import sys
    import tempfile

    import torch
    import tqdm

    torch.set_num_threads(1)
    # no tqdm monitor thread: it takes tqdm's lock every few seconds, and a child forked while
    # it holds it waits on that lock forever at its first progress bar (seen: a hung trial)
    tqdm.tqdm.monitor_interval = 0
    warm_up()
    with tempfile.TemporaryDirectory() as d:  # one full run: every lazy initialisation paid here
        train(d, 1.0)
    # Each child starts its own one-process group: the zygote's (a TCP store and gloo's threads,
    # which a fork does not copy) would be torn down at a child's exit joining threads it lacks
    # (std::system_error, "Invalid argument").
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(k, None)
    print("@@ ready", flush=True)
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "run":
            root, clip, marks = args[0], float(args[1]), args[2]
            pid = os.fork()
            if pid == 0:
                _own_tqdm_lock()
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, 1)  # the test reads the zygote's answers on this pipe
                try:
                    train(root, clip, Marks(marks))
                    os._exit(0)
                except BaseException:
                    import traceback

                    traceback.print_exc()
                    os._exit(1)
            print(f"@@ {pid}", flush=True)
        elif cmd == "runint":  # the same, ending as a script does: an uncaught error exits Python
            root, clip, marks = args[0], float(args[1]), args[2]
            pid = os.fork()
            if pid == 0:
                import signal

                # Ctrl-C as a script run from a terminal gets it: a suite started in the background
                # (`make test &`, nohup) inherits SIGINT ignored, and the child would never see one
                signal.signal(signal.SIGINT, signal.default_int_handler)
                m = Marks(marks)
                _own_tqdm_lock()
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, 1)
                err = os.open(os.path.join(root, "stderr"), os.O_WRONLY | os.O_CREAT, 0o644)
                os.dup2(err, 2)
                try:
                    train(root, clip, m)
                except KeyboardInterrupt as e:  # Ctrl-C: the KeyboardInterrupt ends the interpreter
                    note_where_interrupted(m, e)
                    raise
                os._exit(0)
            print(f"@@ {pid}", flush=True)
        elif cmd == "wait":
            _, status = os.waitpid(int(args[0]), 0)
            print(f"@@ {status}", flush=True)
        elif cmd == "quit":
            return


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["zygote"]:
        zygote()
