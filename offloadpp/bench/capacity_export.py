"""`offloadpp bench capacity --export`: the two ways users export a model, on the trained engine.

After the steps: the engine's logits on one batch (the reference), then `engine.save_16bit_model
(dir)` with DeepSpeed's default name (pytorch_model.bin, streamed and sharded: the user adds
config.json, as with DeepSpeed), then a Hugging Face Trainer's `save_model(dir)` on the same
engine (a Trainer around the model with the engine as its wrapped model, as Trainer.train
leaves it; offloadpp.patch_deepspeed() in place, as `python -m offloadpp run` or the script
puts it), and, for the side-by-side, save_16bit_model's export written through the page cache
instead of O_DIRECT (as before io/direct_writer.py; removed once timed). Each is timed against the disk floor (the fp32 masters read once, the files written
once, at the rates the engine measured) and has its own peak RSS. Afterwards a separate process
(`--child verify`: a plain transformers process, nothing of offloadpp) loads each folder with
`from_pretrained` and compares its logits on the batch with the engine's.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from typing import Optional

EXPORTS = ("save_16bit_model", "trainer_save_model")
CKPT_DIR = "checkpoint"  # save_checkpoint's save_dir (--export-checkpoint)
CLI_EXPORT = "offloadpp_export"  # `offloadpp export`'s folder


def _folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


def reference(engine, work: str, batch) -> None:
    """The engine's logits on `batch`, saved for verify_child."""
    import torch

    engine.eval()
    with torch.no_grad():
        logits = engine(input_ids=batch).logits
    engine.train()
    torch.save({"input_ids": batch, "logits": logits}, os.path.join(work, "reference.pt"))


def export_phase(engine, args, work: str, batch, phase_peak) -> dict:
    """Runs the two exports on `engine` (between steps; reference() ran); returns their numbers.
    phase_peak(): the process's peak RSS since the last call (capacity.phase_peak)."""
    from transformers import Trainer, TrainingArguments

    from offloadpp.integrations.deepspeed import patch_deepspeed

    rt = engine.runtime
    rd, wr = rt.ssd_read_gbps * 1e9, rt.ssd_write_gbps * 1e9
    master_bytes = 4 * sum(u.padded_numel for u in rt.units)
    out: dict = {"peaks": {}}

    d = os.path.join(work, "save_16bit_model")
    t = time.perf_counter()
    engine.save_16bit_model(d)  # DeepSpeed's default name, pytorch_model.bin
    out["save_16bit_model"] = {"s": time.perf_counter() - t}
    # (as a DeepSpeed user adds it: save_16bit_model writes the weights only)
    engine.module.config.save_pretrained(d)
    out["peaks"]["save_16bit_model"] = phase_peak()

    if shutil.disk_usage(work).free > 2.2 * _folder_bytes(d):  # (room for it and the Trainer's export after)
        out["page_cache"] = _page_cache_export(rt, os.path.join(work, "page_cache"), master_bytes / rd, wr)
        out["peaks"]["save_16bit_model, page cache"] = phase_peak()
    else:
        print(
            "offloadpp bench: too little free disk for the page-cache side-by-side: skipped", file=sys.stderr
        )

    patch_deepspeed()
    d = os.path.join(work, "trainer_save_model")
    targs = TrainingArguments(output_dir=d, report_to=[], use_cpu=True, disable_tqdm=True)
    trainer = Trainer(model=engine.module, args=targs)
    trainer.model_wrapped = trainer.deepspeed = engine  # what Trainer.train leaves after deepspeed.initialize
    t = time.perf_counter()
    trainer.save_model(d)
    out["trainer_save_model"] = {"s": time.perf_counter() - t}
    out["peaks"]["trainer save_model"] = phase_peak()
    del trainer
    for name in EXPORTS:
        e = out[name]
        d = os.path.join(work, name)
        e["files"] = sorted(os.listdir(d))
        e["bytes"] = _folder_bytes(d)
        e["floor_s"] = master_bytes / rd + e["bytes"] / wr
        e["vs_floor"] = e["s"] / e["floor_s"]
    out["master_bytes"] = master_bytes
    return out


def _page_cache_export(rt, d: str, read_floor_s: float, wr: float) -> dict:
    """save_16bit_model's export as it was written before io/direct_writer.py (through the page
    cache), timed and removed."""
    from offloadpp.runtime import export as rt_export
    from offloadpp.runtime.unit import TORCH_DTYPES

    t = time.perf_counter()
    fmt = rt_export.ExportFormat(TORCH_DTYPES[rt.settings.compute_dtype], "pytorch_model.bin", direct=False)
    rt_export.export_weights(rt.units, rt.module, d, fmt, before=rt._quiesce)
    pc = {"s": time.perf_counter() - t, "bytes": _folder_bytes(d)}
    pc["floor_s"] = read_floor_s + pc["bytes"] / wr
    pc["vs_floor"] = pc["s"] / pc["floor_s"]
    shutil.rmtree(d)
    return pc


def checkpoint_phase(engine, work: str, phase_peak) -> dict:
    """save_checkpoint into work/CKPT_DIR, timed against the disk floor (master and moments read
    and written once); `offloadpp export` runs on it after this process ends (cli_export)."""
    rt = engine.runtime
    state_bytes = 12 * sum(u.padded_numel for u in rt.units)
    free = shutil.disk_usage(work).free
    if free < 1.05 * state_bytes + 4 * sum(
        u.padded_numel for u in rt.units
    ):  # (the checkpoint, then the export)
        raise SystemExit(
            f"offloadpp bench: --export-checkpoint needs {state_bytes / 1e9:.1f} GB for the checkpoint and a third of "
            f"that for the export, {free / 1e9:.1f} GB are free in {work!r} (with --export, run it on its own)"
        )
    t = time.perf_counter()
    engine.save_checkpoint(os.path.join(work, CKPT_DIR))
    s = time.perf_counter() - t
    out = {"save_s": s, "state_bytes": state_bytes, "master_bytes": state_bytes // 3,
           "save_floor_s": state_bytes / (rt.ssd_read_gbps * 1e9) + state_bytes / (rt.ssd_write_gbps * 1e9),
           "ssd_read_gbps": rt.ssd_read_gbps, "ssd_write_gbps": rt.ssd_write_gbps}  # fmt: skip
    phase_peak()
    return out


def cli_export(work: str, saved: dict) -> dict:
    """`offloadpp export CKPT OUT` as a user runs it after the job: a process of its own (the
    training process has ended), its peak RSS from the kernel (wait4's ru_maxrss), timed against
    the disk floor (the fp32 masters read once, the folder written once); the checkpoint is then
    removed (disk for the check)."""
    out_dir = os.path.join(work, CLI_EXPORT)
    argv = [sys.executable, "-m", "offloadpp", "export", os.path.join(work, CKPT_DIR), out_dir]
    t = time.perf_counter()
    proc = subprocess.Popen(argv)
    _, status, usage = os.wait4(proc.pid, 0)
    s = time.perf_counter() - t
    res = {"exit_status": os.waitstatus_to_exitcode(status), "s": s, "peak_rss_bytes": usage.ru_maxrss * 1024,
           "argv": " ".join(["offloadpp", "export", "CKPT", "OUT"])}  # fmt: skip
    if os.path.isdir(out_dir):
        res["files"] = sorted(os.listdir(out_dir))
        res["bytes"] = _folder_bytes(out_dir)
        res["floor_s"] = saved["master_bytes"] / (saved["ssd_read_gbps"] * 1e9) + res["bytes"] / (
            saved["ssd_write_gbps"] * 1e9
        )
        res["vs_floor"] = s / res["floor_s"]
    shutil.rmtree(os.path.join(work, CKPT_DIR), ignore_errors=True)
    return res


def verify_child(work: str) -> dict:
    """Loads each export with from_pretrained (fp32, plain transformers) and compares its logits
    on the reference batch with the engine's; one model in memory at a time."""
    import gc

    import torch
    from transformers import AutoModelForCausalLM

    ref = torch.load(os.path.join(work, "reference.pt"))
    res = {}
    for name in [n for n in (*EXPORTS, CLI_EXPORT) if os.path.isdir(os.path.join(work, n))]:
        t = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(os.path.join(work, name), dtype=torch.float32).eval()
        load_s = time.perf_counter() - t
        with torch.no_grad():
            got = model(input_ids=ref["input_ids"]).logits
        diff = (got - ref["logits"]).abs().max().item()
        res[name] = {
            "load_s": load_s,
            "max_abs_diff": diff,
            "equal": bool(torch.equal(got, ref["logits"])),
            "close": bool(torch.allclose(got, ref["logits"], rtol=1e-5, atol=1e-4)),
        }
        print(f"verify {name}: from_pretrained {load_s:.1f}s, logits max |diff| {diff:.3g}", file=sys.stderr)
        del model, got
        gc.collect()
    return res


def _match(v: dict) -> str:
    return (
        "not verified" if not v else ("identical" if v["equal"] else f"max abs diff {v['max_abs_diff']:.3g}")
    )


def _row(name: str, x: dict, peak: int, v: dict) -> str:
    weights = [f for f in x["files"] if f.endswith((".bin", ".safetensors")) and f != "training_args.bin"]
    index = " + index" if any(f.endswith(".index.json") for f in x["files"]) else ""
    return (f"| {name} | {len(weights)} weight files{index} | {x['bytes'] / 1e9:.1f} GB | {x['s']:.1f} | "
            f"{x['floor_s']:.1f} | {x['vs_floor']:.2f} | {peak / (1 << 30):.2f} GiB | {_match(v)} |")  # fmt: skip


def table(
    o: dict, verify: dict, rss_verify: int, cli: Optional[dict] = None, max_rss_gib: float = 8.0
) -> list[str]:
    """Markdown lines for capacity's report: the exports of --export (in the training process)
    and `offloadpp export` of --export-checkpoint (a process of its own, after the job)."""
    gib = 1 << 30
    lines = ["", "| export | files | size | time s | disk floor s | x floor | peak RSS | from_pretrained logits |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    ph = o["phase_peak_rss"]
    names = []
    if "export" in o:
        e = o["export"]
        peaks = {"save_16bit_model": ph["save_16bit_model"], "trainer_save_model": ph["trainer save_model"]}
        names += list(EXPORTS)
        lines += [_row(name, e[name], peaks[name], verify.get(name, {})) for name in EXPORTS]
        if "page_cache" in e:
            pc = e["page_cache"]
            lines.append(
                f"| save_16bit_model through the page cache (as before O_DIRECT) | | {pc['bytes'] / 1e9:.1f} GB | {pc['s']:.1f} | "
                f"{pc['floor_s']:.1f} | {pc['vs_floor']:.2f} | {ph['save_16bit_model, page cache'] / gib:.2f} GiB | |"
            )
    if cli is not None:
        names.append(CLI_EXPORT)
        if "files" in cli:
            lines.append(_row("`offloadpp export` of the checkpoint (own process)", cli, cli["peak_rss_bytes"],
                              verify.get(CLI_EXPORT, {})))  # fmt: skip
        else:
            lines.append(f"| `offloadpp export` | failed (exit {cli['exit_status']}) | | | | | | |")
        c = o["checkpoint_export"]
        lines.append(
            f"(save_checkpoint before it: {c['state_bytes'] / 1e9:.1f} GB of state in {c['save_s']:.1f} s, disk floor "
            f"{c['save_floor_s']:.1f} s)"
        )
    if verify:
        lines.append(
            f"(the from_pretrained check ran in a process of its own: peak RSS {rss_verify / gib:.2f} GiB)"
        )
    ok = all(verify.get(name, {}).get("close", False) for name in names)
    lines.append(
        f"bar: the exports load with from_pretrained and give the engine's logits: {'PASS' if ok else 'FAIL'}"
    )
    if cli is not None:
        lines.append(
            f"bar: `offloadpp export` peak RSS {cli['peak_rss_bytes'] / gib:.2f} GiB <= {max_rss_gib:.0f} GiB: "
            f"{'PASS' if cli_ok(cli, max_rss_gib) else 'FAIL'}"
        )
    return lines


def cli_ok(cli: dict, max_rss_gib: float) -> bool:
    return cli.get("exit_status") == 0 and cli["peak_rss_bytes"] <= max_rss_gib * (1 << 30)
