"""DeepSpeed's monitors on offloadpp's engine (integrations/deepspeed/monitor.py): the events
DeepSpeed's own engine writes, by name, x and value, through DeepSpeed's own writers; the train
loss and the step report's figures beside them; a missing package named at initialize.

The comparison runs the same tiny GPT-2, initial weights, batches and JSON (csv_monitor and
tensorboard both on, wall_clock_breakdown, gradient accumulation 2; ZeRO-Infinity: parameters and
optimizer on NVMe, the aio block, the config's Adam) under DeepSpeed's engine and offloadpp's, each
in its own process (tests/ds_monitor_run.py) with a swap folder of its own. DeepSpeed's side needs
its async_io, pin_memory and cpu_adam ops (scripts/bootstrap.sh builds them).
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from ds_import_worker import AIO, ZERO_INFINITY, on_nvme
from test_deepspeed_integration import batches, ds_config, tiny_gpt2, train

import offloadpp
from offloadpp.integrations.deepspeed import OffloadppConfigError
from offloadpp.integrations.deepspeed.monitor import PREFIX

pytest.importorskip("deepspeed")
HERE = Path(__file__).resolve().parent
GAS, STEPS, MICRO = 2, 4, 2
OURS = {  # the series offloadpp writes that DeepSpeedEngine does not (one rank, fp32, no clipping)
    "Train/Samples/train_loss",
    *(PREFIX + n for n in ("step_s", "forward_s", "backward_s", "optimizer_wait_s", "fetch_wait_s", "compute_s",
                           "adam_s", "recompute_s", "ssd_s", "floor_s", "ssd_read_bytes", "ssd_write_bytes",
                           "host_to_device_bytes", "device_to_host_bytes", "fetch_misses", "peak_device_bytes",
                           "peak_host_bytes", "peak_activations_bytes", "peak_activation_staging_bytes")),
}  # fmt: skip


def monitored(tmp: Path, side: str, **over) -> dict:
    """ZeRO-Infinity's JSON (ds_import_worker.ZERO_INFINITY, AIO) with both monitors on."""
    cfg = on_nvme(dict(ds_config(tmp / f"{side}_nvme", gradient_accumulation_steps=GAS, wall_clock_breakdown=True,
                                 aio=AIO, **over), zero_optimization=ZERO_INFINITY), str(tmp / f"{side}_nvme"))  # fmt: skip
    cfg["csv_monitor"] = {"enabled": True, "output_path": str(tmp / f"{side}_csv"), "job_name": "job"}
    cfg["tensorboard"] = {"enabled": True, "output_path": str(tmp / f"{side}_tb"), "job_name": "job"}
    return cfg


def run_side(tmp: Path, side: str, cfg: dict) -> dict:
    spec, out = tmp / f"{side}.json", tmp / f"{side}.out"
    spec.write_text(json.dumps({"side": side, "config": cfg, "steps": STEPS}))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent), str(HERE)]))
    p = subprocess.run([sys.executable, str(HERE / "ds_monitor_run.py"), str(spec), str(out)], capture_output=True,
                       text=True, env=env, timeout=900)  # fmt: skip
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("runs")
    got = {}
    for side in ("deepspeed", "offloadpp"):
        got[side] = run_side(tmp, side, monitored(tmp, side))
        got[side]["dir"] = tmp
    assert got["deepspeed"]["engine"] == "DeepSpeedEngine" and got["offloadpp"]["engine"] == "OffloadppEngine"
    return got


def read_csv(folder: Path) -> dict:
    """Each CSV file DeepSpeed's csv_monitor wrote: file name -> (header, [(step, value)])."""
    out = {}
    for f in sorted(folder.glob("*.csv")):
        rows = list(csv.reader(f.open()))
        out[f.name] = (rows[0], [(int(s), float(v)) for s, v in rows[1:]])
    return out


def read_tb(folder: Path) -> dict:
    """Each scalar tag in the TensorBoard event files: tag -> [(step, value)] (float32, as stored)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def step_losses(losses: list) -> list:
    """Each step's loss: the mean of its window's micro-batch losses."""
    return [sum(losses[i : i + GAS]) / GAS for i in range(0, len(losses), GAS)]


def check_series(theirs: dict, ours: dict, key, runs) -> None:
    """Ours has every series DeepSpeed's engine wrote, at the same x (the samples after each
    step), the lr with DeepSpeed's values, the timings as positive ms (backward_allreduce: 0, no such
    phase here); plus exactly OURS, the train loss equal to each step's loss."""
    samples = [MICRO * GAS * (i + 1) for i in range(STEPS)]
    assert set(theirs) == {key(n) for n in ("Train/Samples/lr",) + tuple(
        "Train/Samples/elapsed_time_ms_" + p for p in ("forward", "backward", "backward_inner", "backward_allreduce",
                                                       "step"))}  # fmt: skip
    assert set(ours) == set(theirs) | {key(n) for n in OURS}
    for name, series in theirs.items():
        assert [s for s, _ in ours[name]] == [s for s, _ in series] == samples, name
    assert ours[key("Train/Samples/lr")] == theirs[key("Train/Samples/lr")]
    for phase in ("forward", "backward", "backward_inner", "step"):
        assert all(v > 0 for _, v in ours[key("Train/Samples/elapsed_time_ms_" + phase)]), phase
    assert all(v == 0 for _, v in ours[key("Train/Samples/elapsed_time_ms_backward_allreduce")])
    loss = ours[key("Train/Samples/train_loss")]
    assert [s for s, _ in loss] == samples
    assert [v for _, v in loss] == pytest.approx(step_losses(runs["offloadpp"]["losses"]), abs=1e-6, rel=0)
    # and DeepSpeed's run computed the same losses (it writes none to compare: monitor.py, Note)
    assert [v for _, v in loss] == pytest.approx(step_losses(runs["deepspeed"]["losses"]), rel=1e-5)


def test_csv_monitor_writes_deepspeeds_files(runs):
    theirs = read_csv(runs["deepspeed"]["dir"] / "deepspeed_csv" / "job")
    ours = read_csv(runs["offloadpp"]["dir"] / "offloadpp_csv" / "job")
    for name, (
        header,
        _,
    ) in ours.items():  # DeepSpeed's writer: one file per event, its last name part heading it
        assert header == ["step", name[: -len(".csv")].split("_Samples_")[-1].split("offloadpp_")[-1]], name
    check_series({k: v for k, (_, v) in theirs.items()}, {k: v for k, (_, v) in ours.items()},
                 lambda n: n.replace("/", "_") + ".csv", runs)  # fmt: skip


def test_tensorboard_writes_deepspeeds_scalars(runs):
    theirs = read_tb(runs["deepspeed"]["dir"] / "deepspeed_tb" / "job")
    ours = read_tb(runs["offloadpp"]["dir"] / "offloadpp_tb" / "job")
    check_series(theirs, ours, lambda n: n, runs)


def _engine(tmp_path, **over):
    cfg = ds_config(tmp_path / "nvme", **over)
    model = tiny_gpt2()
    return offloadpp.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]


def _train(engine, n: int) -> list:
    return train(engine, batches(n))


def test_fp16_skipped_steps_write_what_deepspeed_writes(tmp_path):
    """Under fp16 each step writes the loss scale its update left, as DeepSpeed's engine reads it
    from its optimizer: DeepSpeed's own DynamicLossScaler, fed each step's overflow, gives the
    series (the first steps overflow at 2**20 and halve it, hysteresis 2 delaying the first). A
    step skipped on overflow writes its events too, as DeepSpeedEngine.step does (it counts the
    step's samples and writes after any step): the lr its scheduler was left at (DeepSpeed's
    WarmupLR, stepped on the steps that were not skipped only), and the window's own train_loss,
    none of it carried into the next step. (DeepSpeed's fp16 cannot run on this CPU: mkldnn has
    no fp16 here, so its engine's side is its own scaler and scheduler.)"""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
    from deepspeed.runtime.lr_schedules import WarmupLR

    fp16 = {"enabled": True, "loss_scale": 0, "initial_scale_power": 20, "loss_scale_window": 2, "hysteresis": 2,
            "min_loss_scale": 1}  # fmt: skip
    csv_dir = tmp_path / "csv"
    engine = _engine(tmp_path, fp16=fp16, gradient_accumulation_steps=GAS,
                     csv_monitor={"enabled": True, "output_path": str(csv_dir)})  # fmt: skip
    losses = _train(engine, 6 * GAS)
    skipped = [r.skipped for r in engine.reports]
    sched_params = engine.config["scheduler"]["params"]
    engine.close()
    scaler = DynamicLossScaler(init_scale=2.0**20, scale_window=2, min_scale=1, delayed_shift=2,
                               consecutive_hysteresis=False)  # fmt: skip
    sched = WarmupLR(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0), **sched_params)
    scales, lrs = [], []
    for s in skipped:
        scaler.update_scale(s)
        scales.append(scaler.cur_scale)
        if not s:
            sched.step()
        lrs.append(sched.get_lr()[0])
    got = read_csv(csv_dir / "DeepSpeedJobName")
    assert any(skipped) and not all(skipped)  # some steps overflowed, some updated
    x = [MICRO * GAS * (i + 1) for i in range(len(skipped))]  # a skipped step's samples count too
    assert got["Train_Samples_loss_scale.csv"][1] == list(zip(x, scales))
    assert [s for s, _ in got["Train_Samples_lr.csv"][1]] == x
    assert [v for _, v in got["Train_Samples_lr.csv"][1]] == pytest.approx(lrs, rel=1e-12)
    train_loss = got["Train_Samples_train_loss.csv"][1]
    assert [s for s, _ in train_loss] == x
    assert [v for _, v in train_loss] == pytest.approx(step_losses(losses), abs=1e-6, rel=0)


def test_a_rolled_back_window_writes_nothing_and_leaves_no_loss(tmp_path):
    """A window whose backward raised is rolled back (runtime/transaction.py): it writes no
    event, and the next window's train_loss is that window's own mean, over its own micro-batches
    (the micro-batch completed before the error belongs to the rolled-back window: it is neither
    counted in the next one's loss nor in its length)."""
    csv_dir = tmp_path / "csv"
    engine = _engine(tmp_path, gradient_accumulation_steps=GAS,
                     csv_monitor={"enabled": True, "output_path": str(csv_dir)})  # fmt: skip
    data = batches(4 * GAS)
    losses = train(engine, data[:GAS]) + train(engine, data[GAS : GAS + 1])

    class Boom(Exception):
        pass

    hook = engine.module.transformer.h[0].register_full_backward_hook(
        lambda *a: (_ for _ in ()).throw(Boom())
    )
    with pytest.raises(Boom):
        train(engine, data[GAS + 1 : GAS + 2])
    hook.remove()
    after = train(engine, data[2 * GAS :])
    assert engine.global_steps == 3
    engine.close()
    got = read_csv(csv_dir / "DeepSpeedJobName")["Train_Samples_train_loss.csv"][1]
    assert [s for s, _ in got] == [MICRO * GAS * (i + 1) for i in range(3)]
    assert [v for _, v in got] == pytest.approx(step_losses(losses[:GAS] + after), abs=1e-6, rel=0)


def _fake(name: str, **attrs) -> types.ModuleType:
    m = types.ModuleType(name)
    m.__dict__.update(attrs)
    return m


def test_wandb_and_comet_get_the_events_through_deepspeeds_writers(tmp_path, monkeypatch):
    """wandb and comet_ml stand-ins (neither is a dependency): DeepSpeed's writers start a run
    with the block's settings and log each event at its x; comet at most once per
    samples_log_interval samples, as DeepSpeed's writer decides."""
    wandb_calls, comet_calls = [], []

    class Experiment:
        def set_name(self, name):
            comet_calls.append(("name", name))

        def __internal_api__log_metric__(self, name, value, step):
            comet_calls.append((name, value, step))

    wandb = _fake("wandb", init=lambda **kw: wandb_calls.append(("init", kw)),
                  log=lambda data, step=None, commit=None: wandb_calls.append((data, step)))  # fmt: skip
    comet = _fake(
        "comet_ml", __version__="3.45.0", start=lambda **kw: comet_calls.append(("start", kw)) or Experiment()
    )
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    monkeypatch.setitem(sys.modules, "comet_ml", comet)
    engine = _engine(tmp_path, wandb={"enabled": True, "project": "p", "group": "g"},
                     comet={"enabled": True, "samples_log_interval": 4, "experiment_name": "e"})  # fmt: skip
    losses = _train(engine, 3)
    engine.close()
    assert wandb_calls[0] == ("init", {"project": "p", "group": "g", "entity": None})
    logged = [(list(d)[0], list(d.values())[0], s) for d, s in wandb_calls[1:]]
    assert [(n, s) for n, _, s in logged if n == "Train/Samples/train_loss"] == [(n, s) for n, s in (
        ("Train/Samples/train_loss", 2), ("Train/Samples/train_loss", 4), ("Train/Samples/train_loss", 6))]  # fmt: skip
    assert [v for n, v, _ in logged if n == "Train/Samples/train_loss"] == pytest.approx(losses, abs=1e-6)
    assert {n for n, _, _ in logged} >= {"Train/Samples/lr", PREFIX + "ssd_write_bytes"}
    assert comet_calls[1] == ("name", "e")
    assert [s for n, _, s in comet_calls[2:] if n == "Train/Samples/lr"] == [2, 6]  # 4 samples apart at least


@pytest.mark.parametrize(
    "block, package", [("wandb", "wandb"), ("comet", "comet_ml"), ("tensorboard", "tensorboard")]
)
def test_a_missing_package_is_named_at_initialize(tmp_path, monkeypatch, block, package):
    monkeypatch.setitem(sys.modules, package, None)  # `import package` raises ImportError
    with pytest.raises(OffloadppConfigError, match=rf"{block}\.enabled: DeepSpeed's {block} monitor needs the "
                       rf"'{package}' package.*pip install"):  # fmt: skip
        _engine(tmp_path, **{block: {"enabled": True, "output_path": str(tmp_path)} if block == "tensorboard"
                             else {"enabled": True}})  # fmt: skip


def test_without_a_monitor_nothing_is_written(tmp_path):
    engine = _engine(tmp_path, csv_monitor={"enabled": False, "output_path": str(tmp_path / "csv")})
    _train(engine, 2)
    assert engine.monitor is not None and not engine.monitor.enabled
    assert not (tmp_path / "csv").exists()
    engine.close()


def test_one_rank_writes_and_the_loss_is_the_mean_over_ranks():
    """StepEvents over two ranks, their sum a stand-in for the engine's collective: rank 0 writes
    the mean of the ranks' losses; rank 1 writes nothing but takes part in the sum."""
    from offloadpp.integrations.deepspeed.monitor import StepEvents

    class Master:
        enabled = True

        def __init__(self):
            self.events = []

        def write_events(self, events):
            self.events += events

    others = {0: 3.0, 1: 5.0}  # each rank's step loss
    masters = {r: Master() for r in others}
    for rank, own in others.items():
        ev = StepEvents(masters[rank], rank=rank, world=2, fp16=False, wall_clock=False,
                        sum_over_ranks=lambda x, r=rank: x + others[1 - r])  # fmt: skip
        ev.backward(torch.tensor(own * 2), 0.5)
        ev.write(samples=8, lr=0.1, loss_scale=None, report=None)
    assert masters[0].events == [("Train/Samples/lr", 0.1, 8), ("Train/Samples/train_loss", 4.0, 8)]
    assert masters[1].events == []


def test_train_batch_writes_the_windows_mean_loss(tmp_path):
    """A window driven whole (train_batch, runtime/accumulate.py) writes the same train_loss as the
    engine's own forward/backward/step: the mean of the window's micro-batch losses, one row a step."""
    csv_dir = tmp_path / "csv"
    engine = _engine(
        tmp_path, gradient_accumulation_steps=2, csv_monitor={"enabled": True, "output_path": str(csv_dir)}
    )
    data = batches(4)
    means = [float(engine.train_batch(iter([{"input_ids": x, "labels": x} for x in data[i : i + 2]])))
             for i in (0, 2)]  # fmt: skip
    engine.close()
    got = read_csv(csv_dir / "DeepSpeedJobName")["Train_Samples_train_loss.csv"][1]
    assert [x for x, _ in got] == [2 * MICRO, 4 * MICRO]
    assert [v for _, v in got] == pytest.approx(means, abs=1e-6, rel=0)
