"""Faults: an interrupted step leaves exactly the state of the last completed step; a full disk, an
I/O error, a swap directory removed or made read-only, a truncated or corrupted swap file each
give an error naming the path (never a hang, never silently different numbers), and the last
checkpoint stays loadable."""

from __future__ import annotations

import errno
import json
import os
import subprocess

import pytest
import torch

from offloadpp.io import SwapIOError
from offloadpp.runtime.checkpoint import ARRAYS, MANIFEST

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


def gpt2(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(n_layer=3, n_embd=64, n_head=2, n_positions=32, vocab_size=128,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg)


def engine(nvme, clip=0.0, seed=0):
    from offloadpp.assemble import assemble_engine
    from offloadpp.optim import AdamHyper
    from offloadpp.planner import Settings
    from offloadpp.runtime import RuntimeConfig

    os.makedirs(nvme, exist_ok=True)
    cfg = RuntimeConfig(nvme_paths=[str(nvme)], settings=Settings(gradient_clipping=clip), device="cpu",
                        ssd_read_gbps=1.0, ssd_write_gbps=1.0)  # fmt: skip
    return assemble_engine(gpt2(seed), cfg, hyper=AdamHyper(lr=1e-3, weight_decay=0.1))


def step(eng, i):
    x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(i))
    eng.backward(eng(input_ids=x, labels=x).loss)
    return eng.step()


def fingerprint(eng, path) -> dict:
    """Every master and moment's CRC-32C and every step count, through a checkpoint."""
    eng.save_state(str(path))
    m = json.loads((path / MANIFEST).read_text())
    return {"arrays": {k: v["crc32c"] for k, v in m["arrays"].items()}, "steps": m["param_steps"],
            "global": m["runtime"]["global_step"]}  # fmt: skip


class Boom(Exception):
    pass


# clip 1.0 clips every step here, so after the first (speculated, redone) updates are deferred;
# 1e3 never clips: every step's updates run speculatively during backward
@pytest.mark.parametrize(
    "clip", [0.0, 1.0, 1e3], ids=["updates-in-backward", "deferred-updates", "speculative-updates"]
)
@pytest.mark.parametrize("exc", [Boom, KeyboardInterrupt])
def test_interrupted_step_leaves_the_last_completed_state(tmp_path, clip, exc):
    ref = engine(tmp_path / "ref", clip)
    eng = engine(tmp_path / "nvme", clip)
    try:
        for i in range(2):
            step(ref, i)
            step(eng, i)
        blocks = eng.module.transformer.h
        # the first block's backward runs last: by then the head and the later blocks are updated
        handle = blocks[0].register_full_backward_hook(lambda *a: (_ for _ in ()).throw(exc("interrupted")))
        with pytest.raises(exc):
            step(eng, 2)
        handle.remove()
        assert eng.speculation.speculating == (clip > 1)
        assert fingerprint(eng, tmp_path / "a") == fingerprint(ref, tmp_path / "b")  # bit for bit
        for i in (2, 3):  # and it trains on exactly as if nothing had happened
            step(ref, i)
            step(eng, i)
        assert fingerprint(eng, tmp_path / "c") == fingerprint(ref, tmp_path / "d")
    finally:
        eng.close()
        ref.close()


@pytest.fixture
def tmpfs(tmp_path):
    """A tmpfs to fill, break and remount (O_DIRECT works on tmpfs since Linux 6.6); root only."""
    mnt = tmp_path / "fs"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256m", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def _checkpoint_then(tmp_path, nvme, clip=0.0, steps=2):
    """An engine on `nvme` after `steps` steps, with a checkpoint of them outside `nvme`."""
    eng = engine(nvme, clip)
    for i in range(steps):
        step(eng, i)
    eng.save_state(str(tmp_path / "ckpt"))
    return eng


def _checkpoint_loads(tmp_path, steps=2):
    fresh = engine(tmp_path / "fresh", seed=3)
    try:
        assert fresh.load_state(str(tmp_path / "ckpt"))["runtime"]["global_step"] == steps
    finally:
        fresh.close()


def test_full_disk(tmp_path, tmpfs):
    # before the first step: the step's new generation of the state needs room on the disk
    eng = _checkpoint_then(tmp_path, tmpfs / "nvme", steps=0)
    try:
        free = os.statvfs(tmpfs).f_bavail * os.statvfs(tmpfs).f_frsize
        with open(tmpfs / "filler", "wb") as f:  # someone else fills the disk
            f.truncate(0)
            f.write(b"\0" * (free - (64 << 10)))
        with pytest.raises(SwapIOError) as e:
            for i in range(2, 6):
                step(eng, i)
        assert e.value.errno == errno.ENOSPC and str(tmpfs) in str(e.value)
    finally:
        os.unlink(tmpfs / "filler")
        eng.close()
    _checkpoint_loads(tmp_path, steps=0)


def test_read_only_disk_reports_its_own_errno(tmp_path, tmpfs):
    # a read-only view of the swap directory (the swap files already open stay writable, as
    # on a filesystem remounted read-only with writers on it; the step's new files cannot be)
    eng = _checkpoint_then(tmp_path, tmpfs / "nvme", steps=0)
    nvme = str(tmpfs / "nvme")
    try:
        subprocess.run(["mount", "--bind", nvme, nvme], check=True)
        subprocess.run(["mount", "-o", "remount,bind,ro", nvme], check=True)
        with pytest.raises(OSError) as e:
            step(eng, 0)
        assert e.value.errno == errno.EROFS and "Stale file handle" not in str(e.value), str(e.value)
        assert nvme in str(e.value)
        subprocess.run(["umount", nvme], check=True)
        step(eng, 0)  # the interrupted step rolled back: once writable again, it trains on
    finally:
        subprocess.run(["umount", nvme], capture_output=True)
        eng.close()
    _checkpoint_loads(tmp_path, steps=0)


def test_io_error(tmp_path):
    eng = _checkpoint_then(tmp_path, tmp_path / "nvme")
    try:
        eng.store._engines[0]._inject_fault(3, errno.EIO)
        with pytest.raises(SwapIOError) as e:
            for i in range(2, 5):
                step(eng, i)
        assert e.value.errno == errno.EIO and str(tmp_path / "nvme") in str(e.value)
    finally:
        eng.close()
    _checkpoint_loads(tmp_path)


def test_swap_directory_removed(tmp_path):
    import shutil

    eng = _checkpoint_then(tmp_path, tmp_path / "nvme")
    try:
        shutil.rmtree(tmp_path / "nvme")
        with pytest.raises(Exception, match=str(tmp_path / "nvme")):
            for i in range(2, 5):
                step(eng, i)
    finally:
        eng.close()
    _checkpoint_loads(tmp_path)


@pytest.mark.parametrize("how", ["truncated", "flipped byte"])
def test_damaged_swap_file(tmp_path, how):
    eng = _checkpoint_then(tmp_path, tmp_path / "nvme")
    try:
        files = sorted((tmp_path / "nvme").glob("*exp_avg_sq*.oswp"))
        assert files
        for path in files:  # both generations of every unit's second moment
            with open(path, "r+b") as f:
                if how == "truncated":
                    f.truncate(4096 + 512)
                else:
                    f.seek(4096 + 1000)
                    b = f.read(1)
                    f.seek(4096 + 1000)
                    f.write(bytes([b[0] ^ 0x10]))
        with pytest.raises(SwapIOError) as e:
            for i in range(2, 5):
                step(eng, i)
        assert "exp_avg_sq" in str(e.value) and ("truncated" in str(e.value) or "checksum" in str(e.value))
    finally:
        eng.close()
    _checkpoint_loads(tmp_path)


@pytest.mark.parametrize("clip", [0.0, 1.0], ids=["updates-in-backward", "deferred-updates"])
def test_a_moment_corrupted_on_disk_is_caught_by_the_adam_pass_before_any_write(tmp_path, clip):
    """The moments' CRC-32C is taken in the Adam pass (runtime/jobs.py, the Note): a flipped
    byte fails the step with the store's error, and nothing computed from the bad bytes is
    written: every master and moment file of a unit whose moments were corrupted is byte for
    byte what it was before the step (a unit whose moments the plan keeps in memory may update)."""
    nvme = tmp_path / "nvme"
    eng = engine(nvme, clip=clip)
    try:
        for i in range(2):
            step(eng, i)
        eng._quiesce()  # the last step's pending updates applied and its queued writes started
        eng.store.wait_all()
        hit = sorted(nvme.glob("*exp_avg_sq*.oswp"))  # both generations of every unit on SSD
        assert hit
        for path in hit:
            with open(path, "r+b") as f:
                f.seek(4096 + 1000)
                b = f.read(1)
                f.seek(4096 + 1000)
                f.write(bytes([b[0] ^ 0x10]))
        units = {p.name.split(".exp_avg_sq")[0] + "." for p in hit}
        state = [p for p in nvme.glob("*.oswp") if any(k in p.name for k in ARRAYS)]
        state = sorted(p for p in state if any(p.name.startswith(u) for u in units))
        before = {p: p.read_bytes() for p in state}
        with pytest.raises(SwapIOError) as e:
            step(eng, 2)
            step(eng, 3)  # (deferred updates are applied at the next forward's visit)
        assert e.value.errno == errno.EBADMSG
        assert "exp_avg_sq" in str(e.value) and "found by the Adam pass" in str(e.value)
        eng.store.wait_all()
        assert {p: p.read_bytes() for p in state} == before
    finally:
        try:
            eng.close()
        except SwapIOError:
            pass  # close() completes what is pending: the same corrupted read


def test_a_swap_folder_removed_under_the_run_is_named_at_every_later_step(tmp_path):
    import shutil

    from test_deepspeed_integration import batches, ds_config, tiny_gpt2

    import offloadpp

    eng, *_ = offloadpp.initialize(model=tiny_gpt2(), config=ds_config(tmp_path / "nvme"))
    swap = str(tmp_path / "nvme" / "offloadpp")
    try:
        for b in batches(5)[:2]:
            eng.backward(eng(b, labels=b).loss)
            eng.step()
        shutil.rmtree(swap)
        for b in batches(5)[2:]:  # not "step() was not called", nor a raw KeyError of a swap key
            with pytest.raises(
                SwapIOError, match=rf"swap directory '{swap}' was removed while this run used it"
            ):
                eng.backward(eng(b, labels=b).loss)
                eng.step()
    finally:
        eng.close()


# Where a Ctrl-C lands in the DeepSpeed engine's own code around the runtime's calls, in the
# last micro-batch of the second window: (what raises, at its nth call from then on by the
# window's length): before the forward (the last micro-batch's completion: with one micro-batch a
# window, between steps), after the forward (the optimizer's hypers pushed before backward),
# after the runtime's backward (the monitors fed), in step() before it holds Ctrl-C.
_WRAPPER_SPOTS = {
    "before-forward": (lambda eng: (eng, "_finish_micro"), lambda gas: 2 * gas - 1),
    "hypers": (lambda eng: (eng.optimizer, "hypers"), lambda gas: gas),
    "monitors": (lambda eng: (eng._events, "backward"), lambda gas: gas),
    "step": (lambda eng: (eng, "_step"), lambda gas: 1),
}


@pytest.mark.parametrize("gas", [1, 2])
@pytest.mark.parametrize("spot", list(_WRAPPER_SPOTS))
def test_ctrl_c_in_the_deepspeed_engines_own_code_rolls_the_window_back(tmp_path, caplog, spot, gas):
    """The DeepSpeed engine's work around the runtime's calls is part of the step: a Ctrl-C
    there rolls the open window back as one inside the runtime does, and says so once (between
    steps, that nothing had begun); training goes on bit for bit as if the window had never
    started (its batches run again)."""
    import logging

    from test_deepspeed_integration import batches, ds_config, tiny_gpt2

    import offloadpp

    cfg = dict(gradient_accumulation_steps=gas, gradient_clipping=1.0)
    data = batches(3 * gas)
    ref, *_ = offloadpp.initialize(model=tiny_gpt2(), config=ds_config(tmp_path / "ref", **cfg))
    eng, *_ = offloadpp.initialize(model=tiny_gpt2(), config=ds_config(tmp_path / "nvme", **cfg))

    def micro(e, b, last):
        e.backward(e(b, labels=b).loss)
        if last:  # (earlier micro-batches complete at the next forward: Accelerate's way)
            e.step()

    try:
        for i, b in enumerate(data):
            micro(ref, b, i % gas == gas - 1)
        for i, b in enumerate(data[:gas]):
            micro(eng, b, i == gas - 1)
        where, nth = _WRAPPER_SPOTS[spot]
        owner, name = where(eng)
        real, calls = getattr(owner, name), []

        def interrupted(*a, **k):
            calls.append(1)
            if len(calls) < nth(gas):
                return real(*a, **k)
            setattr(owner, name, real)
            raise KeyboardInterrupt

        setattr(owner, name, interrupted)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="offloadpp"), pytest.raises(KeyboardInterrupt):
            for i, b in enumerate(data[gas : 2 * gas]):
                micro(eng, b, i == gas - 1)
        assert getattr(owner, name) == real, "the interrupt was not reached"
        said = [r.getMessage() for r in caplog.records if "interrupted (KeyboardInterrupt)" in r.getMessage()]
        assert len(said) == 1 and "last completed step (1)" in said[0], said
        assert ("between steps" in said[0]) == (spot == "before-forward" and gas == 1), said
        assert eng.global_steps == 1
        for i, b in enumerate(data[gas:]):  # the window again, from its first micro-batch
            micro(eng, b, i % gas == gas - 1)
        assert eng.global_steps == ref.global_steps == 3
        assert fingerprint(eng.runtime, tmp_path / "a") == fingerprint(ref.runtime, tmp_path / "b")
        assert eng.get_lr() == ref.get_lr()
    finally:
        eng.close()
        ref.close()


def test_ctrl_c_at_the_end_of_train_batch_is_held_until_the_engines_bookkeeping_is_done(tmp_path, caplog):
    """A Ctrl-C while train_batch's step commits is held until the DeepSpeed engine has counted
    the step and stepped its scheduler too (the runtime runs that bookkeeping inside the step's
    end), then raised once, said once: the engine and the runtime agree on the step, and
    training goes on bit for bit."""
    import logging
    import signal

    from test_deepspeed_integration import batches, ds_config, tiny_gpt2

    import offloadpp

    cfg = dict(gradient_accumulation_steps=2, gradient_clipping=1.0)
    data = [{"input_ids": b, "labels": b} for b in batches(8)]
    ref, *_ = offloadpp.initialize(model=tiny_gpt2(), config=ds_config(tmp_path / "ref", **cfg))
    eng, *_ = offloadpp.initialize(model=tiny_gpt2(), config=ds_config(tmp_path / "nvme", **cfg))
    old = signal.signal(signal.SIGINT, signal.default_int_handler)  # (as a terminal's script has it)
    try:
        for w in range(4):
            ref.train_batch(iter(data[2 * w : 2 * w + 2]))
        for w in range(2):
            eng.train_batch(iter(data[2 * w : 2 * w + 2]))
        commit = eng.runtime.transaction.commit

        def ctrl_c_then_commit():
            eng.runtime.transaction.commit = commit
            os.kill(os.getpid(), signal.SIGINT)
            commit()

        eng.runtime.transaction.commit = ctrl_c_then_commit
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="offloadpp"), pytest.raises(KeyboardInterrupt):
            eng.train_batch(iter(data[4:6]))
        said = [r.getMessage() for r in caplog.records if "interrupted (KeyboardInterrupt)" in r.getMessage()]
        assert len(said) == 1 and "end of step 3, which completed first" in said[0], said
        assert eng.global_steps == eng.runtime.global_step == 3
        eng.train_batch(iter(data[6:8]))
        assert eng.global_steps == ref.global_steps == 4
        assert fingerprint(eng.runtime, tmp_path / "a") == fingerprint(ref.runtime, tmp_path / "b")
        assert eng.get_lr() == ref.get_lr()
    finally:
        signal.signal(signal.SIGINT, old)
        eng.close()
        ref.close()
