# The habits. Every target that runs code first makes sure the environment is set up.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
# The suite runs on TEST_WORKERS pytest-xdist workers (one per core of the 2-core CI machine; see
# docs/performance.md, "Test suite time"). --dist loadgroup keeps tests marked
# xdist_group(name) on one worker, one after another. TEST_WORKERS=0 runs it in this process.
# Here and not in pyproject's addopts: a single file or -k selection is quicker in one process
# (two workers' start costs about 10 s of CPU).
TEST_WORKERS ?= 2
# DeepSpeed's JIT-built ops go into this clone's venv, not the ~/.cache every clone shares
# (a build killed there leaves a lock that hangs the next one; see tests/conftest.py).
export TORCH_EXTENSIONS_DIR ?= $(abspath $(VENV))/torch_extensions

.PHONY: setup build test lint format demo doctor bench bench-io bench-adam bench-step bench-ab bench-ab-finetune bench-capacity bench-capacity-host16 bench-capacity-2b bench-capacity-2b-export bench-capacity-2b-export-checkpoint bench-regress elastic-trials gpu-check clean

setup:
	@bash scripts/bootstrap.sh

build: setup

test: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

# The suite's time in one process and on TEST_WORKERS workers, side by side (docs/performance.md,
# "Test suite time"): wall, user and sys seconds of each (children included). TEST_FILES: only these.
.PHONY: test-time
test-time: setup
	@for n in 0 $(TEST_WORKERS); do \
	  bash -c 'TIMEFORMAT="test-time: -n '$$n' wall %R s user %U s sys %S s"; time $$0 "$$@" | tail -1' \
	    $(PY) -m pytest -q -n $$n --dist loadgroup $(PYTEST_ARGS) $(TEST_FILES); \
	done

lint: setup
	$(PY) -m ruff check offloadpp tests scripts examples
	$(PY) -m ruff format --check offloadpp tests scripts examples

format: setup
	$(PY) -m ruff format offloadpp tests scripts examples
	$(PY) -m ruff check --fix offloadpp tests scripts examples

# The main job: fine-tune with all training state on disk, then a short A/B against ZeRO-Infinity.
demo: setup
	@bash scripts/demo.sh

# On a CUDA machine: build, the runtime's correctness on the GPU, the A/B against ZeRO-Infinity (TFLOPS).
gpu-check:
	@bash scripts/gpu_check.sh

doctor: setup
	$(PY) -m offloadpp doctor --dir runs/nvme

# The benchmarks behind docs/performance.md (each prints its table; JSON with --json PATH).
bench: bench-io bench-adam bench-step bench-ab

bench-io: setup
	$(PY) -m offloadpp bench io --dir runs/nvme --size-mb 1024

bench-adam: setup
	$(PY) -m offloadpp bench adam --params 100M

bench-step: setup
	$(PY) -m offloadpp bench step

bench-ab: setup
	$(PY) -m offloadpp bench ab --config ds_configs/gpt2_45m.offloadpp.json --steps 10 --out runs/ab

# The fine-tune of a trained model (GPT-2 45M trained 300 steps in memory on the same text first): how many steps speculate.
bench-ab-finetune: setup
	$(PY) -m offloadpp bench ab --config ds_configs/gpt2_45m.offloadpp.json --steps 20 --pretrain-steps 300 --out runs/ab-finetune

# Larger than memory through the user's path (about 5 minutes each here with ZeRO-Infinity's run; 25 and 75 GB of disk).
bench-capacity: setup
	$(PY) -m offloadpp bench capacity --steps 5 --zero --zero-steps 3

# The same with 16 GiB of host memory for offloadpp (still below ZeRO-Infinity's 19.7 GiB): issue 21's bar 0.30x.
bench-capacity-host16: setup
	$(PY) -m offloadpp bench capacity --steps 5 --zero --zero-steps 3 --offloadpp-block '{"host_budget_bytes": "16GiB"}' --max-vs-zero 0.30 --max-rss-gib 19.7

bench-capacity-2b: setup
	$(PY) -m offloadpp bench capacity --layers 28 --width 2560 --heads 20 --checkpoint --zero

# The same model exported the two ways users export it, each loaded back with from_pretrained (about 56 GB of disk).
bench-capacity-2b-export: setup
	$(PY) -m offloadpp bench capacity --layers 28 --width 2560 --heads 20 --export

# The same model saved with save_checkpoint, then `offloadpp export` on it in a process of its own after the
# run, its peak RSS measured, the folder loaded back with from_pretrained (about 75 GB of disk at the peak).
bench-capacity-2b-export-checkpoint: setup
	$(PY) -m offloadpp bench capacity --layers 28 --width 2560 --heads 20 --export-checkpoint

# bench step and bench ab of an older commit and of this tree, alternately: make bench-regress OLD=<commit>
bench-regress: setup
	scripts/bench_regress.sh $(OLD)

# Elastic restarts: 10 runs of examples/elastic_finetune.py under torchrun --max-restarts 1, a random rank
# killed with SIGKILL at a random point in each; every run must end bit-identical to an uninterrupted one
# (about 8 minutes here). NODES=2: the same over two simulated nodes (scripts/multinode.sh, root);
# NODE_LOCAL=1 with it: the checkpoints on each node's own disk.
elastic-trials: setup
	$(PY) scripts/elastic_trials.py --trials $(or $(TRIALS),10) --nodes $(or $(NODES),1) $(if $(NODE_LOCAL),--node-local) --json runs/elastic/trials.json

clean:
	rm -rf build *.egg-info offloadpp/_C*.so runs
