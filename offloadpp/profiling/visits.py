"""The runtime's own cost per unit visit, for the hardware profile (runtime_*_visit_s): a small
model under an OffloadEngine with everything in memory against the same model plain."""

from __future__ import annotations

import shutil
import tempfile
import time


def measure_visit_overhead(rounds: int = 15) -> tuple[float, float]:
    """(forward, backward) seconds the runtime adds per unit visit on this CPU (its hooks: fetch
    decisions, binding parameters, the saved-tensor hooks, handing gradients to the optimizer):
    a small GPT-2 under an OffloadEngine with everything in memory against the same model plain,
    interleaved, medians. (0, 0) without transformers."""
    import copy
    import statistics

    import torch

    try:
        import transformers
    except ImportError:
        return 0.0, 0.0
    from offloadpp.assemble import assemble_engine
    from offloadpp.optim import AdamHyper
    from offloadpp.planner import Settings
    from offloadpp.runtime import RuntimeConfig, unit_specs

    transformers.logging.set_verbosity_error()
    cfg = transformers.GPT2Config(n_layer=6, n_embd=64, n_head=4, vocab_size=256, n_positions=64,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    plain = copy.deepcopy(model)
    ids = torch.randint(0, 256, (1, 32))
    specs = unit_specs(model)
    big = 1 << 34  # everything in memory: only the runtime's own work differs from plain torch
    d = tempfile.mkdtemp(prefix="offloadpp-visit-")
    try:
        rc = RuntimeConfig(nvme_paths=[d], settings=Settings(device_budget_bytes=big, host_budget_bytes=big),
                           device="cpu", ssd_read_gbps=1.0, ssd_write_gbps=1.0, log_every=0)  # fmt: skip
        with assemble_engine(model, rc, hyper=AdamHyper(lr=1e-4)) as eng:
            pf, pb, ef, eb = [], [], [], []
            for i in range(rounds + 2):
                t0 = time.perf_counter()
                out = plain(input_ids=ids, labels=ids)
                t1 = time.perf_counter()
                out.loss.backward()
                t2 = time.perf_counter()
                plain.zero_grad(set_to_none=True)
                t3 = time.perf_counter()
                out = eng(input_ids=ids, labels=ids)
                t4 = time.perf_counter()
                eng.backward(out.loss)
                t5 = time.perf_counter()
                eng.step()
                if i >= 2:
                    pf.append(t1 - t0)
                    pb.append(t2 - t1)
                    ef.append(t4 - t3)
                    eb.append(t5 - t4)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    n = len(specs)
    med = statistics.median
    return max(0.0, (med(ef) - med(pf)) / n), max(0.0, (med(eb) - med(pb)) / n)
