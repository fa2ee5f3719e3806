#!/usr/bin/env bash
# No-regression check: `offloadpp bench step` and `offloadpp bench ab` from an older commit and
# from this tree, alternately in one run (the machine drifts: only side-by-side ratios compare).
#
#   scripts/bench_regress.sh OLD_COMMIT [OUT_DIR]      (default OUT_DIR: runs/regress)
#   PY=/work/main/.venv/bin/python scripts/bench_regress.sh OLD_COMMIT
#
# The old commit is checked out in a worktree under /tmp and its native module built there; each
# side runs from its own tree with this tree's .venv (python -m puts the cwd first on sys.path).
# This tree's step also runs with --checksum-cost, and the A/B once more with payload checksums
# off ("io": {"checksum": false}): the cost of CRC-32C, beside the rest.
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: $0 OLD_COMMIT [OUT_DIR]" >&2; exit 2; }
NEW=$(cd "$(dirname "$0")/.." && pwd)
OLD_REV=$(git -C "$NEW" rev-parse --short "$1")
OUT=$(mkdir -p "${2:-$NEW/runs/regress}" && cd "${2:-$NEW/runs/regress}" && pwd)
OLD=/tmp/offloadpp-regress-$OLD_REV
# PY: the interpreter (default this tree's .venv; where .venv is a link to a shared one, name the
# real path: DeepSpeed's JIT ops record the interpreter they were built with)
PY=${PY:-$NEW/.venv/bin/python}
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$(dirname "$(dirname "$PY")")/torch_extensions}

if [ ! -d "$OLD" ]; then
  git -C "$NEW" worktree add --detach "$OLD" "$OLD_REV" >/dev/null
fi
(cd "$OLD" && "$PY" setup.py build_ext --inplace >/dev/null)

CFG=$NEW/ds_configs/gpt2_45m.offloadpp.json
NOCRC=$OUT/gpt2_45m.nocrc.json
"$PY" - "$CFG" "$NOCRC" <<'EOF'
import json, sys
c = json.load(open(sys.argv[1]))
c.setdefault("offloadpp", {}).setdefault("io", {})["checksum"] = False
json.dump(c, open(sys.argv[2], "w"), indent=2)
EOF

# a benchmark exits 1 when its bar is not met: report it and go on to the next
set +e
tree() { if [ "$1" = old ]; then echo "$OLD"; else echo "$NEW"; fi; }
echo "# old $OLD_REV ($OLD), new $(git -C "$NEW" rev-parse --short HEAD) ($NEW), $(date -u +%FT%T)"
for i in 1 2; do
  for side in old new; do
    extra=""
    [ $side = new ] && extra=--checksum-cost
    echo "== step $side $i $(date -u +%T)"
    (cd "$(tree $side)" && "$PY" -m offloadpp bench step $extra --dir "$OUT/step-$side" \
      --json "$OUT/step-$side-$i.json" 2>/dev/null | tail -7)
  done
done
for i in 1 2; do
  for side in old new new-nocrc; do
    cfg=$CFG
    [ $side = new-nocrc ] && cfg=$NOCRC
    echo "== ab $side $i $(date -u +%T)"
    (cd "$(tree ${side%-nocrc})" && "$PY" -m offloadpp bench ab --config "$cfg" --steps 10 \
      --out "$OUT/ab-$side-$i" --nvme-dir "$OUT/abswap-$side" 2>&1 | tail -12)
  done
done
echo "== done $(date -u +%T)"
