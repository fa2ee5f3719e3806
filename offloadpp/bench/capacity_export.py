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
import sys
import time

EXPORTS = ("save_16bit_model", "trainer_save_model")


def _folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


def export_phase(engine, args, work: str, batch, phase_peak) -> dict:
    """Runs the two exports on `engine` (between steps); returns their numbers. phase_peak():
    the process's peak RSS since the last call (capacity._phase_peak)."""
    import torch
    from transformers import Trainer, TrainingArguments

    from offloadpp.integrations.deepspeed import patch_deepspeed

    rt = engine.runtime
    rd, wr = rt.ssd_read_gbps * 1e9, rt.ssd_write_gbps * 1e9
    master_bytes = 4 * sum(u.padded_numel for u in rt.units)
    engine.eval()
    with torch.no_grad():
        logits = engine(input_ids=batch).logits
    engine.train()
    torch.save({"input_ids": batch, "logits": logits}, os.path.join(work, "reference.pt"))
    del logits
    out: dict = {"peaks": {"reference logits": phase_peak()}}

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


def verify_child(work: str) -> dict:
    """Loads each export with from_pretrained (fp32, plain transformers) and compares its logits
    on the reference batch with the engine's; one model in memory at a time."""
    import gc

    import torch
    from transformers import AutoModelForCausalLM

    ref = torch.load(os.path.join(work, "reference.pt"))
    res = {}
    for name in EXPORTS:
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


def table(o: dict, verify: dict, rss_verify: int) -> list[str]:
    """Markdown lines for capacity's report."""
    gib = 1 << 30
    e = o["export"]
    lines = ["", "| export | files | size | time s | disk floor s | x floor | peak RSS | from_pretrained logits |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    ph = o["phase_peak_rss"]
    peaks = {"save_16bit_model": ph["save_16bit_model"], "trainer_save_model": ph["trainer save_model"]}
    for name in EXPORTS:
        x, v = e[name], verify.get(name, {})
        weights = [f for f in x["files"] if f.endswith((".bin", ".safetensors")) and f != "training_args.bin"]
        match = (
            "not verified"
            if not v
            else ("identical" if v["equal"] else f"max abs diff {v['max_abs_diff']:.3g}")
        )
        lines.append(
            f"| {name} | {len(weights)} weight files{' + index' if any(f.endswith('.index.json') for f in x['files']) else ''} "
            f"| {x['bytes'] / 1e9:.1f} GB | {x['s']:.1f} | {x['floor_s']:.1f} | {x['vs_floor']:.2f} | "
            f"{peaks[name] / gib:.2f} GiB | {match} |"
        )
    if "page_cache" in e:
        pc = e["page_cache"]
        lines.append(
            f"| save_16bit_model through the page cache (as before O_DIRECT) | | {pc['bytes'] / 1e9:.1f} GB | {pc['s']:.1f} | "
            f"{pc['floor_s']:.1f} | {pc['vs_floor']:.2f} | {o['phase_peak_rss']['save_16bit_model, page cache'] / gib:.2f} GiB | |"
        )
    if verify:
        lines.append(
            f"(the from_pretrained check ran in a process of its own: peak RSS {rss_verify / gib:.2f} GiB)"
        )
    ok = all(verify.get(name, {}).get("close", False) for name in EXPORTS)
    lines.append(
        f"bar: both exports load with from_pretrained and give the engine's logits: {'PASS' if ok else 'FAIL'}"
    )
    return lines
