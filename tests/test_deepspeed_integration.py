"""offloadpp.initialize: DeepSpeed's API and semantics on offloadpp's runtime."""

import copy
import json
import os

import pytest
import torch
from numerics import compare_weights

import offloadpp
from offloadpp.integrations.deepspeed import OffloadppConfigError

transformers = pytest.importorskip("transformers")
pytest.importorskip("deepspeed")


def tiny_gpt2(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        n_positions=32,
        vocab_size=96,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(cfg)


def ds_config(nvme, **over):
    os.makedirs(nvme, exist_ok=True)  # an nvme path must exist (a missing one is an error)
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 100,
        "gradient_clipping": 0.0,
        "optimizer": {
            "type": "Adam",
            "params": {"lr": 1e-3, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.1},
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 3},
        },
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": str(nvme)},
            "offload_optimizer": {"device": "nvme", "nvme_path": str(nvme)},
        },
        "offloadpp": {"enabled": True},
    }
    cfg.update(over)
    return cfg


def batches(n, micro=2, seq=16, vocab=96, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (micro, seq), generator=g) for _ in range(n)]


def reference(model, cfg, data):
    """The same training with plain torch: DeepSpeed's 'Adam' is AdamW; its WarmupLR; clipping."""
    from deepspeed.runtime.lr_schedules import WarmupLR

    p = cfg["optimizer"]["params"]
    opt = torch.optim.AdamW(
        model.parameters(), lr=p["lr"], betas=tuple(p["betas"]), eps=p["eps"], weight_decay=p["weight_decay"]
    )
    sched = WarmupLR(opt, **cfg["scheduler"]["params"])
    gas = cfg["gradient_accumulation_steps"]
    for i, ids in enumerate(data):
        loss = model(input_ids=ids, labels=ids).loss / gas
        loss.backward()
        if (i + 1) % gas == 0:
            if cfg["gradient_clipping"]:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["gradient_clipping"])
            opt.step()
            opt.zero_grad()
            sched.step()
    return model


def train(engine, data):
    losses = []
    for ids in data:
        ids = ids.to(engine.device)  # CUDA (LOCAL_RANK's) where present, else the CPU as the device
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


def max_rel(a: dict, b: dict) -> float:
    worst = 0.0
    for k in a:
        d = (a[k].float() - b[k].float()).abs().max().item()
        worst = max(worst, d / max(b[k].float().abs().max().item(), 1e-12))
    return worst


@pytest.mark.parametrize("gas, clip", [(1, 0.0), (2, 1.0)])
def test_matches_deepspeed_semantics_in_memory(tmp_path, gas, clip):
    cfg = ds_config(tmp_path / "nvme", gradient_accumulation_steps=gas, gradient_clipping=clip)
    data = batches(6 * gas)
    ref = reference(tiny_gpt2(), copy.deepcopy(cfg), data)
    model = tiny_gpt2()
    engine, optimizer, loader, sched = offloadpp.initialize(
        model=model, model_parameters=model.parameters(), config=cfg
    )
    assert engine.gradient_accumulation_steps() == gas
    assert engine.train_batch_size() == 2 * gas
    assert loader is None and sched is not None
    train(engine, data)
    assert engine.global_steps == 6
    lr = cfg["optimizer"]["params"]["lr"]
    assert compare_weights(engine.module.state_dict(), ref.state_dict(), lr=lr, steps=6) < 1e-5
    assert engine.get_lr() == pytest.approx([g["lr"] for g in sched.optimizer.param_groups])
    engine.close()


def test_checkpoint_resume_continues_identically(tmp_path):
    cfg = ds_config(tmp_path / "nvme")
    data = batches(6)
    model = tiny_gpt2()
    straight, *_ = offloadpp.initialize(model=model, config=copy.deepcopy(cfg))
    losses_straight = train(straight, data)
    want = {k: v.clone() for k, v in straight.module.state_dict().items()}
    straight.close()

    cfg2 = ds_config(tmp_path / "nvme2")
    model = tiny_gpt2()
    first, *_ = offloadpp.initialize(model=model, config=copy.deepcopy(cfg2))
    losses = train(first, data[:3])
    first.save_checkpoint(str(tmp_path / "ckpt"), client_state={"epoch": 7})
    first.close()
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step3"

    cfg3 = ds_config(tmp_path / "nvme3")
    model = tiny_gpt2(seed=123)  # different weights: all must come from the checkpoint
    resumed, *_ = offloadpp.initialize(model=model, config=copy.deepcopy(cfg3))
    path, client = resumed.load_checkpoint(str(tmp_path / "ckpt"))
    assert path.endswith("global_step3") and client == {"epoch": 7}
    assert resumed.global_steps == 3
    losses += train(resumed, data[3:])
    assert losses == pytest.approx(losses_straight, rel=1e-6, abs=1e-6)
    assert max_rel(resumed.module.state_dict(), want) < 1e-6
    resumed.close()


def test_load_checkpoint_without_one_returns_none(tmp_path):
    model = tiny_gpt2()
    engine, *_ = offloadpp.initialize(model=model, config=ds_config(tmp_path / "nvme"))
    assert engine.load_checkpoint(str(tmp_path / "nothing")) == (None, None)
    engine.close()


def test_save_16bit_model_loads_with_from_pretrained(tmp_path):
    model = tiny_gpt2()
    engine, *_ = offloadpp.initialize(model=model, config=ds_config(tmp_path / "nvme"))
    train(engine, batches(2))
    out = tmp_path / "export"
    engine.save_16bit_model(str(out), "model.safetensors")
    model.config.save_pretrained(str(out))
    current = {k: v.clone() for k, v in engine.module.state_dict().items()}
    engine.close()
    loaded = transformers.GPT2LMHeadModel.from_pretrained(str(out), local_files_only=True)
    assert max_rel(loaded.state_dict(), current) == 0.0
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()


def test_training_data_gives_a_dataloader(tmp_path):
    data = torch.utils.data.TensorDataset(torch.randint(0, 96, (10, 16)))
    model = tiny_gpt2()
    engine, _, loader, _ = offloadpp.initialize(
        model=model, config=ds_config(tmp_path / "nvme"), training_data=data
    )
    (ids,) = next(iter(loader))
    assert ids.shape == (2, 16)
    engine.close()


def test_bad_block_fails_at_start_naming_the_field(tmp_path):
    cfg = ds_config(tmp_path / "nvme")
    cfg["offloadpp"]["prefetch_dept"] = 2
    with pytest.raises(OffloadppConfigError, match=r"offloadpp\.prefetch_dept"):
        offloadpp.initialize(model=tiny_gpt2(), config=cfg)


def test_unsupported_optimizer_is_refused(tmp_path):
    cfg = ds_config(tmp_path / "nvme")
    cfg["optimizer"] = {"type": "Lamb", "params": {"lr": 1e-3}}
    with pytest.raises(OffloadppConfigError, match="optimizer.type"):
        offloadpp.initialize(model=tiny_gpt2(), config=cfg)


def test_config_from_args_like_the_launcher(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds_config(tmp_path / "nvme")))

    class Args:
        deepspeed_config = str(path)
        local_rank = 0

    engine, *_ = offloadpp.initialize(args=Args(), model=tiny_gpt2())
    assert type(engine).__name__ == "OffloadppEngine"
    engine.close()


def test_without_the_block_it_is_deepspeed(tmp_path, monkeypatch):
    from offloadpp.bench.ab import free_port

    port = str(free_port())  # a fixed port collides with any other run on the machine
    for k, v in dict(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=port
    ).items():
        monkeypatch.setenv(k, v)
    cfg = ds_config(tmp_path / "nvme")
    del cfg["offloadpp"]
    cfg["zero_optimization"] = {"stage": 0}
    import deepspeed

    engine, *_ = offloadpp.initialize(model=tiny_gpt2(), config=cfg)
    assert type(engine) is deepspeed.DeepSpeedEngine  # DeepSpeed's own, not offloadpp's subclass
    train(engine, batches(1))


@pytest.mark.parametrize("as_callable", [False, True])
def test_client_optimizer_groups_and_scheduler(tmp_path, as_callable):
    """optimizer= a torch AdamW with two param groups (or a callable making it) and lr_scheduler=
    a torch scheduler built on it: each group keeps its own hyper-parameters as the schedule
    changes them, as torch trains the same model."""
    cfg = ds_config(tmp_path / "nvme", gradient_clipping=1.0)
    del cfg["optimizer"], cfg["scheduler"]
    data = batches(5)

    def make_opt(params_of):
        decay = [p for n, p in params_of if p.ndim >= 2]
        rest = [p for n, p in params_of if p.ndim < 2]
        return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0,
                                  "betas": (0.8, 0.95)}], lr=2e-3)  # fmt: skip

    def warmup(opt):
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))

    ref = tiny_gpt2()
    opt_ref = make_opt(list(ref.named_parameters()))
    sched_ref = warmup(opt_ref)
    for ids in data:
        ref(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt_ref.step()
        opt_ref.zero_grad()
        sched_ref.step()

    model = tiny_gpt2()
    named = list(model.named_parameters())
    if as_callable:
        client = lambda params: make_opt(named)  # noqa: E731  DeepSpeed calls it with the parameters
        engine, opt, _, sched = offloadpp.initialize(
            model=model, optimizer=client, lr_scheduler=warmup, config=cfg
        )
    else:
        client = make_opt(named)
        engine, opt, _, sched = offloadpp.initialize(model=model, optimizer=client, lr_scheduler=warmup(client),
                                                     config=cfg)  # fmt: skip
        assert opt.param_groups is client.param_groups  # one set of group dicts: either object drives it
    assert len(opt.param_groups) == 2 and engine.optimizer_name() == "AdamW"
    train(engine, data)
    assert compare_weights(engine.module.state_dict(), ref.state_dict(), lr=2e-3, steps=5) < 1e-5
    engine.close()


def test_checkpoint_with_frozen_parameters(tmp_path):
    """A model with a frozen parameter (not given to the optimizer): the checkpoint holds the
    trainable state and a reference to the frozen base (docs/frozen.md, exclude_frozen_parameters
    or not); loading over the same base gives back every value, over another base is refused."""
    from offloadpp.runtime.checkpoint import CheckpointError

    base = tiny_gpt2(0).transformer.wpe.weight.detach().clone()

    def frozen_model(seed, same_base=True):
        m = tiny_gpt2(seed)
        if same_base:
            with torch.no_grad():
                m.transformer.wpe.weight.copy_(base)
        m.transformer.wpe.weight.requires_grad_(False)
        return m

    def trainable(m):
        return [p for p in m.parameters() if p.requires_grad]

    model = frozen_model(0)
    engine, *_ = offloadpp.initialize(
        model=model, model_parameters=trainable(model), config=ds_config(tmp_path / "nvme")
    )
    train(engine, batches(2))
    engine.save_checkpoint(str(tmp_path / "ckpt"), exclude_frozen_parameters=True)
    saved = {k: v.clone() for k, v in engine.module.state_dict().items()}
    engine.close()

    other = frozen_model(7)
    resumed, *_ = offloadpp.initialize(
        model=other, model_parameters=trainable(other), config=ds_config(tmp_path / "nvme2")
    )
    resumed.load_checkpoint(str(tmp_path / "ckpt"), load_module_strict=False)
    got = resumed.module.state_dict()
    assert all(torch.equal(got[k], saved[k]) for k in saved)
    resumed.close()

    another = frozen_model(7, same_base=False)
    refused, *_ = offloadpp.initialize(
        model=another, model_parameters=trainable(another), config=ds_config(tmp_path / "nvme3")
    )
    with pytest.raises(CheckpointError, match="frozen parameters' values differ"):
        refused.load_checkpoint(str(tmp_path / "ckpt"), load_module_strict=False)
    refused.close()


def test_a_port_taken_between_probe_and_bind_is_probed_again():
    """A plain-python process starts its process group of one on a port it probed free; on a busy
    machine another process can take it before the store binds: the start probes again."""
    import subprocess
    import sys

    code = """
import socket, os
import offloadpp.integrations.deepspeed.build as build
taken = socket.socket(); taken.bind(("127.0.0.1", 0)); taken.listen(1)
ports = iter([taken.getsockname()[1]])
real = build._free_port
build._free_port = lambda: next(ports, None) or real()
assert build.ensure_process_group(None, None) == 1
assert int(os.environ["MASTER_PORT"]) != taken.getsockname()[1]
print("started on a fresh port")
"""
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR")
    }
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0 and "started on a fresh port" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]


def test_train_batch_runs_vertical_windows_like_deepspeed_semantics(tmp_path):
    """PipelineEngine's train_batch(data_iter) on offloadpp: each call pulls
    gradient_accumulation_steps micro-batches, runs the window (vertically from the second on:
    runtime/accumulate.py) and the step, and returns the window's mean loss; with dropout on,
    clipping 1.0 and WarmupLR the weights equal torch's AdamW over the same windows. eval_batch
    gives the mean loss of the model in eval mode."""
    from deepspeed.runtime.lr_schedules import WarmupLR

    gas, steps = 4, 3
    cfg = ds_config(tmp_path / "nvme", gradient_accumulation_steps=gas, gradient_clipping=1.0,
                    offloadpp={"enabled": True, "accumulation": "vertical"})  # fmt: skip

    def model():
        m = tiny_gpt2()
        m.config.resid_pdrop = m.config.embd_pdrop = m.config.attn_pdrop = 0.1
        torch.manual_seed(0)
        return transformers.GPT2LMHeadModel(m.config)

    data = batches(steps * gas)
    ref = model()
    p = cfg["optimizer"]["params"]
    opt = torch.optim.AdamW(
        ref.parameters(), lr=p["lr"], betas=tuple(p["betas"]), eps=p["eps"], weight_decay=0.1
    )
    sched = WarmupLR(opt, **cfg["scheduler"]["params"])
    want = []
    for s in range(steps):
        torch.manual_seed(10 + s)
        losses = []
        for ids in data[s * gas : (s + 1) * gas]:
            loss = ref(input_ids=ids, labels=ids).loss
            (loss / gas).backward()
            losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        sched.step()
        want.append(sum(losses) / gas)
    engine, *_ = offloadpp.initialize(model=model(), config=cfg)
    it = iter([{"input_ids": ids, "labels": ids} for ids in data])
    got = []
    for s in range(steps):
        torch.manual_seed(10 + s)
        loss = engine.train_batch(data_iter=it if s == 0 else None)
        assert isinstance(loss, torch.Tensor) and loss.dim() == 0
        got.append(loss.item())
    assert engine.global_steps == steps and engine.micro_steps == steps * gas
    assert engine.last_report is engine.reports[-1] and engine.last_report.grad_norm is not None
    assert got == pytest.approx(want, rel=1e-5)
    assert compare_weights(engine.module.state_dict(), ref.state_dict(), lr=p["lr"], steps=steps) < 1e-5
    assert engine.get_lr() == pytest.approx([g["lr"] for g in opt.param_groups])
    ref.eval()
    with torch.no_grad():
        want_eval = sum(ref(input_ids=ids, labels=ids).loss.item() for ids in data[:gas]) / gas
    ev = iter([(ids, None, None, None, None, None, None, None, ids) for ids in data[:gas]])  # (positional)
    got_eval, logits = engine.eval_batch(ev, return_logits=True)
    assert got_eval.item() == pytest.approx(want_eval, rel=1e-5) and logits.shape == (2, 16, 96)
    with pytest.raises(RuntimeError, match="half done"):
        engine.backward(engine(input_ids=data[0], labels=data[0]).loss)
        engine.step()
        engine.train_batch(iter([{"input_ids": data[0], "labels": data[0]}] * gas))
    engine.close()
