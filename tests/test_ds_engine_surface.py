"""OffloadppEngine against DeepSpeedEngine's public surface: every public method is written by
offloadpp, inherited because it only reads the parsed config, or refused naming what to use
instead; the inherited ones are checked by reading their source; and the members training
scripts and Trainer use behave as DeepSpeed's do."""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest
import torch

pytest.importorskip("deepspeed")
from deepspeed.runtime.engine import DeepSpeedEngine  # noqa: E402
from test_deepspeed_integration import batches, ds_config, tiny_gpt2, train  # noqa: E402

import offloadpp  # noqa: E402
from offloadpp.integrations.deepspeed import surface  # noqa: E402
from offloadpp.integrations.deepspeed.engine import OffloadppEngine  # noqa: E402


def test_every_public_method_is_written_inherited_or_refused():
    public = surface.public_methods(OffloadppEngine)
    written = surface.own(OffloadppEngine)
    own = {n for n in public if n in written and n not in surface.UNSUPPORTED}
    assert not OffloadppEngine._unclassified, sorted(OffloadppEngine._unclassified)
    assert public <= own | set(surface.INHERITED) | set(surface.UNSUPPORTED)
    assert not (own & set(surface.INHERITED)), "written here and listed as inherited"
    assert set(surface.INHERITED) <= public
    # the ones Trainer, Accelerate and DeepSpeed scripts call are offloadpp's own
    for name in ("backward", "step", "forward", "train", "eval", "zero_grad", "save_checkpoint", "load_checkpoint",
                 "save_16bit_model", "set_gradient_accumulation_boundary", "is_gradient_accumulation_boundary",
                 "get_global_grad_norm", "was_step_applied", "no_sync", "get_lr", "destroy", "module_state_dict",
                 "zero_gather_16bit_weights_on_model_save", "optimizer_name", "train_batch",
                 "eval_batch"):  # fmt: skip
        assert name in written, name


def _self_attrs(fn) -> set:
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    return {
        n.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self"
    }


@pytest.mark.parametrize("name", surface.INHERITED)
def test_inherited_methods_read_only_the_config(name):
    member = inspect.getattr_static(DeepSpeedEngine, name)
    fn = member.fget if isinstance(member, property) else member
    touched = _self_attrs(fn)
    allowed = {"_config"} | set(surface.INHERITED) | surface.own(OffloadppEngine)
    assert touched <= allowed, (
        f"{name} reads {sorted(touched - allowed)}, which OffloadppEngine does not have"
    )


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model = tiny_gpt2()
    eng, *_ = offloadpp.initialize(model=model, config=ds_config(tmp_path_factory.mktemp("nvme")))
    yield eng
    eng.close()


def test_what_scripts_and_trainer_read(engine):
    assert isinstance(engine, DeepSpeedEngine) and isinstance(engine, torch.nn.Module)
    assert engine.device == torch.device("cpu") and engine.local_rank == 0 and engine.world_size == 1
    assert engine.fp16_enabled() is False and engine.bfloat16_enabled() is False
    assert engine.zero_optimization_stage() == 3 and engine.gradient_accumulation_steps() == 1
    assert engine.train_micro_batch_size_per_gpu() == 2 and engine.train_batch_size() == 2
    assert engine.config["offloadpp"] == {"enabled": True}
    names = [n for n, _ in engine.named_parameters()]
    assert names[0].startswith("module.") and len(names) == len(list(engine.module.parameters()))
    sd = engine.state_dict()
    assert set(sd) == {"module." + k for k in engine.module.state_dict()}
    assert not any(torch.isnan(v).any() for v in sd.values() if v.is_floating_point())
    assert engine.config_class is engine.module.config_class  # attributes pass through to the model
    with engine.no_sync():
        pass
    train(engine, batches(2))
    assert engine.was_step_applied() and engine.global_steps == 2 and engine.global_samples == 4
    assert engine.get_lr() == [g["lr"] for g in engine.optimizer.param_groups]
    assert engine.get_mom() == [g["betas"] for g in engine.optimizer.param_groups]
    assert engine.eval() is engine and not engine.module.training
    engine.train()
    assert engine.to("cpu") is engine


@pytest.mark.parametrize("name", sorted(surface.UNSUPPORTED))
def test_refused_members_name_the_alternative(engine, name):
    with pytest.raises(
        NotImplementedError, match=f"DeepSpeedEngine.{name} is not supported by offloadpp's engine: .+"
    ):
        getattr(engine, name)()


def test_moving_or_casting_the_engine_is_refused(engine):
    with pytest.raises(NotImplementedError, match="places the weights on cpu itself"):
        engine.to(torch.float16)
    with pytest.raises(NotImplementedError, match="retain_graph"):
        engine.backward(torch.zeros(()), retain_graph=True)


def test_fp16_auto_cast_casts_floating_inputs_and_pulled_batches(tmp_path):
    """fp16 with auto_cast: forward's arguments and the micro-batches train_batch/eval_batch pull
    have their floating tensors cast to fp16, the rest (token ids, non-tensors) as they were; off
    by default."""
    cfg = ds_config(tmp_path / "nvme", fp16={"enabled": True, "auto_cast": True, "initial_scale_power": 8})
    eng, *_ = offloadpp.initialize(model=tiny_gpt2(), config=cfg)
    try:
        ids, mask = torch.zeros(2, 16, dtype=torch.long), torch.ones(2, 16)
        (args, kwargs) = eng._autocast(((ids, mask), {"attention_mask": mask, "n": 3}))
        assert args[0] is ids and args[1].dtype == torch.float16
        assert kwargs["attention_mask"].dtype == torch.float16 and kwargs["n"] == 3
        pulled = eng._pull(iter([{"input_ids": ids, "attention_mask": mask}] * 2), 2)
        assert [(b["input_ids"].dtype, b["attention_mask"].dtype) for b in pulled] == [
            (torch.long, torch.float16)
        ] * 2
    finally:
        eng.close()
    plain, *_ = offloadpp.initialize(model=tiny_gpt2(), config=ds_config(tmp_path / "plain"))
    try:
        assert plain._pull(iter([{"attention_mask": mask}]), 1)[0]["attention_mask"].dtype == torch.float32
    finally:
        plain.close()
