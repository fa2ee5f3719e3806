"""One side of tests/test_ds_monitor.py's comparison, in a process of its own (DeepSpeed's engine
and its comm layer keep process-wide state): the same tiny GPT-2, initial weights and batches
under DeepSpeed's own engine or offloadpp's, one config, DeepSpeed's training loop.

    python tests/ds_monitor_run.py SPEC.json OUT.json

SPEC: {"side": "deepspeed"|"offloadpp", "config": {...}, "steps": N}; the optimizer is the config's
(ZeRO-Infinity's offloaded optimizer is DeepSpeedCPUAdam, offloadpp's its CPUAdam). OUT gets each
micro-batch's loss and the engine's counters.
"""

from __future__ import annotations

import json
import os
import socket
import sys


def main(spec_path: str, out_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    with socket.socket() as s:  # plain `python script.py`: a process group of one, on a free port
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in dict(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    ).items():
        os.environ[k] = v

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from ds_import_worker import tiny
    from test_deepspeed_integration import batches

    cfg = spec["config"]
    model = tiny("gpt2", 0)  # (large enough that ZeRO-Infinity puts some of it on NVMe)
    if spec["side"] == "deepspeed":
        import deepspeed

        from offloadpp.integrations.deepspeed.build import _without_shm_comm

        with (
            _without_shm_comm()
        ):  # (its shared-memory all-reduce op is minutes to build, and moot for one rank)
            deepspeed.init_distributed(dist_backend="gloo", verbose=False)
        cfg = {k: v for k, v in cfg.items() if k != "offloadpp"}
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    else:
        import offloadpp

        engine, *_ = offloadpp.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    gas = cfg["gradient_accumulation_steps"]
    losses = []
    for ids in batches(spec["steps"] * gas, micro=cfg["train_micro_batch_size_per_gpu"]):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    out = {"engine": type(engine).__name__, "losses": losses, "global_steps": engine.global_steps,
           "global_samples": engine.global_samples}  # fmt: skip
    if hasattr(engine, "close"):  # offloadpp's: its swap files go
        engine.close()
    with open(out_path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
