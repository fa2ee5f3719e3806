"""The device budget a plan gives holds what the runtime charges against it (issue 37): the plan's
device need counted from the rule the runtime's pools charge by, checked through the engine on
small models (offloadpp/bench/device_budget.py; the full sweep is `offloadpp bench device-budget`).
"""

from __future__ import annotations

import tempfile
import typing

import pytest

from offloadpp.bench.device_budget import Case, cases, check
from offloadpp.planner import Plan, UnitSpec, all_on_ssd
from offloadpp.planner.holds import holds
from offloadpp.planner.peaks import peak_bytes
from offloadpp.planner.schedule import build_schedule, structure
from offloadpp.planner.spec import HEAD_ONLY_POLICIES, ActivationPolicyName

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")


def _issue_engine(
    tmp_path, clipping: float, dtype: str = "bf16", host_budget: typing.Optional[int] = None, window: int = 1
):
    """Issue 37's shape through offloadpp.initialize: GPT-2, 2 layers, width 64, vocabulary 512,
    micro-batch 2, 16-bit on the CPU device, the state on SSD."""
    import offloadpp

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=64,
                                  bos_token_id=0, eos_token_id=0)  # fmt: skip
    model = transformers.GPT2LMHeadModel(cfg)
    nvme = str(tmp_path)
    ds = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": window,
        "gradient_clipping": clipping,
        dtype: {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": nvme},
                              "offload_optimizer": {"device": "nvme", "nvme_path": nvme}},
        "offloadpp": {"enabled": True, **({"host_budget_bytes": host_budget} if host_budget else {}),
                      **({"accumulation": "vertical"} if window > 1 else {})},
    }  # fmt: skip
    engine, *_ = offloadpp.initialize(model=model, model_parameters=model.parameters(), config=ds)
    for pool in (engine.runtime.device_pool, engine.runtime.host_pool):
        pool.release_wait_s = 3.0  # an under-count raises in seconds, not after the engine's minute
    return engine


def _steps_within_the_device_budget(engine, *, steps: int, seq: int, seed: int) -> None:
    """`steps` training steps on random tokens, each within the device budget and without a wait
    for room (one that never ends raises BudgetExceededError: after 3 s, _issue_engine)."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randint(0, 512, (2, seq), generator=g)
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()
        dev = engine.last_report.budget("device")
        assert dev.longest_wait_s < 1.0, dev
        assert dev.run_peak_bytes <= dev.budget_bytes


@pytest.mark.parametrize("seq", [16, 32])
def test_issue_37_shape_trains_without_a_wait(tmp_path, seq):
    """bf16 without clipping: every update runs in backward and writes a new bf16 copy of its
    unit's weights into the device pool, the tied embeddings' at a visit that holds no weights
    (their backward needs none). The plan did not count that copy on the device: the first
    step waited for room that never came and raised BudgetExceededError (after 60 s)."""
    engine = _issue_engine(tmp_path, 0.0)
    try:
        _steps_within_the_device_budget(engine, steps=3, seq=seq, seed=seq)
    finally:
        engine.close()


@pytest.mark.parametrize("clipping", [0.0, 1.0])
def test_a_vertical_windows_kept_gradients_are_charged_and_planned_on_the_cpu_device(tmp_path, clipping):
    """bf16 windows of 4 run vertically (train_batch) on the CPU device at the streaming minimum:
    each micro-batch's gradient of the unit in backward is kept until the unit's are complete
    (runtime/window_grads.py) and charged to the device pool; the plan counts them
    (holds.visit_grad_bytes), so no window waits for room past the budget. Fails (a wait, then
    BudgetExceededError) where the plan counts one micro-batch's gradients."""
    engine = _issue_engine(tmp_path, clipping, window=4)
    try:
        assert engine.runtime.plan.vertical
        g = torch.Generator().manual_seed(7)
        for _ in range(2):
            batches = [torch.randint(0, 512, (2, 32), generator=g) for _ in range(4)]
            engine.train_batch(iter([{"input_ids": x, "labels": x} for x in batches]))
            dev = engine.last_report.budget("device")  # (the first window records its RNG tape horizontally)
            assert dev.longest_wait_s < 1.0, dev
            assert dev.run_peak_bytes <= dev.budget_bytes
    finally:
        engine.close()


def test_a_16bit_compute_copy_kept_in_host_memory_is_drawn_from_the_host_pool(tmp_path):
    """bf16 on the CPU device with host memory to spare: the plan keeps units' 16-bit weights in
    host memory (planner/keep.py's "weights@host", counted as host bytes). The runtime drew those
    copies from the device pool, where they filled the streaming device budget: the next unit
    waited for room that never came (GPT-2 1.31B in issue 33's A/B; here at initialize)."""
    from offloadpp.planner import Tier

    engine = _issue_engine(tmp_path, 1.0, host_budget=20_000_000)
    try:
        plan = engine.runtime.plan
        assert any(p.weights is Tier.HOST for p in plan.placements), plan.describe()
        _steps_within_the_device_budget(engine, steps=2, seq=16, seed=0)
    finally:
        engine.close()


def test_a_16bit_update_in_backward_holds_its_new_copy_on_the_cpu_device():
    """The planner's rule for the copy an update writes (schedule.py, the Note on updates' copies):
    on the CPU device with 16-bit compute it is device memory, held at the unit's backward visit
    (where its update runs) even where the visit holds no weights, and not host memory; on CUDA
    it is host memory (the pinned copy carried up), not the device's."""
    units = (
        UnitSpec("embed", 4096, backward_needs_weights=False),
        UnitSpec("b0", 8192),
        UnitSpec("b1", 8192),
        UnitSpec("head", 64, borrows=("embed",)),
    )
    for device in ("cpu", "cuda"):
        plan = Plan(units, all_on_ssd(units), device=device, compute_dtype="bf16", prefetch_depth=2,
                    optim_prefetch_depth=1)  # fmt: skip
        sched = structure(plan)
        last = holds(plan, sched)[-1]  # the embeddings' backward visit: alive holds nothing of theirs
        assert "embed" not in sched.alive[-1]
        assert ("embed" in last.device) == (device == "cpu")
        dev, host = peak_bytes(plan)
        assert (dev, host) == (build_schedule(plan).peak_device_bytes, build_schedule(plan).peak_host_bytes)


# A few configurations of the sweep, seconds each: both architectures, every dtype, clipping on
# and off, the CPU device and the stand-in (the GPU's copy path), accumulation, the issue's case among them.
FAST = (
    Case("gpt2", 2, 64, 512, 2, 16, "bf16", 0.0, "keep", True, "cpu", seed=1),
    Case("gpt2", 2, 384, 4096, 2, 24, "bf16", 0.0, "host", False, "cpu", seed=10),
    Case("llama", 2, 64, 256, 2, 16, "fp16", 1.0, "recompute", True, "cpu", seed=2, accumulation=2),
    Case("llama", 1, 96, 1024, 3, 8, "fp32", 1.0, "partial_ssd", False, "standin", seed=3),
    Case("gpt2", 3, 64, 128, 1, 16, "bf16", 1.0, "auto", True, "cpu", seed=4),
    Case("gpt2", 2, 64, 256, 2, 16, "bf16", 1.0, "recompute_nested_host", False, "standin", seed=5),
    Case("llama", 2, 64, 256, 2, 16, "fp16", 1.0, "partial_host_tail", True, "standin", seed=6),
    Case("gpt2", 2, 64, 256, 2, 16, "bf16", 0.0, "partial_refetch_ssd", False, "cpu", seed=7),
    Case("llama", 2, 64, 256, 2, 16, "bf16", 1.0, "partial_last_refetch_host", True, "standin", seed=8),
)


@pytest.mark.parametrize("case", FAST, ids=lambda c: c.label().replace(" ", "-"))
def test_fast_slice_of_the_sweep(case):
    with tempfile.TemporaryDirectory() as root:
        out = check(case, root, steps=3, max_wait_s=1.0, release_wait_s=3.0)
    assert not out.violations, (case, out.violations)
    assert 0 < out.device_peak <= out.device_budget


def test_the_sweep_is_seeded_and_spans_its_ranges():
    a, b = cases(300, seed=0), cases(300, seed=0)
    assert a == b and a != cases(300, seed=1)
    assert {c.arch for c in a} == {"gpt2", "llama"} and {c.dtype for c in a} == {"fp32", "bf16", "fp16"}
    assert {c.layers for c in a} == {1, 2, 3, 4} and {c.batch for c in a} == {1, 2, 3, 4}
    assert min(c.width for c in a) == 32 and max(c.width for c in a) == 512
    assert min(c.vocab for c in a) == 64 and max(c.vocab for c in a) == 4096
    assert {c.clipping > 0 for c in a} == {True, False} and {c.fused for c in a} == {True, False}
    assert {c.device for c in a} == {"cpu", "standin"} and {c.accumulation for c in a} == {1, 2}
    # (the fused head's own policies are no policy of every unit: spec.HEAD_ONLY_POLICIES)
    assert {c.policy for c in a} == set(typing.get_args(ActivationPolicyName)) - set(HEAD_ONLY_POLICIES)
