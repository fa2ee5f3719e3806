"""The A/B harness's own logic: the table and the turn-taking protocol of its workers."""

import json

import pytest

from offloadpp.bench.ab import format_table, summarize


def _run(side, secs, loss):
    return {
        "side": side, "params": 1000, "tokens_per_step": 256, "peak_rss_bytes": 2**30,
        "peak_device_bytes": None, "ssd_read_bytes": 2**30, "ssd_write_bytes": 2**29,
        "steps": [{"step": i, "seconds": s, "loss": v} for i, (s, v) in enumerate(zip(secs, loss))],
    }  # fmt: skip


def test_summary_skips_the_warm_up_step_and_takes_the_median():
    s = summarize(_run("zero", [9.0, 2.0, 1.0, 3.0], [4, 3, 2, 1]))
    assert s["step_s"] == 2.0
    assert s["tokens_per_s"] == pytest.approx(128.0)
    assert s["final_loss"] == 1


def test_table_has_the_ratio_column():
    summ = {"zero": summarize(_run("zero", [1, 2, 2, 2], [1] * 4)),
            "offloadpp": summarize(_run("offloadpp", [1, 1, 1, 1], [1] * 4))}  # fmt: skip
    table = format_table(summ)
    assert "| step time (s, median) | 2.000 | 1.000 | 0.500 |" in table
    assert "peak device mem (GiB) | n/a | n/a | n/a |" in table


def test_table_shows_the_steps_own_peak_rss_apart_from_the_build():
    ours = _run("offloadpp", [1, 1, 1], [1] * 3)
    ours["phase_peak_rss_bytes"] = {"build": 2**32, "initialize": 2**31, "steps": 3 * 2**29}
    summ = {"zero": summarize(_run("zero", [1, 1, 1], [1] * 3)), "offloadpp": summarize(ours)}
    assert summ["offloadpp"]["steps_peak_rss_gib"] == 1.5
    assert "| peak RSS of the steps (GiB) | n/a | 1.50 | n/a |" in format_table(summ)


def test_worker_turns_grant_steps_in_chunks(monkeypatch, capsys):
    import io

    from offloadpp.bench.ab_worker import _step_turns

    monkeypatch.setattr("sys.stdin", io.StringIO("run 2\nrun 2\nrun 2\nfinish\n"))
    assert list(_step_turns(5, turns=True)) == [0, 1, 2, 3, 4]
    assert capsys.readouterr().out.split() == ["ready", "done", "done", "done"]
    assert list(_step_turns(3, turns=False)) == [0, 1, 2]


def test_worker_holds_until_the_harness_says_finish(monkeypatch):
    """After its last turn a side must not wrap up (and load the machine) on its own."""
    import io

    from offloadpp.bench.ab_worker import _step_turns

    stdin = io.StringIO("run 2\n")
    monkeypatch.setattr("sys.stdin", stdin)
    with pytest.raises(RuntimeError, match="went away"):
        list(_step_turns(2, turns=True))  # the harness closed stdin without "finish"
    monkeypatch.setattr("sys.stdin", io.StringIO("run 2\nfinish\n"))
    assert list(_step_turns(2, turns=True)) == [0, 1]


def test_both_sides_must_run_the_same_json_aio_block_included():
    from offloadpp.bench.ab import same_json

    aio = {"block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 1}
    zero = {"gradient_clipping": 1.0, "aio": aio, "zero_optimization": {"offload_param": {"nvme_path": "/a"}}}
    ours = json.loads(json.dumps(zero))
    ours["zero_optimization"]["offload_param"]["nvme_path"] = "/b"  # differs by design
    ours["offloadpp"] = {"enabled": True, "nvme_paths": ["/b"]}
    shared = same_json({"zero": {"config": zero}, "offloadpp": {"config": ours}})
    assert shared["aio"] == aio and "offloadpp" not in shared
    del ours["aio"]
    with pytest.raises(RuntimeError, match="offloadpp side ran another DeepSpeed JSON"):
        same_json({"zero": {"config": zero}, "offloadpp": {"config": ours}})


def test_capacity_runs_one_json_on_both_sides():
    import argparse

    from offloadpp.bench import capacity

    p = argparse.ArgumentParser()
    capacity.add_arguments(p)
    args = p.parse_args([])
    ours, zero = capacity.ds_config(args, "/n", "offloadpp"), capacity.ds_config(args, "/n", "zero")
    assert ours.pop("offloadpp") == {"enabled": True} and ours == zero
    assert zero["aio"]["block_size"] == 1 << 20 and zero["aio"]["queue_depth"] == 8
    # --offloadpp-block: keys of our side's block only (the 1.31B run with a 16 GiB host budget)
    args = p.parse_args(["--offloadpp-block", '{"host_budget_bytes": "16GiB"}'])
    ours, zero = capacity.ds_config(args, "/n", "offloadpp"), capacity.ds_config(args, "/n", "zero")
    assert ours.pop("offloadpp") == {"enabled": True, "host_budget_bytes": "16GiB"} and ours == zero


def test_pretrain_writes_weights_the_workers_load_and_the_share_of_speculating_steps(tmp_path):
    """--pretrain-steps: the preset trained in memory, saved as the initial weights (the tied head
    left out, as the fresh ones are); the summary says how many of offloadpp's steps speculated."""
    torch = pytest.importorskip("torch")
    from offloadpp.bench.ab import _write_init, updates_share
    from offloadpp.bench.ab_worker import _build_model
    from offloadpp.bench.pretrain import pretrain

    path = str(tmp_path / "pre.safetensors")
    out = pretrain("gpt2-tiny", 30, 0, path, log=lambda _: None)
    assert len(out["losses"]) == 30 and out["losses"][-1] < out["losses"][0]
    assert json.load(open(path + ".json"))["steps"] == 30
    _, model = _build_model("gpt2-tiny", path)  # loads, or raises naming what does not match
    _write_init("gpt2-tiny", 0, str(tmp_path / "fresh.safetensors"))  # the same seed's fresh weights
    fresh = _build_model("gpt2-tiny", str(tmp_path / "fresh.safetensors"))[1].state_dict()
    assert not torch.equal(model.state_dict()["transformer.wte.weight"], fresh["transformer.wte.weight"])
    share = updates_share({"updates": ["deferred", "deferred", "speculative", "speculative"],
                           "grad_norms": [3.0, 0.9, 0.8, None]})  # fmt: skip
    assert share["speculative"] == 2 and share["share"] == 0.5
    assert "2 of 4 steps speculative (50%)" in share["line"] and "0.800-3.000" in share["line"]
