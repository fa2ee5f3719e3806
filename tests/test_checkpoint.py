"""Checkpoints through the DeepSpeed API: streamed, verified, crash-consistent, and a resume that
continues bit for bit; exports that from_pretrained loads."""

from __future__ import annotations

import json
import os
import random
import re

import numpy as np
import pytest
import torch

import offloadpp
from offloadpp.io import SwapIOError
from offloadpp.runtime.checkpoint import MANIFEST, CheckpointError

transformers = pytest.importorskip("transformers")
pytest.importorskip("deepspeed")
transformers.logging.set_verbosity_error()


def gpt2(width=32, seed=0, dropout=0.1):
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=width, n_head=2, n_positions=32, vocab_size=96,
                                  resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg)


def config(nvme, **over):
    os.makedirs(nvme, exist_ok=True)
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-3, "warmup_num_steps": 4}},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(nvme)},
                              "offload_optimizer": {"device": "nvme", "nvme_path": str(nvme)}},
        "offloadpp": {"enabled": True},
    }  # fmt: skip
    cfg.update(over)
    return cfg


def batch(i):
    return torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(100 + i))


def steps(engine, start, n):
    losses = []
    for i in range(start, start + n):
        x = batch(i)
        loss = engine(input_ids=x, labels=x).loss  # dropout: the RNG's state matters
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def weights(engine):
    return {k: v.clone() for k, v in engine.module.state_dict().items()}


def test_resume_is_bit_identical(tmp_path, on_device):
    a, *_ = offloadpp.initialize(model=gpt2(), config=config(tmp_path / "a"))
    steps(a, 0, 3)
    a.save_checkpoint(str(tmp_path / "ckpt"), client_state={"epoch": 7, "note": "x"})
    random.random(), np.random.rand()  # the caller's generators move on; the checkpoint has them
    want_losses = steps(a, 3, 3)
    want = weights(a)
    a.close()
    b, *_ = offloadpp.initialize(model=gpt2(seed=5), config=config(tmp_path / "b"))
    torch.manual_seed(1234)  # a different RNG state: the checkpoint's must win
    path, client = b.load_checkpoint(str(tmp_path / "ckpt"))
    assert path == str(tmp_path / "ckpt" / "global_step3") and client == {"epoch": 7, "note": "x"}
    assert b.global_steps == 3 and b.get_lr() == pytest.approx([g["lr"] for g in b.optimizer.param_groups])
    assert steps(b, 3, 3) == want_losses
    got = weights(b)
    assert all(torch.equal(got[k], want[k]) for k in want)
    b.close()


def test_checkpoint_folder_is_durable_and_verified(tmp_path):
    eng, *_ = offloadpp.initialize(model=gpt2(), config=config(tmp_path / "nvme"))
    steps(eng, 0, 1)
    eng.save_checkpoint(str(tmp_path / "ckpt"), tag="t1")
    ckpt = tmp_path / "ckpt" / "t1"
    manifest = json.loads((ckpt / MANIFEST).read_text())
    assert manifest["format"] == 3 and (tmp_path / "ckpt" / "latest").read_text() == "t1"
    assert {r["file"] for r in manifest["files"]} == {"engine.pt", "rng.pt", "client_state.pt", "config.json"}
    assert json.loads((ckpt / "config.json").read_text())["architectures"] == ["GPT2LMHeadModel"]
    assert all(a["crc32c"] for a in manifest["arrays"].values())
    assert not [p for p in os.listdir(tmp_path / "ckpt") if p.endswith(".partial")]
    # a flipped byte in a moment's payload is an error naming the file, never other numbers
    state_file = next(p for p in manifest["state_files"] if "exp_avg_sq" in p)
    with open(ckpt / state_file, "r+b") as f:
        f.seek(4096 + 100)
        byte = f.read(1)
        f.seek(4096 + 100)
        f.write(bytes([byte[0] ^ 0x40]))
    with pytest.raises((SwapIOError, CheckpointError), match="checksum|CRC"):
        eng.load_checkpoint(str(tmp_path / "ckpt"))
    # a truncated file is named before anything is read
    with open(ckpt / state_file, "r+b") as f:
        f.truncate(4096)
    with pytest.raises(CheckpointError, match=r"has 4096 bytes, the manifest says"):
        eng.load_checkpoint(str(tmp_path / "ckpt"))
    os.unlink(ckpt / MANIFEST)
    with pytest.raises(CheckpointError, match="not a complete checkpoint: manifest.json is missing"):
        eng.load_checkpoint(str(tmp_path / "ckpt"))
    eng.close()


def test_another_models_checkpoint_is_refused_naming_the_difference(tmp_path):
    a, *_ = offloadpp.initialize(model=gpt2(width=32), config=config(tmp_path / "a"))
    a.save_checkpoint(str(tmp_path / "ckpt"))
    a.close()
    b, *_ = offloadpp.initialize(model=gpt2(width=64), config=config(tmp_path / "b"))
    with pytest.raises(
        CheckpointError,
        match=r"parameter 'transformer\.wte\.weight': the checkpoint has shape \[96, 32\], the model \[96, 64\]",
    ):
        b.load_checkpoint(str(tmp_path / "ckpt"))
    b.close()


def test_a_failed_save_leaves_the_previous_tag_and_latest_valid(tmp_path, monkeypatch):
    eng, *_ = offloadpp.initialize(model=gpt2(), config=config(tmp_path / "nvme"))
    steps(eng, 0, 2)
    eng.save_checkpoint(str(tmp_path / "ckpt"), tag="same")
    want = weights(eng)
    steps(eng, 2, 1)
    real = eng.runtime.save_state

    def dies_half_way(path, **kw):
        real(path, **kw)
        os.unlink(os.path.join(path, MANIFEST))  # as if killed before the manifest was written
        raise KeyboardInterrupt

    monkeypatch.setattr(eng.runtime, "save_state", dies_half_way)
    with pytest.raises(KeyboardInterrupt):
        eng.save_checkpoint(str(tmp_path / "ckpt"), tag="same")
    monkeypatch.undo()
    assert os.path.isdir(tmp_path / "ckpt" / ".same.partial")  # what the dead save left
    fresh, *_ = offloadpp.initialize(model=gpt2(seed=9), config=config(tmp_path / "nvme2"))
    fresh.load_checkpoint(str(tmp_path / "ckpt"))  # the old "same", still whole
    got = weights(fresh)
    assert all(torch.equal(got[k], want[k]) for k in want)
    eng.save_checkpoint(str(tmp_path / "ckpt"), tag="next")  # cleans up the dead save's folder
    assert not os.path.exists(tmp_path / "ckpt" / ".same.partial")
    assert (tmp_path / "ckpt" / "latest").read_text() == "next"
    eng.close()
    fresh.close()


def test_a_load_that_finds_no_checkpoint_warns_and_changes_nothing(tmp_path, caplog):
    """No `latest` (a folder saved with save_latest=False) or a misspelt folder: (None, None) and
    DeepSpeed's warning, naming what is there; nothing changes (was: silent, the groups' lr pushed
    into the runtime, a half-done accumulation window completed)."""
    eng, *_ = offloadpp.initialize(
        model=gpt2(), config=config(tmp_path / "nvme", gradient_accumulation_steps=2)
    )
    steps(eng, 0, 2)  # one window
    eng.save_checkpoint(str(tmp_path / "ckpt"), tag="t", save_latest=False)
    x = batch(5)
    eng.backward(eng(input_ids=x, labels=x).loss)  # the window's first micro-batch, its step() not yet called
    hypers, micro = eng.runtime.hypers, eng.micro_steps
    eng.optimizer.param_groups[0]["lr"] = 0.5  # as a scheduler would, before the next backward reads it
    caplog.set_level("WARNING", logger="offloadpp")
    for where, why in (
        ("ckpt", r"the folder holds no `latest` file \('.*ckpt/latest'\)"),
        ("ckpy", r"the folder does not exist \(did you mean '.*ckpt'\?\)"),
    ):
        caplog.clear()
        assert eng.load_checkpoint(str(tmp_path / where)) == (None, None)
        assert re.search(rf"found no checkpoint to load: {why}; nothing was loaded or changed", caplog.text)
        assert eng.runtime.hypers == hypers and eng.micro_steps == micro
    eng.step()  # the half-done window goes on as if no load had been tried
    assert eng.micro_steps == micro + 1
    eng.close()


@pytest.mark.parametrize("shard_bytes", [None, 60_000])
def test_export_streams_shards_from_pretrained_loads(tmp_path, shard_bytes):
    eng, *_ = offloadpp.initialize(model=gpt2(dropout=0.0), config=config(tmp_path / "nvme"))
    steps(eng, 0, 2)
    want = weights(eng)
    out = tmp_path / "hf"
    if shard_bytes is None:
        eng.save_pretrained(str(out))
        assert (out / "model.safetensors").exists() and (out / "config.json").exists()
    else:
        files = eng.runtime.export_weights(str(out), max_shard_bytes=shard_bytes)
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert len({os.path.basename(f) for f in files}) > 2 and set(index["weight_map"].values()) <= set(
            os.listdir(out)
        )
        eng.module.config.save_pretrained(str(out))
    loaded = transformers.GPT2LMHeadModel.from_pretrained(str(out))
    got = loaded.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert torch.equal(got["lm_head.weight"], got["transformer.wte.weight"])  # tied again
    eng.close()


def test_a_corrupted_state_header_and_an_empty_latest_are_named(tmp_path):
    eng, *_ = offloadpp.initialize(model=gpt2(), config=config(tmp_path / "nvme"))
    steps(eng, 0, 1)
    eng.save_checkpoint(str(tmp_path / "ckpt"), tag="t1")
    ckpt = tmp_path / "ckpt" / "t1"
    manifest = json.loads((ckpt / MANIFEST).read_text())
    state_file = next(p for p in manifest["state_files"] if ".master" in p)
    with open(ckpt / state_file, "r+b") as f:  # one bit of the header block (its key), not the payload
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0x01]))
    name = os.path.basename(state_file)
    with pytest.raises(
        CheckpointError, match=rf"the master of unit .*header checksum mismatch.* on .*{name} at offset 0"
    ):
        eng.load_checkpoint(str(tmp_path / "ckpt"))
    (tmp_path / "ckpt" / "latest").write_text("\n")
    with pytest.raises(CheckpointError, match=r"latest' is empty: it names no checkpoint tag"):
        eng.load_checkpoint(str(tmp_path / "ckpt"))
    eng.close()


# ---- all or nothing, read-only and full filesystems, the manifest's own checksum (issue 25) ----


def _state(engine, where) -> dict:
    """What a load would change, as a checkpoint records it: every array's CRC-32C (weights and
    moments, bit for bit), every parameter's step count, the engine's counters."""
    engine.save_checkpoint(str(where), tag="s")
    m = json.loads((where / "s" / MANIFEST).read_text())
    return {"arrays": m["arrays"], "param_steps": m["param_steps"], "runtime": m["runtime"]["global_step"],
            "counters": (engine.global_steps, engine.micro_steps, engine.global_samples)}  # fmt: skip


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A checkpoint (tag t) of another run than the engines that load it: 2 steps from seed 3."""
    d = tmp_path_factory.mktemp("good")
    a, *_ = offloadpp.initialize(model=gpt2(seed=3), config=config(d / "nvme"))
    steps(a, 0, 2)
    a.save_checkpoint(str(d / "ckpt"), tag="t")
    a.close()
    return d / "ckpt"


@pytest.fixture(scope="module")
def never_tried(tmp_path_factory):
    """3 steps, the state recorded, 2 more steps: (state, losses, weights) of a run that never
    tries a load."""
    d = tmp_path_factory.mktemp("ref")
    r, *_ = offloadpp.initialize(model=gpt2(), config=config(d / "nvme"))
    steps(r, 0, 3)
    before = _state(r, d / "snap")
    out = before, steps(r, 3, 2), weights(r)
    r.close()
    return out


def _last_unit_file(ck, array: str) -> str:
    import re

    m = json.loads((ck / MANIFEST).read_text())
    stem = re.sub(r"[^A-Za-z0-9._-]", "_", f"{m['layout'][-1]['unit']}.{array}")
    return str(ck / next(p for p in m["state_files"] if os.path.basename(p).startswith(stem + ".")))


def _damaged(kind, good, tmp_path):
    import shutil

    if kind == "wrong_model":
        a, *_ = offloadpp.initialize(model=gpt2(width=64), config=config(tmp_path / "wm"))
        a.save_checkpoint(str(tmp_path / "bad"), tag="t")
        a.close()
        return tmp_path / "bad", "the checkpoint has shape"
    shutil.copytree(good, tmp_path / "bad")
    ck = tmp_path / "bad" / "t"
    if kind == "checksum":  # the last unit's: every other array of the checkpoint is good
        with open(_last_unit_file(ck, "exp_avg_sq"), "r+b") as f:
            f.seek(4096 + 100)
            byte = f.read(1)
            f.seek(4096 + 100)
            f.write(bytes([byte[0] ^ 0x40]))
        return tmp_path / "bad", "checksum|CRC"
    if kind == "truncation":
        with open(_last_unit_file(ck, "master"), "r+b") as f:
            f.truncate(4096)
        return tmp_path / "bad", "has 4096 bytes, the manifest says"
    m = json.loads((ck / MANIFEST).read_text())  # one step count 2 -> 3: one bit of the file
    name = list(m["param_steps"])[-1]
    m["param_steps"][name] += 1
    (ck / MANIFEST).write_text(json.dumps(m, indent=1))
    return tmp_path / "bad", "does not match its own CRC-32C"


@pytest.mark.parametrize("kind", ["checksum", "truncation", "wrong_model", "manifest_bit_flip"])
def test_a_failed_load_leaves_the_engine_exactly_as_it_was(tmp_path, good, never_tried, kind):
    """The load fails, and the engine's weights, moments and counters are bit for bit those of
    before the call; training on equals a run that never tried (it was half loaded: 27 of 29
    parameters from the checkpoint after a checksum error; a changed step count was taken)."""
    before_ref, want_losses, want = never_tried
    bad, match = _damaged(kind, good, tmp_path)
    e, *_ = offloadpp.initialize(model=gpt2(), config=config(tmp_path / "nvme"))
    steps(e, 0, 3)
    before = _state(e, tmp_path / "snap1")
    assert before == before_ref
    with pytest.raises((CheckpointError, SwapIOError), match=match):
        e.load_checkpoint(str(bad), tag="t")
    assert _state(e, tmp_path / "snap2") == before
    assert steps(e, 3, 2) == want_losses
    got = weights(e)
    assert all(torch.equal(got[k], want[k]) for k in want)
    e.close()


def test_an_older_manifest_without_its_own_checksum_still_loads(tmp_path, good, caplog):
    import shutil

    shutil.copytree(good, tmp_path / "old")
    mpath = tmp_path / "old" / "t" / MANIFEST
    m = json.loads(mpath.read_text())
    del m["manifest_crc32c"]
    m["format"] = 2  # as offloadpp wrote it before manifests had a checksum of their own
    mpath.write_text(json.dumps(m, indent=1))
    e, *_ = offloadpp.initialize(model=gpt2(), config=config(tmp_path / "nvme"))
    e.load_checkpoint(str(tmp_path / "old"), tag="t")
    assert e.global_steps == 2 and "has no checksum of its own" in caplog.text
    m["format"] = 7
    mpath.write_text(json.dumps(m, indent=1))
    with pytest.raises(CheckpointError, match="has format 7; this offloadpp reads 2 and 3"):
        e.load_checkpoint(str(tmp_path / "old"), tag="t")
    e.close()


def _mount(*args) -> None:
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("mounting needs root")
    r = subprocess.run(["mount", *map(str, args)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount here: {r.stderr.strip()}")


def _umount(path) -> None:
    import subprocess

    subprocess.run(["umount", "-l", str(path)], capture_output=True)


def _loads_like_the_original(good, where, tmp_path) -> None:
    listing = sorted(os.listdir(where / "t" / "state"))
    out = []
    for src in (where, good):  # (one after the other: each load sets the RNGs dropout uses)
        e, *_ = offloadpp.initialize(model=gpt2(), config=config(tmp_path / f"nv{len(out)}"))
        e.load_checkpoint(str(src), tag="t")
        out.append((e.global_steps, steps(e, 2, 1), weights(e)))
        e.close()
    assert out[0][:2] == out[1][:2] and out[0][0] == 2
    assert all(torch.equal(out[0][2][k], out[1][2][k]) for k in out[1][2])
    assert sorted(os.listdir(where / "t" / "state")) == listing  # no probe file, nothing written


def test_a_checkpoint_loads_from_a_read_only_mount(tmp_path, good):
    """A read-only bind mount of a good checkpoint loads (was: EROFS creating a probe file in
    TAG/state)."""
    import shutil

    shutil.copytree(good, tmp_path / "src")
    ro = tmp_path / "ro"
    ro.mkdir()
    _mount("--bind", tmp_path / "src", ro)
    try:
        _mount("-o", "remount,ro,bind", ro)
        with pytest.raises(OSError, match="Read-only"):
            open(ro / "t" / "x", "w")
        _loads_like_the_original(good, ro, tmp_path)
    finally:
        _umount(ro)


def test_a_checkpoint_loads_from_a_full_filesystem(tmp_path, good):
    """A checkpoint on a filesystem with no byte left loads (was: ENOSPC creating a probe file)."""
    import shutil

    size = sum(f.stat().st_size for f in good.rglob("*") if f.is_file())
    full = tmp_path / "full"
    full.mkdir()
    _mount("-t", "tmpfs", "-o", f"size={size + (2 << 20)}", "tmpfs", full)
    try:
        shutil.copytree(good, full, dirs_exist_ok=True)
        with open(full / "filler", "wb") as f:
            with pytest.raises(OSError, match="No space left"):
                while True:
                    f.write(b"\0" * (1 << 16))
                    f.flush()
        _loads_like_the_original(good, full, tmp_path)
    finally:
        _umount(full)


@pytest.mark.parametrize("how", ["read_only_mount", "no_write_permission", "full_disk"])
def test_a_save_into_a_read_only_folder_names_the_path_and_what_to_do(tmp_path, how):
    """A save where nothing may be written raises the checkpoint error with the folder, the
    cause, what to do and what is still there (was: a bare OSError, errno 30)."""
    eng, *_ = offloadpp.initialize(model=gpt2(), config=config(tmp_path / "nvme"))
    steps(eng, 0, 1)
    src = tmp_path / "src"
    eng.save_checkpoint(str(src), tag="t")
    if how == "full_disk":  # room for the small files, not for the state
        where = tmp_path / "full"
        where.mkdir()
        _mount("-t", "tmpfs", "-o", "size=128k", "tmpfs", where)
        try:
            with pytest.raises(
                CheckpointError,
                match=rf"cannot save checkpoint 'u' in '{where}': .*No space left on device.*; the disk is full: free "
                r"space there .* The checkpoints already there are unchanged: no checkpoint there was complete yet",
            ) as e:
                eng.save_checkpoint(str(where), tag="u")
            assert "O_DIRECT" not in str(e.value)  # the disk is full, not a filesystem without it
        finally:
            _umount(where)
        return eng.close()
    if how == "read_only_mount":
        where = tmp_path / "ro"
        where.mkdir()
        _mount("--bind", src, where)
    else:
        if os.geteuid() == 0:
            pytest.skip("root writes into a folder without write permission")
        where = src
    try:
        if how == "read_only_mount":
            _mount("-o", "remount,ro,bind", where)
            why = r"Read-only file system \('.*'\); the filesystem is mounted read-only: pass save_checkpoint a folder"
        else:
            os.chmod(where, 0o555)
            why = r"Permission denied \('.*'\); this process may not write there"
        with pytest.raises(
            CheckpointError,
            match=rf"cannot save checkpoint 'u' in '{where}': {why}.* The checkpoints already there are unchanged: "
            r"`latest` still names 't', complete",
        ):
            eng.save_checkpoint(str(where), tag="u")
    finally:
        _umount(where) if how == "read_only_mount" else os.chmod(where, 0o755)
    eng.close()
