#!/usr/bin/env bash
# The main job: fine-tune a GPT-2-style model (44.8M parameters) on the docstrings of Python's
# standard library with all training state on disk under runs/demo/nvme, launched by DeepSpeed's
# own launcher; save a checkpoint and exported weights; then a short A/B against ZeRO-Infinity on
# the same model, data and initial weights.
#   STEPS=40 AB_STEPS=6 TEXT=path/to/corpus.txt MODEL=gpt2-45m bash scripts/demo.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
STEPS=${STEPS:-40}
AB_STEPS=${AB_STEPS:-6}
MODEL=${MODEL:-gpt2-45m}
OUT=runs/demo
mkdir -p "$OUT"
export PYTHONWARNINGS=${PYTHONWARNINGS:-ignore::FutureWarning}

echo "== 1/3 doctor: what this machine offers"
"$PY" -m offloadpp doctor --dir "$OUT/nvme"

echo "== 2/3 fine-tuning $MODEL for $STEPS steps, training state on disk ($OUT/nvme)"
text_arg=()
[ -n "${TEXT:-}" ] && text_arg=(--text "$TEXT")
# The demo config is the A/B's offloadpp config with the swap directory under runs/demo.
"$PY" - "$OUT/demo.json" <<'PYCFG'
import json, sys
cfg = json.load(open("ds_configs/gpt2_45m.offloadpp.json"))
for key in ("offload_param", "offload_optimizer"):
    cfg["zero_optimization"][key]["nvme_path"] = "runs/demo/nvme"
json.dump(cfg, open(sys.argv[1], "w"), indent=2)
PYCFG
.venv/bin/deepspeed --num_gpus 1 examples/finetune.py --deepspeed_config "$OUT/demo.json" \
  --model "$MODEL" --steps "$STEPS" --out "$OUT" "${text_arg[@]}" 2>&1 \
  | grep --line-buffered -vE "^\[[0-9-]+ [0-9:,]+\] \[(INFO|WARNING)\]"

echo "== 3/3 A/B against ZeRO-Infinity ($AB_STEPS steps each, same initial weights and data)"
# ZeRO-Infinity's side JIT-builds DeepSpeed's ops on first use: a build an earlier, interrupted
# demo left half done would otherwise hold its lock forever (op_locks.py)
"$PY" -m offloadpp.integrations.deepspeed.op_locks
"$PY" -m offloadpp bench ab --config ds_configs/gpt2_45m.offloadpp.json --model "$MODEL" \
  --steps "$AB_STEPS" --out "$OUT/ab" --nvme-dir "$OUT/ab-swap" 2>&1 \
  | grep --line-buffered -vE "^\[[0-9-]+ [0-9:,]+\] \[(INFO|WARNING)\]|FutureWarning|return func"
echo "demo done: checkpoint $OUT/checkpoint, weights $OUT/model, A/B report $OUT/ab/ab.json and $OUT/ab/ab.png"
