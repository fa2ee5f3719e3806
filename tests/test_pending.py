"""Deferred updates applied at the unit's next visit (runtime/pending.py): a step that clips
leaves its updates pending, and whatever reads the state between steps (an eval forward,
state_dict, a checkpoint, close) sees exactly torch AdamW after clip_grad_norm_; the pending
updates are bit for bit the update pass's and read less."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_runtime import LR, VOCAB, WD, batches, compare, streaming_config, tiny_gpt2  # noqa: E402

from offloadpp.assemble import assemble_engine  # noqa: E402
from offloadpp.optim import AdamHyper  # noqa: E402

CLIP = 1.0


def _engine(tmp_path, ref, lazy: bool = True, **settings):
    tmp_path.mkdir(exist_ok=True)
    eng = assemble_engine(
        copy.deepcopy(ref),
        streaming_config(tmp_path, gradient_clipping=CLIP, **settings),
        hyper=AdamHyper(lr=LR, weight_decay=WD),
    )
    if not lazy:
        eng.optimizer.lazy = False  # the update pass after backward, as before pending updates
    return eng


def _step_both(ref, opt, eng, x):
    loss_ref = ref(input_ids=x, labels=x).loss
    loss_ref.backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
    opt.step()
    opt.zero_grad()
    loss = eng(input_ids=x, labels=x).loss
    eng.backward(loss)
    return eng.step()


def _pending(eng) -> int:
    return sum(u.pending is not None for u in eng.units)


def test_eval_state_dict_and_save_between_steps_see_torch_adamw_with_clipping(tmp_path):
    ref = tiny_gpt2()
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    eng = _engine(tmp_path / "a", ref)
    data = batches(8)
    probe = batches(1, seed=7)[0]
    try:
        assert eng.optimizer.lazy and eng.plan.deferred_update
        for i, x in enumerate(data[:6]):
            r = _step_both(ref, opt, eng, x)
            assert r.grad_norm > CLIP  # clipping decided every update
            assert _pending(eng) == len(eng.units)  # left for the next visits
            if i == 1:  # an eval forward applies them as it visits each unit
                with torch.no_grad():
                    got = eng(input_ids=probe).logits
                    want = ref(input_ids=probe).logits
                assert _pending(eng) == 0
                assert torch.allclose(got, want, rtol=1e-4, atol=1e-5)
            if i == 3:  # a parameter read (state_dict) completes them first
                assert compare(eng.module.state_dict(), ref.state_dict(), i + 1) < 1e-5
                assert _pending(eng) == 0
        eng.save_state(str(tmp_path / "ckpt"))  # with every update pending
        assert _pending(eng) == 0
        assert compare(eng.module.state_dict(), ref.state_dict(), 6) < 1e-5
    finally:
        eng.close()
    # the checkpoint holds the step's result: a new engine loaded from it goes on as torch does
    eng = _engine(tmp_path / "b", tiny_gpt2(seed=3))
    try:
        eng.load_state(str(tmp_path / "ckpt"))
        assert compare(eng.module.state_dict(), ref.state_dict(), 6) < 1e-5
        for x in data[6:]:
            _step_both(ref, opt, eng, x)
        assert compare(eng.module.state_dict(), ref.state_dict(), 8) < 1e-5
    finally:
        eng.close()


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_pending_updates_equal_the_update_pass_bit_for_bit_and_read_less(tmp_path, dtype):
    cfg = transformers.GPT2Config(n_layer=6, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    torch.manual_seed(0)
    ref = transformers.GPT2LMHeadModel(cfg)
    data = batches(5)
    out = {}
    for lazy in (True, False):
        # one unit's state read ahead: the update pass's peak is low enough that the schedule keeps
        # only some units' weights across the step, so the others' masters are read twice by it
        eng = _engine(tmp_path / str(lazy), ref, lazy=lazy, optim_prefetch_depth=0, compute_dtype=dtype)
        assert len(eng.schedule.next_keep) < len(eng.units)
        try:
            reads = []
            for x in data:
                loss = eng(input_ids=x, labels=x).loss
                eng.backward(loss)
                reads.append(eng.step().ssd_read_bytes)
            out[lazy] = ({k: v.clone() for k, v in eng.module.state_dict().items()}, reads)
        finally:
            eng.close()
    (got, lazy_reads), (want, pass_reads) = out[True], out[False]
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k
    # the steady steps: where the weights are the master (fp32), an update applied at the visit
    # reads it with the weights, once (bf16: the compute copy it writes is not read back, the
    # fp32 master is read instead: about even)
    if dtype == "fp32":
        assert sum(lazy_reads[2:]) < sum(pass_reads[2:]), (lazy_reads, pass_reads)
    else:
        assert sum(lazy_reads[2:]) <= 1.02 * sum(pass_reads[2:]), (lazy_reads, pass_reads)


def test_close_with_updates_pending_applies_them(tmp_path):
    ref = tiny_gpt2()
    eng = _engine(tmp_path, ref)
    x = batches(1)[0]
    loss = eng(input_ids=x, labels=x).loss
    eng.backward(loss)
    eng.step()
    assert _pending(eng) == len(eng.units)
    adam_before = eng.optimizer.adam_s
    eng.close()
    assert _pending(eng) == 0
    assert eng.optimizer.adam_s > adam_before


def test_accumulation_with_pending_updates_trains_like_adamw(tmp_path):
    ref = tiny_gpt2()
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    eng = _engine(tmp_path, ref, gradient_accumulation_steps=2)
    data = batches(8)
    try:
        for s in range(4):
            for m in range(2):
                x = data[2 * s + m]
                (ref(input_ids=x, labels=x).loss / 2).backward()
                loss = eng(input_ids=x, labels=x).loss
                eng.backward(loss)
                eng.step()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
            opt.step()
            opt.zero_grad()
            assert _pending(eng) == len(eng.units)
        assert compare(eng.module.state_dict(), ref.state_dict(), 4) < 1e-5
    finally:
        eng.close()


def test_a_pending_update_interrupted_before_its_job_is_said_not_waited_for(tmp_path):
    """A KeyboardInterrupt between counting a pending update in flight and handing its job to
    the worker left a name in flight with no job: close() at exit then spun forever (a Ctrl-C
    test's child hung the suite). It is now an error naming the unit."""
    import threading

    ref = tiny_gpt2()
    eng = _engine(tmp_path, ref)
    x = batches(1)[0]
    eng.backward(eng(input_ids=x, labels=x).loss)
    eng.step()
    opt = eng.optimizer
    opt.complete_pending()
    unit = eng.units[0]
    opt._lazy_inflight.add(unit.name)  # what the interrupted _submit_pending left
    raised: list = []
    t = threading.Thread(
        target=lambda: raised.append(pytest.raises(RuntimeError, opt.complete_pending)), daemon=True
    )
    t.start()
    t.join(timeout=30)
    assert not t.is_alive(), "complete_pending spun with nothing in flight"
    assert raised and unit.name in str(raised[0].value) and "interrupted" in str(raised[0].value)
    eng.close()


_EXIT_SCRIPT = """
import atexit, sys
import test_pending as T
from test_runtime import batches, tiny_gpt2
eng = T._engine(__import__("pathlib").Path(sys.argv[1]), tiny_gpt2())
x = batches(1)[0]
eng.backward(eng(input_ids=x, labels=x).loss)
eng.step()
print("before", T._pending(eng), flush=True)
atexit.register(lambda: print("after", T._pending(eng), eng._closed, flush=True))  # runs after the close
if sys.argv[2] == "raise":
    raise KeyboardInterrupt
"""


@pytest.mark.parametrize("how", ["return", "raise"])
def test_a_script_that_ends_without_close_applies_the_last_steps_pending_updates_at_exit(tmp_path, how):
    """The interpreter stops its thread pools before atexit callbacks run: a close at atexit found
    the optimizer's worker refusing the pending updates ("closing an engine at exit: cannot
    schedule new futures after shutdown"); a Ctrl-C test's child printed it. The close now runs
    before the pools stop (runtime/lifetime.py), whether the script returns or raises."""
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT, str(tmp_path), how], cwd=here, env=env,
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert "closing an engine at exit" not in r.stderr, r.stderr[-3000:]
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith(("before", "after"))]
    assert lines[0] != "before 0" and lines[-1] == "after 0 True", (r.stdout, r.stderr[-3000:])
    assert (r.returncode == 0) == (how == "return"), r.stderr[-3000:]
