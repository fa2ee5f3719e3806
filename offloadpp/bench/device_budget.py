"""`offloadpp bench device-budget`: a seeded sweep of small models through the engine, checking
that the plan's device budget holds what the runtime charges against it.

Each configuration (GPT-2 or Llama, 1-4 layers, width 32-512, vocabulary 64-4096, micro-batch
1-4, fp32/bf16/fp16, clipping on or off, an activation policy, the fused head on or off, the CPU
as the device or the stand-in accelerator, which runs the GPU's copy path, one micro-batch per
step or two accumulated) is planned by the
resolve stage with "auto" budgets, as `offloadpp.initialize` plans it (every array on SSD, the
budgets the streaming minimum: an under-count there is a wait or an error, not slack), and
trained for a few steps. A violation is any of:

- an error (on the CPU device a pool that waited `--release-wait` seconds without room raises
  BudgetExceededError; the stand-in raises at once when a device copy would pass the budget);
- a request that waited longer than `--max-wait` seconds for room in a pool (the StepReport's
  BudgetUse.longest_wait_s): the plan under-counted and the run was paced on a release;
- a device or activation peak above its budget (the engine's own accounting).

Bar (issue 37): zero violations over at least 300 configurations. tests/test_device_budget.py runs
a few of them in the default test run; each cause found has its own test there.
"""

from __future__ import annotations

import argparse
import datetime
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

from offloadpp.planner.spec import ACTIVATION_POLICIES, HEAD_ONLY_POLICIES

# every policy a unit of every kind may take (the fused head's own left out)
POLICIES = tuple(p for p in ACTIVATION_POLICIES if p not in HEAD_ONLY_POLICIES)
DTYPES = ("fp32", "bf16", "fp16")
MAX_WAIT_S = 1.0
RELEASE_WAIT_S = 3.0


@dataclass(frozen=True)
class Case:
    """One configuration of the sweep."""

    arch: str  # "gpt2" or "llama"
    layers: int
    width: int
    vocab: int
    batch: int
    seq: int
    dtype: str
    clipping: float
    policy: str
    fused: bool
    device: str  # "cpu" or "standin"
    seed: int = 0
    accumulation: int = 1  # micro-batches per step (gradient_accumulation_steps, each its own backward)

    def label(self) -> str:
        return (
            f"{self.arch} L{self.layers} w{self.width} v{self.vocab} b{self.batch}x{self.seq} {self.dtype} "
            f"clip{self.clipping:g} {self.policy} {'fused' if self.fused else 'unfused'} {self.device}"
            + (f" gas{self.accumulation}" if self.accumulation > 1 else "")
        )


@dataclass
class Outcome:
    case: Case
    violations: list[str]
    device_budget: int = 0
    device_peak: int = 0
    activation_budget: int = -1  # -1: not limited
    activation_peak: int = 0
    longest_wait_s: float = 0.0
    seconds: float = 0.0


def cases(count: int, seed: int = 0) -> list[Case]:
    """`count` configurations drawn from the sweep's ranges by a generator seeded with `seed`: the
    same list for the same arguments. Widths are multiples of 32 (attention heads of 32)."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        out.append(
            Case(
                arch=rng.choice(("gpt2", "llama")),
                layers=rng.randint(1, 4),
                width=32 * rng.randint(1, 16),
                vocab=rng.choice((64, 128, 256, 512, 1024, 2048, 4096)),
                batch=rng.randint(1, 4),
                seq=rng.choice((8, 16, 24, 32)),
                dtype=rng.choice(DTYPES),
                clipping=rng.choice((0.0, 1.0)),
                policy=rng.choice(POLICIES),
                fused=rng.random() < 0.5,
                device="standin" if rng.random() < 0.25 else "cpu",
                seed=seed * 100003 + i,
                accumulation=rng.choice((1, 1, 2)),
            )
        )
    return out


def build_model(case: Case):
    import torch
    import transformers

    torch.manual_seed(case.seed)
    heads = max(1, case.width // 32)
    if case.arch == "gpt2":
        cfg = transformers.GPT2Config(
            n_layer=case.layers, n_embd=case.width, n_head=heads, vocab_size=case.vocab, n_positions=64,
            bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        return transformers.GPT2LMHeadModel(cfg)
    cfg = transformers.LlamaConfig(
        num_hidden_layers=case.layers, hidden_size=case.width, intermediate_size=2 * case.width,
        num_attention_heads=heads, num_key_value_heads=heads, vocab_size=case.vocab,
        max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0,
        tie_word_embeddings=case.seed % 2 == 0,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg)


def check(case: Case, root: str, *, steps: int = 3, max_wait_s: float = MAX_WAIT_S,
          release_wait_s: float = RELEASE_WAIT_S) -> Outcome:  # fmt: skip
    """Trains `case` for `steps` steps under a swap folder in `root` and returns what broke."""
    import torch

    from offloadpp.assemble import assemble_engine
    from offloadpp.optim import AdamHyper
    from offloadpp.planner import ActivationSettings, Settings
    from offloadpp.runtime import RuntimeConfig

    out = Outcome(case, [])
    t0 = time.perf_counter()
    path = tempfile.mkdtemp(prefix="devbudget-", dir=root)
    engine = None
    try:
        model = build_model(case)
        settings = Settings(
            compute_dtype=case.dtype,
            gradient_clipping=case.clipping,
            gradient_accumulation_steps=case.accumulation,
            activations=ActivationSettings(policy=case.policy, fused_loss=case.fused),
        )
        cfg = RuntimeConfig(nvme_paths=[path], settings=settings, device=case.device)
        engine = assemble_engine(model, cfg, hyper=AdamHyper(lr=1e-3))
        for pool in (engine.device_pool, engine.host_pool):
            pool.release_wait_s = release_wait_s  # an under-count is an error in seconds, not a minute
        gen = torch.Generator().manual_seed(case.seed)
        for _ in range(steps):
            for _ in range(case.accumulation):
                x = torch.randint(0, case.vocab, (case.batch, case.seq), generator=gen)
                engine.backward(engine(input_ids=x, labels=x).loss)
                report = engine.step()  # (None before the boundary)
            for use in report.budgets:
                if use.name == "device":
                    out.device_budget, out.device_peak = (
                        use.budget_bytes,
                        max(out.device_peak, use.peak_bytes),
                    )
                if use.name == "activations":
                    out.activation_budget = -1 if use.budget_bytes is None else use.budget_bytes
                    out.activation_peak = max(out.activation_peak, use.peak_bytes)
                if use.budget_bytes is not None and use.peak_bytes > use.budget_bytes:
                    out.violations.append(f"{use.name} peak {use.peak_bytes} > budget {use.budget_bytes}")
                out.longest_wait_s = max(out.longest_wait_s, use.longest_wait_s)
                if use.longest_wait_s > max_wait_s:
                    out.violations.append(f"{use.name} pool waited {use.longest_wait_s:.2f} s for room")
    except Exception as e:  # noqa: BLE001 - every failure of a configuration is a finding of the sweep
        out.violations.append(f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
    finally:
        if engine is not None:
            try:
                engine.close()
            except Exception as e:  # noqa: BLE001
                out.violations.append(f"close: {type(e).__name__}: {e}")
        shutil.rmtree(path, ignore_errors=True)
    out.seconds = time.perf_counter() - t0
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--count", type=int, default=300, help="configurations")
    p.add_argument("--seed", type=int, default=0, help="seeds the configurations drawn")
    p.add_argument("--steps", type=int, default=3, help="steps per configuration")
    p.add_argument("--max-wait", type=float, default=MAX_WAIT_S, help="seconds a pool may wait for room")
    p.add_argument("--release-wait", type=float, default=RELEASE_WAIT_S,
                   help="seconds a pool waits for a release before it raises (the engine's: 60)")  # fmt: skip
    p.add_argument("--only", type=int, default=None, help="run only the configuration of this index")
    p.add_argument(
        "--dir", default=os.path.join("runs", "bench-device-budget"), help="swap folders (removed)"
    )
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")


def run(args: argparse.Namespace) -> int:
    import logging

    import torch

    from offloadpp.bench.step import _machine

    logging.getLogger("offloadpp").setLevel(logging.ERROR)
    torch.set_num_threads(args.threads)
    os.makedirs(args.dir, exist_ok=True)
    todo = list(enumerate(cases(args.count, args.seed)))
    if args.only is not None:
        todo = [todo[args.only]]
    print(f"# offloadpp bench device-budget: {len(todo)} configurations, seed {args.seed}, {args.steps} steps each, "
          f"max wait {args.max_wait:g} s; {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; "
          f"{_machine()}", flush=True)  # fmt: skip
    bad = []
    t0 = time.perf_counter()
    for i, case in todo:
        o = check(
            case, args.dir, steps=args.steps, max_wait_s=args.max_wait, release_wait_s=args.release_wait
        )
        status = "ok" if not o.violations else "VIOLATION " + "; ".join(o.violations)
        print(f"{i:4d} {case.label():70s} dev {o.device_peak:>9d}/{o.device_budget:<9d} "
              f"wait {o.longest_wait_s:5.2f}s {o.seconds:5.1f}s {status}", flush=True)  # fmt: skip
        if o.violations:
            bad.append((i, o))
    print(f"# {len(todo)} configurations, {len(bad)} with violations, {time.perf_counter() - t0:.0f} s")
    for i, o in bad:
        print(f"#   {i}: {asdict(o.case)}: {'; '.join(o.violations)}")
    shutil.rmtree(args.dir, ignore_errors=True)
    return 1 if bad else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
