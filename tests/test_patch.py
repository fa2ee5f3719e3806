"""offloadpp.patch_deepspeed(): what it changes in DeepSpeed, Accelerate and transformers, and that
unpatch_deepspeed() puts everything back."""

from __future__ import annotations

import pytest
import torch

deepspeed = pytest.importorskip("deepspeed")
acc_accelerator = pytest.importorskip("accelerate.accelerator")
transformers_ds = pytest.importorskip("transformers.integrations.deepspeed")

import offloadpp  # noqa: E402
from offloadpp.integrations.deepspeed import is_patched  # noqa: E402
from offloadpp.integrations.deepspeed.initialize import ClientOptimizer  # noqa: E402


@pytest.fixture
def patched():
    before = (deepspeed.initialize, acc_accelerator.map_pytorch_optim_to_deepspeed)
    offloadpp.patch_deepspeed()
    offloadpp.patch_deepspeed()  # idempotent
    yield before
    offloadpp.unpatch_deepspeed()
    assert (deepspeed.initialize, acc_accelerator.map_pytorch_optim_to_deepspeed) == before
    assert not is_patched()


def test_initialize_is_routed_and_restored(patched):
    assert is_patched() and deepspeed.initialize is not patched[0]
    assert deepspeed.initialize.__wrapped__ is patched[0]


def test_accelerates_cpu_adam_conversion_waits_for_the_config(patched):
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)
    deferred = acc_accelerator.map_pytorch_optim_to_deepspeed(opt)
    assert isinstance(deferred, ClientOptimizer) and deferred.optimizer is opt
    assert deferred.convert is patched[1]  # what DeepSpeed gets when the block is off


def test_transformers_does_not_build_a_zero3_model_for_offloadpp(patched):
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    plain = transformers_ds.HfDeepSpeedConfig(dict(cfg))
    assert plain.is_zero3() and transformers_ds.is_deepspeed_zero3_enabled()
    ours = transformers_ds.HfDeepSpeedConfig(dict(cfg, offloadpp={"enabled": True}))
    assert (
        not ours.is_zero3() and not transformers_ds.is_deepspeed_zero3_enabled()
    )  # from_pretrained: no zero.Init
    del plain, ours
    transformers_ds.unset_hf_deepspeed_config()


def test_the_hf_save_calls_are_routed_and_restored():
    import accelerate
    import transformers

    targets = [(accelerate.Accelerator, "save_model"), (accelerate.Accelerator, "get_state_dict"),
               (transformers.Trainer, "save_model"), (transformers.Trainer, "_move_model_to_device")]  # fmt: skip
    before = [cls.__dict__[name] for cls, name in targets]
    offloadpp.patch_deepspeed()
    try:
        assert all(getattr(cls.__dict__[name], "__offloadpp__", False) for cls, name in targets)
    finally:
        offloadpp.unpatch_deepspeed()
    assert [cls.__dict__[name] for cls, name in targets] == before


def test_a_trainer_around_an_engines_module_leaves_its_placeholders_alone(tmp_path):
    """A Trainer built without a DeepSpeed config moves its model to args.device ('cpu:0' on the
    CPU), and .to() copied every stride-0 placeholder into a whole tensor: the model's weights
    made whole in memory. With the patch the engine's placeholders stay as they are."""
    transformers = pytest.importorskip("transformers")
    from offloadpp.integrations.deepspeed.patch_save import holds_placeholders

    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=96, n_positions=32)
    model = transformers.GPT2LMHeadModel(cfg)
    (tmp_path / "nvme").mkdir()
    ds = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(tmp_path / "nvme")},
                                "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path / "nvme")}},
          "offloadpp": {"enabled": True}}  # fmt: skip
    engine, *_ = offloadpp.initialize(model=model, config=ds)
    try:
        assert holds_placeholders(engine.module)
        args = transformers.TrainingArguments(output_dir=str(tmp_path / "t"), report_to=[], use_cpu=True)
        offloadpp.patch_deepspeed()
        try:
            transformers.Trainer(model=engine.module, args=args)
        finally:
            offloadpp.unpatch_deepspeed()
        assert holds_placeholders(engine.module)
        assert all(not any(p.stride()) for p in engine.module.parameters() if p.numel() > 1)
    finally:
        engine.close()
