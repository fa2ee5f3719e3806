"""A run moved over from ZeRO-Infinity (integrations/deepspeed/ds_import.py): a real DeepSpeed
ZeRO-3 run with parameters and optimizer on NVMe (CONFIG, its `aio` block included; the models
large enough that part of their state goes to NVMe) saves at step 5 and goes on 5 more steps;
offloadpp loads that folder (its NVMe optimizer state in the offloaded_tensors/ swap files) and
trains the same 5 steps, and must meet ZeRO-Infinity's own continuation, losses and weights
within 1e-4 (tests/ds_import_worker.py, in its own process). Both sides read the same JSON, each
with a swap folder of its own. The reference is checked first: ZeRO-Infinity's 10 losses meet
plain PyTorch's (AdamW, the same schedule) within 1e-4, since DeepSpeed's own run can be wrong
(ds_import_worker.tiny's Note: a 64-wide Llama's head trained on gradients never read back).

Note: the reference is the run going on past its checkpoint, not DeepSpeed loading it back.
DeepSpeed 0.19.8's load of its own NVMe-optimizer checkpoint copies the swap files back and
nothing else of the optimizer (engine.py, load_checkpoint: _load_zero_checkpoint is skipped under
an NVMe optimizer): the Adam step counts, the param groups' lr and the sub-groups DeepSpeed kept in
memory (under 1 MiB) start afresh, so its resumed run differs from its own run (the worker
records it as `resumed`; docs/checkpoints.md has the figures).
"""

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from numerics import compare_weights

import offloadpp
from offloadpp.integrations.deepspeed.ds_import import DeepSpeedImportError

transformers = pytest.importorskip("transformers")
pytest.importorskip("deepspeed")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from ds_import_worker import AIO, ZERO_INFINITY, batches, on_nvme, tiny, train  # noqa: E402

FIRST, THEN = 5, 5
LR = 3e-3
CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "steps_per_print": 1000,
    "gradient_clipping": 0.0,
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1},
    },
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-3, "warmup_num_steps": 3, "total_num_steps": 20},
    },
    "zero_optimization": ZERO_INFINITY,  # (nvme_path: each engine's own)
    "aio": AIO,
}


def zero_infinity(tmp: Path, model: str) -> dict:
    """DeepSpeed's run: 5 steps, saved, loaded back into a fresh engine, 5 more (once per model
    for the tests of the module, which reuse its checkpoint)."""
    spec = {
        "model": model,
        "first": FIRST,
        "then": THEN,
        "config": CONFIG,
        "dir": str(tmp),
        "ckpt": str(tmp / "ds"),
    }
    (tmp / "spec.json").write_text(json.dumps(spec))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent), str(HERE)]), RANK="0", WORLD_SIZE="1",
               LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 2000))  # fmt: skip
    p = subprocess.run([sys.executable, str(HERE / "ds_import_worker.py"), str(tmp / "spec.json"), str(tmp / "out.pt")],
                       capture_output=True, text=True, env=env, timeout=900)  # fmt: skip
    assert p.returncode == 0, p.stderr[-4000:]
    return torch.load(tmp / "out.pt", weights_only=False)


@pytest.fixture(scope="module")
def zero_gpt2(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("zero-gpt2")
    return "gpt2", tmp, zero_infinity(tmp, "gpt2")


@pytest.fixture(scope="module")
def zero_llama(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("zero-llama")
    return "llama", tmp, zero_infinity(tmp, "llama")


def our_config(tmp: Path, name: str) -> dict:
    """CONFIG, as DeepSpeed's side ran it, with the "offloadpp" block and a swap folder of its own."""
    nvme = tmp / f"nvme-{name}"
    assert not nvme.exists()
    return dict(on_nvme(CONFIG, str(nvme)), offloadpp={"enabled": True})


def ours(tmp: Path, model: str, name: str, **over):
    cfg = our_config(tmp, name)
    cfg.update(over)
    m = tiny(model, 321)  # other weights again: all must come from the checkpoint
    engine, *_ = offloadpp.initialize(model=m, model_parameters=m.parameters(), config=cfg)
    return engine


@pytest.mark.parametrize("run", ["zero_gpt2", "zero_llama"])
def test_zero_infinity_run_continues_on_offloadpp(run, request, caplog):
    model, tmp, ref = request.getfixturevalue(run)
    # the reference is sound: ZeRO-Infinity's run meets plain PyTorch's (ds_import_worker.tiny's Note)
    assert ref["before"] + ref["after"] == pytest.approx(ref["pytorch"], rel=1e-4)
    engine = ours(tmp, model, "load")
    with caplog.at_level(logging.WARNING, logger="offloadpp"):
        path, client = engine.load_checkpoint(str(tmp / "ds"))
    assert "did not read back" not in caplog.text  # (every swapped gradient here starts aligned)
    assert path == str(tmp / "ds") and client == {"epoch": 3}
    assert engine.global_steps == FIRST and engine.get_lr() == pytest.approx(ref["lr_at_save"])
    losses = train(engine, batches(FIRST + THEN)[FIRST:])
    assert losses == pytest.approx(ref["after"], rel=1e-4)
    # (GPT-2's key bias: rounding noise Adam normalises, bounded apart: tests/numerics.py's Note)
    assert compare_weights(engine.module.state_dict(), ref["weights"], lr=LR, steps=THEN) < 1e-4
    assert not os.listdir(engine.runtime.store.dirs[0]) or not any(
        n.startswith("import-") for n in os.listdir(engine.runtime.store.dirs[0])
    )  # the folder the import worked in is gone
    engine.close()


def config_file(tmp: Path, name: str) -> Path:
    """The run's DeepSpeed JSON as `offloadpp import-deepspeed --config` reads it."""
    (tmp / f"{name}.json").write_text(json.dumps(our_config(tmp, name)))
    return tmp / f"{name}.json"


def test_import_command_writes_a_checkpoint_the_run_resumes(zero_gpt2):
    """offloadpp import-deepspeed ahead of the run, then engine.load_checkpoint(OUT_DIR)."""
    from offloadpp.cli.main import main

    model, tmp, ref = zero_gpt2
    (tmp / "model.json").write_text(json.dumps(tiny(model, 0).config.to_dict()))
    argv = ["import-deepspeed", str(tmp / "ds"), str(tmp / "out"), "--config", str(config_file(tmp, "cli")),
            "--model", str(tmp / "model.json")]  # fmt: skip
    assert main(argv) == 0
    assert (tmp / "out" / "latest").read_text() == f"step{FIRST}"
    assert (tmp / "out" / f"step{FIRST}" / "manifest.json").is_file()
    engine = ours(tmp, model, "cli-run")
    path, client = engine.load_checkpoint(str(tmp / "out"))
    assert path.endswith(f"step{FIRST}") and client == {"epoch": 3}
    losses = train(engine, batches(FIRST + THEN)[FIRST:])
    assert losses == pytest.approx(ref["after"], rel=1e-4)
    engine.close()
    assert main(argv) == 1  # OUT_DIR/step5 exists: refused, named (not overwritten)


def test_universal_folder_with_load_universal(zero_gpt2, tmp_path):
    """ "checkpoint": {"load_universal": true}: DeepSpeed's own universal folder (ds_to_universal's
    output, named by latest_universal) loads as DeepSpeed would load it."""
    from offloadpp.integrations.deepspeed.ds_import import to_universal

    model, tmp, ref = zero_gpt2
    to_universal(str(tmp / "ds" / f"step{FIRST}"), str(tmp_path / "uni"))
    assert (tmp_path / "uni" / "latest_universal").read_text() == f"step{FIRST}"
    engine = ours(tmp_path, model, "uni", checkpoint={"load_universal": True})
    path, client = engine.load_checkpoint(str(tmp_path / "uni"))
    assert client == {"epoch": 3} and engine.global_steps == FIRST
    losses = train(engine, batches(FIRST + THEN)[FIRST:])
    assert losses == pytest.approx(ref["after"], rel=1e-4)
    # the run's own checkpoints, saved after the move, load with the switch left on
    engine.save_checkpoint(str(tmp_path / "own"))
    assert engine.load_checkpoint(str(tmp_path / "own"))[0].endswith(f"global_step{FIRST + THEN}")
    engine.close()


def test_refusals_name_what_is_wrong(zero_gpt2, tmp_path):
    model, tmp, _ = zero_gpt2
    other = "llama" if model == "gpt2" else "gpt2"
    engine = ours(tmp_path, other, "other")
    before = {k: v.clone() for k, v in engine.module.state_dict().items()}
    with pytest.raises(DeepSpeedImportError, match=r"lacks parameter\(s\) of the model: \[.*'"):
        engine.load_checkpoint(str(tmp / "ds"))
    assert all(torch.equal(v, before[k]) for k, v in engine.module.state_dict().items())  # unchanged
    engine.close()

    # a ZeRO stage 2 checkpoint (its stage is the optimizer file's zero_stage, as ds_to_universal reads it)
    stage2 = tmp_path / "stage2" / "global_step5"
    stage2.mkdir(parents=True)
    sd = torch.load(
        tmp / "ds" / f"step{FIRST}" / "zero_pp_rank_0_mp_rank_00_optim_states.pt", weights_only=False
    )
    sd["optimizer_state_dict"]["zero_stage"] = 2
    torch.save(sd, stage2 / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt")
    (tmp_path / "stage2" / "latest").write_text("global_step5")
    engine = ours(tmp_path, model, "stage2")
    with pytest.raises(
        DeepSpeedImportError, match="is a ZeRO stage 2 checkpoint; offloadpp moves over ZeRO stage 3"
    ):
        engine.load_checkpoint(str(tmp_path / "stage2"))
    # a folder that is no checkpoint, given to the command
    from offloadpp.cli.main import main

    (tmp_path / "empty").mkdir()
    (tmp_path / "model.json").write_text(json.dumps(tiny(model, 0).config.to_dict()))
    engine.close()
    argv = ["import-deepspeed", str(tmp_path / "empty"), str(tmp_path / "out"), "--config",
            str(config_file(tmp_path, "cli")), "--model", str(tmp_path / "model.json")]  # fmt: skip
    assert main(argv) == 1


def test_a_parameter_of_another_shape_is_named(zero_llama, tmp_path):
    from offloadpp.integrations.deepspeed.ds_import import Universal, check, to_universal
    from offloadpp.runtime.checkpoint import model_layout

    model, tmp, _ = zero_llama
    uni = Universal(to_universal(str(tmp / "ds" / f"step{FIRST}"), str(tmp_path / "uni")))
    engine = ours(tmp_path, model, "shape")
    layout = model_layout(engine.runtime.units)
    engine.close()
    p = layout[-1]["params"][0]
    p["shape"] = [p["shape"][0] + 1, *p["shape"][1:]]
    with pytest.raises(
        DeepSpeedImportError, match=rf"parameter '{re.escape(p['name'])}': the DeepSpeed checkpoint has shape"
    ):
        check(layout, uni)


def test_deepspeed_aio_reads_nothing_into_a_misaligned_buffer(tmp_path):
    """DeepSpeed 0.19.8's aio op, as its NVMe optimizer reads a swapped gradient back: a read into
    a pinned buffer at a 512-byte aligned address lands; at an address 256 bytes off it reads
    nothing and still reports one request done. Why the test's Llama is 128 wide and why the
    import warns (ds_import_worker.tiny's Note, ds_import.misread_gradients). When this fails,
    DeepSpeed reads such buffers, and the Note and the warning can go."""
    from deepspeed.ops.op_builder import AsyncIOBuilder

    h = AsyncIOBuilder().load(verbose=False).aio_handle(1 << 20, 8, False, True, 1)
    n = 1 << 18
    src = torch.arange(1, n + 1, dtype=torch.float32)
    buf = h.new_cpu_locked_tensor(n + 128, torch.empty(0))
    buf[:n].copy_(src)
    path = str(tmp_path / "g.swp")
    assert h.async_pwrite(buf[:n], path) == 0 and h.wait() == 1
    landed = {}
    for values in (128, 64):  # 512 and 256 bytes into the buffer
        buf.zero_()
        assert h.async_pread(buf[values : values + n], path) == 0 and h.wait() == 1
        landed[values] = int(torch.count_nonzero(buf))
    h.free_cpu_locked_tensor(buf)
    assert landed == {128: n, 64: 0}


def test_misread_gradients_are_the_swapped_ones_off_512_bytes():
    from collections import OrderedDict

    from offloadpp.integrations.deepspeed.ds_import import misread_gradients

    def llama(width):  # param_shapes in two sub-groups, as ZeRO-3 split the 64-wide one (sub_group_size 3e5)
        layer = lambda i: [(f"model.layers.{i}.self_attn.{p}_proj.weight", [width, width]) for p in "qkvo"] + [
            (f"model.layers.{i}.mlp.{p}_proj.weight", [2 * width, width]) for p in ("gate", "up", "down")
        ]  # fmt: skip
        norms = lambda i: [
            (f"model.layers.{i}.{n}_layernorm.weight", [width]) for n in ("input", "post_attention")
        ]
        vocab = (1 << 18) // width
        return [
            OrderedDict([("model.embed_tokens.weight", [vocab, width])] + layer(0)),
            OrderedDict(norms(0) + layer(1) + norms(1) + [("model.norm.weight", [width]), ("lm_head.weight", [vocab, width])]),
        ]  # fmt: skip

    # the 64-wide Llama's head starts 41280 values (256 bytes past a 512 multiple) into its sub-group:
    # DeepSpeed's run left its buffer unread there (measured, 2026-12-05), the embedding's at 0 read
    assert misread_gradients(llama(64), [0, 1], 1, None) == ["lm_head.weight"]
    assert misread_gradients(llama(64), [0], 1, None) == []  # (its sub-group in memory: no swap)
    assert misread_gradients(llama(128), [0, 1], 1, None) == []  # (the test's Llama: all aligned)
    # over 2 ranks each holds half of every parameter: the 128-wide norms' halves are 256 bytes
    assert misread_gradients(llama(128), [0, 1], 2, None) == []  # (the head's half, 512 KiB, stays in memory)
    wide = [OrderedDict([("norm.weight", [128]), ("head.weight", [8192, 128])])]
    assert misread_gradients(wide, [0], 2, None) == ["head.weight"]
    # a gradient under the least aio size (an aio block of 4 MiB) is never swapped
    assert misread_gradients(llama(64), [0, 1], 1, {"aio": {"block_size": 4 << 20}}) == []
