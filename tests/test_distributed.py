"""Data parallel: two CPU ranks (gloo) under torchrun and under the deepspeed launcher train a
tiny GPT-2 (every array on SSD, clipping 1.0, weight decay) to the weights of one process of
torch AdamW on the global batch, each rank keeping its shard of the state.

Note: the reference. The ranks sum their gradients, which is the global batch's gradient summed
in another order than one backward over the whole batch. Where a gradient is at the level of
rounding noise (here an element of GPT-2's attention weights whose first gradient is 1e-8
against a median of 6e-5), Adam's first step normalises that noise into an update of order lr,
so torch itself, run once over the whole batch and once over its two halves accumulated, ends
5e-5 apart (relative) on such elements: the same effect numerics.py describes for the key
bias. The bar (1e-5) is therefore against one process of torch AdamW on the global batch with
the gradient accumulated over the ranks' parts; against one backward over the whole batch the
ranks must be as close as torch's two orders are to each other.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from dp_common import GLOBAL_BATCH, LR, WD, reference
from numerics import compare_weights

pytest.importorskip("transformers")

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
BIN = os.path.dirname(sys.executable)
WORKER = os.path.join(HERE, "dp_worker.py")


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")  # this checkout's offloadpp
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def torchrun(args: list[str], nproc: int = 2, timeout: float = 300) -> None:
    # The free port _port() found is released before torchrun binds it: another process may take
    # it in between. That (and only that) is retried, on a new port.
    for attempt in range(3):
        cmd = [os.path.join(BIN, "torchrun"), "--nproc_per_node", str(nproc), "--master_port", str(_port()),
               WORKER, *args]  # fmt: skip
        try:
            _run(cmd, timeout)
            return
        except AssertionError as e:
            if attempt == 2 or "address already in use" not in str(e).lower():
                raise


def _port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(cmd: list[str], timeout: float) -> None:
    r = subprocess.run(cmd, env=_env(), cwd=REPO, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout[-4000:]}\n{r.stderr[-8000:]}"
        )


def ranks(out, n=2) -> list[dict]:
    return [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(n)]


def weights(out) -> dict:
    return torch.load(os.path.join(out, "weights.pt"))


def test_two_ranks_train_like_one_process_and_keep_half_the_state_each(tmp_path, on_device):
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    out = tmp_path / "out"
    torchrun([str(out), "--nvme", str(nvme), "--steps", "4", "--clip", "1.0"])
    got = weights(out)
    assert compare_weights(got, reference(4, clip=1.0, parts=2), lr=LR, steps=4) < 1e-5
    # against one backward over the whole batch: no further than torch's two orders are apart
    whole = reference(4, clip=1.0)
    torch_gap = compare_weights(reference(4, clip=1.0, parts=2), whole, lr=LR, steps=4)
    assert compare_weights(got, whole, lr=LR, steps=4) <= torch_gap + 1e-5
    info = ranks(out)
    for i in range(4):  # one global norm, every rank the same, clipping active
        norms = {d["reports"][i]["grad_norm"] for d in info}
        assert len(norms) == 1 and norms.pop() > 1.0
        assert all(d["reports"][i]["comm_bytes"] > 0 and d["reports"][i]["ranks"] == 2 for d in info)
    # each rank's swap files are its own
    assert sorted(os.listdir(nvme)) == ["rank0", "rank1"]

    # Partitioning: the two ranks' swap files add up to one process's, not twice it.
    one = tmp_path / "one"
    one.mkdir()
    eng = _single_engine(one, accum=1)
    try:
        _train_single(eng, 0, 2, parts=1)  # (the first step's deferred writes land in the second)
        single, single_plan = eng.disk_bytes(), eng.plan.ssd_bytes()
    finally:
        eng.close()
    per_rank = [d["disk_bytes"] for d in info]
    # Each rank keeps half, up to padding: every shard of every array is padded to a 4 KiB
    # block and has a header block of its own, which on this 0.1M-parameter model (a head unit
    # of 128 parameters) is 13% of the total; N copies would be 100% more.
    assert per_rank[0] == per_rank[1], per_rank
    assert single <= sum(per_rank) <= 1.15 * single, (per_rank, single)
    # and so do the plans: each rank's SSD bytes are its shards' (UnitSpec.shards)
    for d in info:
        assert 0.5 * single_plan <= d["plan_ssd_bytes"] <= 0.6 * single_plan


def test_two_ranks_with_frozen_parameters_train_like_one_process(tmp_path):
    """Frozen parameters over several ranks stay in the units' flat buffers (docs/frozen.md:
    the frozen segment is one rank's): they are not updated, the rest trains as torch does."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    out = tmp_path / "out"
    torchrun([str(out), "--nvme", str(nvme), "--steps", "3", "--clip", "1.0", "--freeze"])
    got, want = weights(out), reference(3, clip=1.0, parts=2, freeze=True)
    assert compare_weights(got, want, lr=LR, steps=3) < 1e-5
    first = reference(0, clip=1.0, freeze=True)
    assert torch.equal(got["transformer.wpe.weight"], first["transformer.wpe.weight"])
    assert torch.equal(got["transformer.h.0.mlp.c_fc.weight"], first["transformer.h.0.mlp.c_fc.weight"])


def test_two_ranks_train_a_peft_lora_model_like_one_process(tmp_path):
    """A get_peft_model model through offloadpp.initialize over two ranks: the adapters train as
    torch + peft on the global batch, the base is never changed (its parameters stay in the
    units' flat buffers over ranks: docs/frozen.md "Over several data-parallel ranks")."""
    pytest.importorskip("peft")
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    out = tmp_path / "out"
    torchrun([str(out), "--nvme", str(nvme), "--steps", "3", "--clip", "1.0", "--lora", "--api", "deepspeed"])
    got, want = weights(out), reference(3, clip=1.0, parts=2, lora=True)
    assert compare_weights(got, want, lr=LR, steps=3) < 1e-5
    first = reference(0, clip=1.0, lora=True)
    base = [k for k in first if "lora_" not in k]
    assert base and all(torch.equal(got[k], first[k]) for k in base)
    assert any(not torch.equal(got[k], first[k]) for k in first if "lora_" in k)


def test_a_lora_checkpoint_between_one_process_and_two_ranks_is_refused_saying_how_to_resume(tmp_path):
    """One process keeps frozen parameters by reference (a frozen segment), several ranks as state
    in the flat buffers (docs/frozen.md): a checkpoint of either does not load into the other,
    and the refusal says which saved it and how to resume, both ways."""
    pytest.importorskip("peft")
    from dp_common import tiny_gpt2

    from offloadpp.assemble import assemble_engine
    from offloadpp.optim import AdamHyper
    from offloadpp.planner import Settings
    from offloadpp.runtime import RuntimeConfig
    from offloadpp.runtime.checkpoint import CheckpointError

    (tmp_path / "nvme2").mkdir()
    ranks_ckpt, one_ckpt = tmp_path / "ranks_ckpt", tmp_path / "one_ckpt"
    torchrun([str(tmp_path / "out"), "--nvme", str(tmp_path / "nvme2"), "--steps", "1", "--clip", "1.0", "--lora",
              "--save", str(ranks_ckpt)])  # fmt: skip
    cfg = RuntimeConfig(nvme_paths=[str(tmp_path / "nvme1")], settings=Settings(gradient_clipping=1.0), device="cpu",
                        ssd_read_gbps=2.0, ssd_write_gbps=2.0, log_every=0)  # fmt: skip
    (tmp_path / "nvme1").mkdir()
    with assemble_engine(tiny_gpt2(lora=True), cfg, hyper=AdamHyper(lr=LR, weight_decay=WD)) as eng:
        assert any(u.frozen_numel for u in eng.plan.units)
        with pytest.raises(
            CheckpointError, match="saved by 2 data-parallel ranks and this run is one process"
        ):
            eng.load_state(str(ranks_ckpt))
        one_ckpt.mkdir()
        eng.save_state(str(one_ckpt))
    with pytest.raises(AssertionError, match="saved by one process and this run is 2 data-parallel ranks"):
        torchrun([str(tmp_path / "out2"), "--nvme", str(tmp_path / "nvme2"), "--steps", "1", "--clip", "1.0",
                  "--lora", "--load", str(one_ckpt)])  # fmt: skip


def test_save_16bit_model_over_two_ranks(tmp_path):
    """Every rank takes part in gathering each unit, rank 0 writes the shards; the whole dict is
    refused on every rank when one rank is short of memory (a rank building it alone would wait
    forever in a gather)."""
    import transformers

    nvme, out, export = tmp_path / "nvme", tmp_path / "out", tmp_path / "export"
    nvme.mkdir()
    torchrun([str(out), "--nvme", str(nvme), "--steps", "2", "--api", "deepspeed", "--export", str(export)])
    assert (export / "pytorch_model.bin.index.json").exists()
    got = transformers.GPT2LMHeadModel.from_pretrained(str(export), local_files_only=True).state_dict()
    want = weights(out)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert [d["whole_dict"] for d in ranks(out)] == ["refused", "refused"]


def test_deepspeed_launcher_two_cpu_ranks(tmp_path):
    """The same run started by the `deepspeed` launcher (two CPU ranks, gloo), with gradient
    accumulation: offloadpp.initialize starts torch.distributed through DeepSpeed's own
    init_distributed, so DeepSpeed's config counts both ranks. DeepSpeed's csv_monitor on: one
    row a step (rank 0 writes), the train loss the mean over both ranks of their steps' losses."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    out = tmp_path / "out"
    cmd = [os.path.join(BIN, "deepspeed"), "--num_gpus", "2", "--master_port", str(_port()), WORKER, str(out),
           "--nvme", str(nvme), "--api", "deepspeed", "--steps", "3", "--accum", "2", "--clip", "1.0",
           "--monitor", str(tmp_path / "csv")]  # fmt: skip
    _run(cmd, 600)
    # each rank's micro-batches are a quarter of the global batch: accumulated over four parts
    assert compare_weights(weights(out), reference(3, clip=1.0, parts=4), lr=LR, steps=3) < 1e-5
    assert sorted(os.listdir(nvme / "offloadpp")) == ["rank0", "rank1"]
    rows = (tmp_path / "csv" / "job" / "Train_Samples_train_loss.csv").read_text().split()
    info = ranks(out)
    assert info[0]["losses"] != info[1]["losses"]  # (so the mean is the mean, not one rank's)
    assert rows[0] == "step,train_loss" and len(rows) == 4
    for i, row in enumerate(rows[1:]):
        samples, value = row.split(",")
        assert int(samples) == GLOBAL_BATCH * (i + 1)
        assert float(value) == pytest.approx((info[0]["losses"][i] + info[1]["losses"][i]) / 2, abs=1e-6)


def test_a_process_group_the_script_made_is_used(tmp_path):
    """A script that calls torch.distributed.init_process_group("gloo") itself under torchrun:
    offloadpp.initialize trains over that group's two ranks (was refused: "the config's
    data-parallel world size is 1 but the launcher started 2 ranks")."""
    nvme, out = tmp_path / "nvme", tmp_path / "out"
    nvme.mkdir()
    torchrun(
        [str(out), "--nvme", str(nvme), "--api", "deepspeed", "--own-group", "--steps", "2", "--clip", "1.0"]
    )
    assert compare_weights(weights(out), reference(2, clip=1.0, parts=2), lr=LR, steps=2) < 1e-5
    assert all(d["world"] == 2 for d in ranks(out))


def test_two_rank_save_checkpoint_commits_after_every_rank_read_it(tmp_path):
    """engine.save_checkpoint over two ranks whose manifest reads are slow: rank 0 renames
    `.t.partial` to `t` only once every rank has read and verified it, so the save succeeds
    on both (it failed with "manifest.json is missing" on rank 1), and the folder resumes."""
    nvme, ck = tmp_path / "nvme", tmp_path / "ck"
    nvme.mkdir()
    args = ["--api", "deepspeed", "--steps", "2", "--clip", "1.0", "--slow-readers"]
    torchrun([str(tmp_path / "a"), "--nvme", str(nvme), "--save", str(ck), *args])
    assert sorted(os.listdir(ck)) == ["latest", "t"]
    assert sorted(os.listdir(ck / "t")) == [
        "client_state.pt",
        "config.json",
        "engine.pt",
        "manifest.json",
        "rank00000",
        "rank00001",
    ]
    (tmp_path / "nv_b").mkdir()
    torchrun([str(tmp_path / "b"), "--nvme", str(tmp_path / "nv_b"), "--api", "deepspeed", "--steps", "2",
              "--from-step", "2", "--clip", "1.0", "--load", str(ck), "--slow-readers"])  # fmt: skip
    assert compare_weights(weights(tmp_path / "b"), reference(4, clip=1.0, parts=2), lr=LR, steps=4) < 1e-5


def test_ckpt_launches_script_saves_and_resumes_exactly(tmp_path):
    """scripts/ckpt_launches.py (the 30-launch bar of issue 25; docs/distributed.md) with one
    launch under each launcher: save_checkpoint, train on, load, train again, bit for bit."""
    script = os.path.join(REPO, "scripts", "ckpt_launches.py")
    r = subprocess.run([sys.executable, script, "--launches", "1", "--work", str(tmp_path / "w")], env=_env(),
                       cwd=REPO, capture_output=True, text=True, timeout=1200)  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "torchrun 1/1 deepspeed 1/1 launches saved and resumed exactly" in r.stdout


def _single_engine(nvme, accum: int = 2):
    from dp_common import tiny_gpt2

    from offloadpp.assemble import assemble_engine
    from offloadpp.optim import AdamHyper
    from offloadpp.planner import Settings
    from offloadpp.runtime import RuntimeConfig

    settings = Settings(gradient_clipping=1.0, gradient_accumulation_steps=accum)
    cfg = RuntimeConfig(nvme_paths=[str(nvme)], settings=settings, device="cpu", ssd_read_gbps=2.0,
                        ssd_write_gbps=2.0, log_every=0)  # fmt: skip
    return assemble_engine(tiny_gpt2(), cfg, hyper=AdamHyper(lr=LR, weight_decay=WD))


def _train_single(eng, start: int, steps: int, parts: int = 2) -> None:
    """One process on the global batches start..start+steps, each as the ranks' two halves
    accumulated (parts=1: as one micro-batch)."""
    from dp_common import global_batches

    for x in global_batches(start + steps)[start:]:
        for part in x.chunk(parts):
            eng.backward(eng(input_ids=part, labels=part).loss)
            eng.step()


def test_checkpoint_resumes_at_the_same_and_at_other_world_sizes(tmp_path):
    """2 ranks save after 2 steps; 2 ranks, and 1 process (resharded), resume and end where 4
    uninterrupted steps end; a one-process checkpoint resumes on 2 ranks too."""
    want = reference(4, clip=1.0, parts=2)
    ck2 = tmp_path / "ck2"
    torchrun([str(tmp_path / "a"), "--nvme", str(tmp_path / "nv_a"), "--steps", "2", "--save", str(ck2)])
    man = json.load(open(ck2 / "manifest.json"))
    assert man["world_size"] == 2 and sorted(os.listdir(ck2)) == ["manifest.json", "rank00000", "rank00001"]
    # same world size
    torchrun(
        [
            str(tmp_path / "b"),
            "--nvme",
            str(tmp_path / "nv_b"),
            "--steps",
            "2",
            "--from-step",
            "2",
            "--load",
            str(ck2),
        ]
    )
    assert compare_weights(weights(tmp_path / "b"), want, lr=LR, steps=4) < 1e-5
    assert all(d["global_step"] == 4 for d in ranks(tmp_path / "b"))
    # one process, resharded from two
    (tmp_path / "nv_c").mkdir()
    eng = _single_engine(tmp_path / "nv_c")
    try:
        eng.load_state(str(ck2))
        assert eng.global_step == 2
        _train_single(eng, 2, 2)
        assert compare_weights(eng.module.state_dict(), want, lr=LR, steps=4) < 1e-5
        # and a one-process checkpoint of 2 steps, resumed by two ranks
        (tmp_path / "nv_d").mkdir()
        eng.close()
        eng = _single_engine(tmp_path / "nv_d")
        _train_single(eng, 0, 2)
        ck1 = tmp_path / "ck1"
        ck1.mkdir()
        eng.save_state(str(ck1))
    finally:
        eng.close()
    torchrun(
        [
            str(tmp_path / "e"),
            "--nvme",
            str(tmp_path / "nv_e"),
            "--steps",
            "2",
            "--from-step",
            "2",
            "--load",
            str(ck1),
        ]
    )
    assert compare_weights(weights(tmp_path / "e"), want, lr=LR, steps=4) < 1e-5


def test_what_cannot_run_together_is_refused(tmp_path):
    """Ranks whose plans differ (another config on one rank) and nodes that run different
    numbers of ranks are refused at the start with the reason, on every rank; model or
    sequence parallelism (mpu=, mesh_param=) is refused by initialize."""
    script = os.path.join(HERE, "dp_refusals.py")
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    cmd = [os.path.join(BIN, "torchrun"), "--nproc_per_node", "2", "--master_port", str(_port()), script, "plans",
           str(nvme)]  # fmt: skip
    r = subprocess.run(cmd, env=_env(), cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    assert r.stdout.count("REFUSED: the ranks disagree on the plan") == 2, r.stdout
    port = str(_port())
    procs = []
    for rank, local in ((0, 1), (1, 2)):  # rank 0 says its node runs 1 rank, rank 1 says 2
        env = dict(_env(), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE=str(local),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port)  # fmt: skip
        procs.append(subprocess.Popen([sys.executable, script, "nodes"], env=env, cwd=REPO, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))  # fmt: skip
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0 and "different numbers of ranks" in out, (out, err[-3000:])

    import offloadpp
    from offloadpp.integrations.deepspeed import OffloadppConfigError

    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "offloadpp": {"enabled": True, "nvme_paths": [str(nvme)]}}  # fmt: skip
    for kw in ({"mpu": object()}, {"mesh_param": (1, 2)}):
        with pytest.raises(OffloadppConfigError, match="data-parallel ranks only"):
            offloadpp.initialize(model=torch.nn.Linear(2, 2), config=cfg, **kw)


def test_16bit_compute_over_two_ranks(tmp_path, on_device):
    """bf16 compute (a compute copy per shard beside the fp32 master, gathered in 16 bits), with
    budgets that keep every unit's weights resident on the device (gathered again by the worker
    after each update): two ranks agree with one process taking the same global batch as two
    micro-batches: the same global norms, and weights as close as bf16's rounding of the
    gradients lets them be."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    out = tmp_path / "out"
    torchrun([str(out), "--nvme", str(nvme), "--steps", "3", "--clip", "1.0", "--dtype", "bf16", "--budgets",
              f"{64 << 20},{64 << 20}"])  # fmt: skip
    assert all(t == "device" for t in ranks(out)[0]["resident"])
    from dp_common import global_batches, tiny_gpt2

    from offloadpp.assemble import assemble_engine
    from offloadpp.optim import AdamHyper
    from offloadpp.planner import Settings
    from offloadpp.runtime import RuntimeConfig

    (tmp_path / "one").mkdir()
    settings = Settings(gradient_clipping=1.0, gradient_accumulation_steps=2, compute_dtype="bf16")
    cfg = RuntimeConfig(nvme_paths=[str(tmp_path / "one")], settings=settings, device="cpu", ssd_read_gbps=2.0,
                        ssd_write_gbps=2.0, log_every=0)  # fmt: skip
    eng = assemble_engine(tiny_gpt2(), cfg, hyper=AdamHyper(lr=LR, weight_decay=WD))
    norms = []
    try:
        for x in global_batches(3):
            for part in x.chunk(2):
                eng.backward(eng(input_ids=part, labels=part).loss)
                r = eng.step()
            norms.append(r.grad_norm)
        want = eng.module.state_dict()
    finally:
        eng.close()
    for d in ranks(out):
        assert [x["grad_norm"] for x in d["reports"]] == pytest.approx(norms, rel=1e-3)
    assert compare_weights(weights(out), want, lr=LR, steps=3) < 0.1


def test_on_the_standin_a_checkpoint_loads_into_weights_resident_on_the_device_over_two_ranks(
    tmp_path, monkeypatch
):
    """Two ranks whose units' weights stay on the device save a checkpoint and load it in a new
    run, which gathers each unit's loaded shards into its resident weights (sharded_checkpoint.py,
    _regather_resident): the resumed run trains like two steps of one process. On the stand-in
    (the copy path: the gather's event orders the next bind; the host waited on it once through a
    method events do not have, and the load failed on every device with copies)."""
    from conftest import set_device

    set_device(monkeypatch, "standin")
    budgets = ["--budgets", f"{64 << 20},{64 << 20}"]
    (tmp_path / "nv_a").mkdir()
    torchrun([str(tmp_path / "a"), "--nvme", str(tmp_path / "nv_a"), "--steps", "1", "--clip", "1.0",
              "--save", str(tmp_path / "ck"), *budgets])  # fmt: skip
    assert all(t == "device" for t in ranks(tmp_path / "a")[0]["resident"])
    (tmp_path / "nv_b").mkdir()
    torchrun([str(tmp_path / "b"), "--nvme", str(tmp_path / "nv_b"), "--steps", "1", "--from-step", "1",
              "--clip", "1.0", "--load", str(tmp_path / "ck"), *budgets])  # fmt: skip
    assert compare_weights(weights(tmp_path / "b"), reference(2, clip=1.0, parts=2), lr=LR, steps=2) < 1e-5


def test_a_group_restarted_by_torchrun_starts_again(tmp_path):
    """Under `torchrun --max-restarts 1` (c10d rendezvous) a rank killed with SIGKILL brings the
    group down and back: the new group starts although one of its ranks comes seconds after the
    other (each attempt's process group on keys of its own in the agent's store), and every rank
    all-reduces in both attempts."""
    cmd = [os.path.join(BIN, "torchrun"), "--nproc_per_node", "2", "--max-restarts", "1", "--rdzv_backend", "c10d",
           "--rdzv_endpoint", f"127.0.0.1:{_port()}", os.path.join(HERE, "elastic_restart_worker.py")]  # fmt: skip
    r = subprocess.run(cmd, env=_env(), cwd=REPO, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-6000:])
    for attempt in (0, 1):
        for rank in (0, 1):
            assert f"attempt {attempt} rank {rank} sum 2" in r.stdout, r.stdout


def test_survivors_of_a_dead_rank_fail_within_seconds_without_an_agent(tmp_path):
    """Two ranks started by hand (no torchrun agent or launcher to stop the others); rank 1 is
    killed with SIGKILL in the second step, between forward and backward. Rank 0 must fail on
    its own, in its next collective, within seconds: not after the process group's timeout
    (DeepSpeed's 30 minutes), and not hang in its exit."""
    port, out = _port(), tmp_path / "out"
    (tmp_path / "nvme").mkdir()
    procs = []
    for r in range(2):
        env = dict(_env(), RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
        cmd = [sys.executable, WORKER, str(out), "--nvme", str(tmp_path / "nvme"), "--api", "deepspeed",
               "--steps", "3", "--die-at", "2"]  # fmt: skip
        procs.append(subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))  # fmt: skip
    try:
        assert procs[1].wait(300) == -signal.SIGKILL, procs[1].stdout.read()[-3000:]
        rc = procs[0].wait(120)
        took = time.time() - float((out / "died").read_text())
    finally:
        for p in procs:
            p.kill() if p.poll() is None else None
    log = procs[0].stdout.read()
    print(f"rank 0 failed {took:.2f} s after rank 1 died")
    assert rc != 0, log[-3000:]
    assert took < 30, (took, log[-3000:])


@pytest.mark.parametrize("api", ["runtime", "deepspeed"])
def test_two_ranks_vertical_windows_train_like_one_process(tmp_path, api):
    """Windows of two micro-batches per rank driven whole (train_window; DeepSpeed's
    train_batch), vertically after the first: the weights of one process of torch AdamW over the
    global batch accumulated in four parts, one global norm on every rank, and each window's
    reduction the same bytes as a step without accumulation (one reduce-scatter per unit per
    window)."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    out = tmp_path / "out"
    torchrun([str(out), "--nvme", str(nvme), "--api", api, "--steps", "3", "--accum", "2", "--clip", "1.0",
              "--window"])  # fmt: skip
    assert compare_weights(weights(out), reference(3, clip=1.0, parts=4), lr=LR, steps=3) < 1e-5
    info = ranks(out)
    for d in info:
        assert d["vertical"] == [False, True, True]
    for i in range(3):
        norms = {d["reports"][i]["grad_norm"] for d in info}
        assert len(norms) == 1
    one, nvme1 = tmp_path / "one", tmp_path / "nvme1"
    nvme1.mkdir()
    torchrun([str(one), "--nvme", str(nvme1), "--api", api, "--steps", "1", "--accum", "1", "--clip", "1.0"])
    step_comm = ranks(one)[0]["reports"][0]["comm_bytes"]
    assert info[0]["reports"][2]["comm_bytes"] == step_comm > 0


def test_two_ranks_bf16_vertical_windows_equal_the_horizontal_loop(tmp_path):
    """bf16 compute over two ranks, windows of two micro-batches per rank, clipping 1.0: the
    vertical windows (train_window, after the first) end with the weights and global norms of a
    per-micro-batch loop (horizontal) over the same micro-batches: each unit's window gradient
    summed in fp32 before its one reduce-scatter (runtime/window_grads.py), as the loop
    accumulates it."""
    got = {}
    for name, extra in (("loop", []), ("window", ["--window"])):
        nvme = tmp_path / f"nvme-{name}"
        nvme.mkdir()
        torchrun([str(tmp_path / name), "--nvme", str(nvme), "--steps", "3", "--accum", "2", "--clip", "1.0",
                  "--dtype", "bf16", *extra])  # fmt: skip
        got[name] = (ranks(tmp_path / name), weights(tmp_path / name))
    (loop, want), (window, have) = got["loop"], got["window"]
    assert all(d["vertical"] == [False, True, True] for d in window)
    for a, b in zip(window, loop):
        assert [x["grad_norm"] for x in a["reports"]] == pytest.approx(
            [x["grad_norm"] for x in b["reports"]], rel=1e-6
        )
    assert compare_weights(have, want, lr=LR, steps=3) < 1e-5
