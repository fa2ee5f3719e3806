"""`python -m offloadpp run train.py ARGS`: an unchanged DeepSpeed script (it calls
deepspeed.initialize) trains on offloadpp's engine, started with python or the deepspeed
launcher (whose --local_rank reaches the script as it would without offloadpp)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parent.parent

SCRIPT = """
import argparse
import deepspeed
import torch
import transformers

p = argparse.ArgumentParser()
p.add_argument("--local_rank", type=int, default=-1)
p.add_argument("--steps", type=int, default=2)
args = deepspeed.add_config_arguments(p).parse_args()
torch.manual_seed(0)
cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=32, vocab_size=96)
model = transformers.GPT2LMHeadModel(cfg)
engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
for _ in range(args.steps):
    x = torch.randint(0, 96, (2, 16)).to(engine.device)
    engine.backward(engine(input_ids=x, labels=x).loss)
    engine.step()
print("RESULT", type(engine).__name__, args.local_rank, engine.global_steps, __name__, flush=True)
"""


def _setup(tmp_path: Path) -> tuple[Path, Path]:
    (tmp_path / "nvme").mkdir()
    off = {"device": "nvme", "nvme_path": str(tmp_path / "nvme")}
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 3, "offload_param": off, "offload_optimizer": off},
           "offloadpp": {"enabled": True}}  # fmt: skip
    (tmp_path / "ds.json").write_text(json.dumps(cfg))
    (tmp_path / "train.py").write_text(SCRIPT)
    return tmp_path / "train.py", tmp_path / "ds.json"


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def _result(p: subprocess.CompletedProcess) -> list[str]:
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT")]
    assert lines, p.stdout[-3000:]
    return lines[-1].split()[1:]


def test_run_an_unchanged_deepspeed_script(tmp_path):
    script, cfg = _setup(tmp_path)
    p = subprocess.run(
        [sys.executable, "-m", "offloadpp", "run", str(script), "--deepspeed", "--deepspeed_config", str(cfg)],
        capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert _result(p) == ["OffloadppEngine", "-1", "2", "__main__"]


def test_run_under_the_deepspeed_launcher(tmp_path):
    launcher = shutil.which("deepspeed", path=os.path.dirname(sys.executable))
    if launcher is None:
        pytest.skip("the deepspeed launcher is not installed beside this python")
    script, cfg = _setup(tmp_path)
    p = subprocess.run(
        [launcher, "--num_gpus", "1", "--module", "offloadpp", "run", str(script), "--deepspeed",
         "--deepspeed_config", str(cfg)],
        capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert _result(p) == ["OffloadppEngine", "0", "2", "__main__"]


def test_the_trainer_example_runs_on_offloadpp(tmp_path):
    """examples/trainer_finetune.py, an ordinary Trainer script, as the README starts it."""
    cfg = json.loads((REPO / "ds_configs" / "hf_trainer.offloadpp.json").read_text())
    for key in ("offload_param", "offload_optimizer"):
        cfg["zero_optimization"][key]["nvme_path"] = str(tmp_path / "nvme")
    (tmp_path / "nvme").mkdir()
    (tmp_path / "ds.json").write_text(json.dumps(cfg))
    p = subprocess.run(
        [sys.executable, "-m", "offloadpp", "run", str(REPO / "examples" / "trainer_finetune.py"),
         "--deepspeed", str(tmp_path / "ds.json"), "--model", "gpt2-tiny", "--max_steps", "2",
         "--per_device_train_batch_size", "2", "--seq_len", "32", "--samples", "16", "--report_to", "none",
         "--output_dir", str(tmp_path / "out"), "--save_to", str(tmp_path / "final")],
        capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "engine: OffloadppEngine, steps: 2" in p.stdout
    model = __import__("transformers").AutoModelForCausalLM.from_pretrained(str(tmp_path / "final"))
    assert model.config.n_layer == 2
