"""Every key of a DeepSpeed config, as offloadpp treats it when the `offloadpp` block is enabled.

    honoured   offloadpp does what DeepSpeed does with it (most are parsed by DeepSpeed's own
               DeepSpeedConfig, so they keep DeepSpeed's meaning exactly)
    ignored    on purpose: ZeRO-3's buffer and bucket knobs (offloadpp sizes its own buffers),
               collective-communication knobs (offloadpp issues its own), diagnostics offloadpp reports its
               own way, and the sub-keys of a feature that is refused or off
    refused    initialize raises, naming the key and the way to get what it asks for, unless the
               value is one of `allowed` (DeepSpeed's default, i.e. the feature is off)

A key ending in `.*` covers every key below it. tests/test_ds_keys.py enumerates every key the
pinned DeepSpeed's DeepSpeedConfig reads and checks each has an entry here and a row in
docs/deepspeed.md; `check_keys` applies the table to a config at initialize.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, Optional

HONOURED, IGNORED, REFUSED = "honoured", "ignored", "refused"


@dataclass(frozen=True)
class Key:
    status: str
    note: str
    allowed: Optional[tuple] = None  # refused: values that pass; None: refused whenever present


def _h(note: str) -> Key:
    return Key(HONOURED, note)


def _i(note: str) -> Key:
    return Key(IGNORED, note)


def _r(note: str, *allowed: Any) -> Key:
    return Key(REFUSED, note, allowed if allowed else None)


_ONE = "offloadpp issues its own collectives (a gather per fetched unit, a reduce-scatter per unit and step: docs/distributed.md)"
_BUF = "ZeRO-3's buffer/bucket sizing; offloadpp sizes its buffers from the plan's budgets"
_OFF = "only read when the feature above is on"
_AIO = ("not applied (logged): tuned for ZeRO-Infinity's swapper; offloadpp's I/O settings come from the "
        "hardware profile, else its defaults; ")  # fmt: skip
_REMOVED = "DeepSpeed 0.19.8 itself refuses this removed feature"
_MONITOR = ("DeepSpeed's own writer (MonitorMaster) gets, from rank 0 at each step's end, the events DeepSpeedEngine "
            "writes (Train/Samples/lr, loss_scale under fp16), Train/Samples/train_loss and the step report's "
            "figures under Train/offloadpp/ (docs/deepspeed.md, Monitors),")  # fmt: skip
_SEE_BLOCK = "offloadpp's own setting replaces it: see the offloadpp block"

KEYS: dict[str, Key] = {
    # ---- batch, steps, precision, clipping -------------------------------------------------
    "train_batch_size": _h("checked against micro batch x accumulation, as DeepSpeed does"),
    "train_micro_batch_size_per_gpu": _h("the micro-batch; the dataloader initialize returns uses it"),
    "gradient_accumulation_steps": _h("micro-batches per step; backward scales the loss by 1/this"),
    "managed_gradient_accumulation": _r(
        "the engine counts micro-batches (or follows set_gradient_accumulation_boundary); set "
        "gradient_accumulation_steps instead of stepping each micro-batch yourself",
        True,
    ),
    "gradient_clipping": _h("exact global-norm clipping, as torch.nn.utils.clip_grad_norm_"),
    "steps_per_print": _h("a step report is logged every this many steps"),
    "fp16": _h("the block"),
    "fp16.enabled": _h("fp16 compute, fp32 master weights and moments"),
    "fp16.auto_cast": _h("floating-point inputs are cast to fp16 before forward"),
    "fp16.loss_scale": _h("0: dynamic loss scaling, else a static scale"),
    "fp16.initial_scale_power": _h("dynamic scaling starts at 2**this"),
    "fp16.loss_scale_window": _h("clean steps before the scale doubles"),
    "fp16.hysteresis": _h("overflows tolerated before the scale halves"),
    "fp16.consecutive_hysteresis": _h("a clean step restores the hysteresis"),
    "fp16.min_loss_scale": _h("the scale never drops below it; an overflow there stops the run"),
    "fp16.fp16_master_weights_and_grads": _r("offloadpp keeps fp32 master weights and gradients", False),
    "bf16": _h("the block"),
    "bf16.enabled": _h("bf16 compute, fp32 master weights and moments"),
    "bf16.bf16_master_weights_and_grads": _r("offloadpp keeps fp32 master weights and gradients", False),
    "bf16.bf16_optimizer_states": _r("offloadpp keeps the Adam moments in fp32", False),
    "bf16.immediate_grad_update": _i(
        "offloadpp updates each unit as soon as its gradients are complete anyway"
    ),
    "bf16.check_grad_overflow": _i(
        "bf16 steps are not skipped on inf/nan gradients; with gradient_clipping a non-finite norm stops "
        "the run (FloatingPointError)"
    ),
    "bfloat16": _h("the old name of bf16, same keys"),
    "bfloat16.enabled": _h("as bf16.enabled"),
    "bfloat16.bf16_master_weights_and_grads": _r("offloadpp keeps fp32 master weights and gradients", False),
    "bfloat16.bf16_optimizer_states": _r("offloadpp keeps the Adam moments in fp32", False),
    "bfloat16.immediate_grad_update": _i("as bf16.immediate_grad_update"),
    "bfloat16.check_grad_overflow": _i("as bf16.check_grad_overflow"),
    "torch_autocast": _h("the block"),
    "torch_autocast.enabled": _r('use "bf16": {"enabled": true} (bf16 compute, fp32 master weights)', False),
    "torch_autocast.*": _i(_OFF),
    "data_types": _h("the block"),
    "data_types.grad_accum_dtype": _r("offloadpp accumulates gradients in fp32", None, "fp32"),
    "data_types.param_dtype": _r("the compute dtype comes from the fp16/bf16 blocks", None),
    "data_types.buffer_dtype": _r("module buffers keep their dtype", None),
    "data_types.keep_in_fp32_modules": _r("module buffers keep their dtype", "auto"),
    # ---- the optimizer and the schedule ----------------------------------------------------------
    "optimizer": _h("the block (or optimizer= to initialize: torch.optim Adam/AdamW and DeepSpeed's Adams)"),
    "optimizer.type": _h("Adam or AdamW (Adam is AdamW unless adam_w_mode is false); others are refused"),
    "optimizer.params": _h("lr, betas, eps, weight_decay, bias_correction, adam_w_mode; amsgrad is refused"),
    "optimizer.legacy_fusion": _i("a DeepSpeed fp16 optimizer detail"),
    "scheduler": _h("the block"),
    "scheduler.type": _h(
        "WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest: DeepSpeed's own classes"
    ),
    "scheduler.params": _h("passed to DeepSpeed's scheduler class"),
    "zero_allow_untested_optimizer": _i(
        "offloadpp takes Adam/AdamW from any source and refuses other optimizers"
    ),
    "zero_force_ds_cpu_optimizer": _i("offloadpp runs its own CPU Adam whatever optimizer object is passed"),
    # ---- ZeRO ---------------------------------------------------------------------------------
    "zero_optimization": _h("the block"),
    "zero_optimization.stage": _r(
        "offloadpp replaces ZeRO stage 3 with its offload; set it to 3 (or leave it out)", 3
    ),
    "zero_optimization.offload_param": _h("the block"),
    "zero_optimization.offload_param.device": _h(
        '"nvme": the weights live on SSD; otherwise where the budgets allow'
    ),
    "zero_optimization.offload_param.nvme_path": _h(
        "a directory for swap files (offloadpp.nvme_paths overrides)"
    ),
    "zero_optimization.offload_param.buffer_count": _i(_BUF),
    "zero_optimization.offload_param.buffer_size": _i(_BUF),
    "zero_optimization.offload_param.max_in_cpu": _i(_BUF),
    "zero_optimization.offload_param.pin_memory": _i(
        "offloadpp.io.pin decides (default: pinned when CUDA is present)"
    ),
    "zero_optimization.offload_optimizer": _h("the block"),
    "zero_optimization.offload_optimizer.device": _h(
        '"nvme": master weights and moments live on SSD; otherwise where the budgets allow'
    ),
    "zero_optimization.offload_optimizer.nvme_path": _h(
        "a directory for swap files (offloadpp.nvme_paths overrides)"
    ),
    "zero_optimization.offload_optimizer.buffer_count": _i(_BUF),
    "zero_optimization.offload_optimizer.pin_memory": _i("offloadpp.io.pin decides"),
    "zero_optimization.offload_optimizer.pipeline_read": _i(
        "offloadpp always reads state ahead of its update"
    ),
    "zero_optimization.offload_optimizer.pipeline_write": _i(
        "offloadpp always writes state back behind compute"
    ),
    "zero_optimization.offload_optimizer.fast_init": _i("offloadpp writes the first state unit by unit"),
    "zero_optimization.offload_optimizer.cpuadam_cores_perc": _i(
        "offloadpp.adam_threads sets the CPU Adam's threads"
    ),
    "zero_optimization.offload_optimizer.ratio": _r(
        "partial offload: offloadpp's plan places each unit's state", 1
    ),
    "zero_optimization.offload_optimizer.super_offload": _r(
        "offloadpp overlaps the CPU optimizer itself", False
    ),
    "zero_optimization.cpu_offload": _h("DeepSpeed's old alias of offload_optimizer.device cpu"),
    "zero_optimization.cpu_offload_param": _h("DeepSpeed's old alias of offload_param.device cpu"),
    "zero_optimization.cpu_offload_use_pin_memory": _i("offloadpp.io.pin decides"),
    "zero_optimization.sub_group_size": _i(_BUF),
    "zero_optimization.stage3_prefetch_bucket_size": _i(_BUF),
    "zero_optimization.stage3_param_persistence_threshold": _i(_BUF),
    "zero_optimization.stage3_model_persistence_threshold": _i(_BUF),
    "zero_optimization.stage3_max_live_parameters": _i(_BUF),
    "zero_optimization.stage3_max_reuse_distance": _i(_BUF),
    "zero_optimization.stage3_module_granularity_threshold": _i(_BUF),
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": _i(
        "the weights can always be exported: save_16bit_model and Trainer's save_model fetch them unit by unit"
    ),
    "zero_optimization.stage3_gather_fp16_weights_on_model_save": _i(
        "as stage3_gather_16bit_weights_on_model_save"
    ),
    "zero_optimization.leaf_module": _i("offloadpp's unit is a whole block; see offloadpp.units"),
    "zero_optimization.leaf_module.*": _i("offloadpp's unit is a whole block; see offloadpp.units"),
    "zero_optimization.memory_efficient_linear": _i("a ZeRO-3 parameter-fetch detail"),
    "zero_optimization.override_module_apply": _i("a ZeRO-3 parameter-fetch detail"),
    "zero_optimization.contiguous_gradients": _i(
        "offloadpp moves each unit's gradients into one flat buffer anyway"
    ),
    "zero_optimization.reduce_scatter": _i(_ONE),
    "zero_optimization.reduce_bucket_size": _i(_ONE),
    "zero_optimization.use_multi_rank_bucket_allreduce": _i(_ONE),
    "zero_optimization.allgather_partitions": _i(_ONE),
    "zero_optimization.allgather_bucket_size": _i(_ONE),
    "zero_optimization.overlap_comm": _i(_ONE),
    "zero_optimization.round_robin_gradients": _i(_ONE),
    "zero_optimization.stage3_use_all_reduce_for_fetch_params": _i(_ONE),
    "zero_optimization.stage3_allgather_sequential": _i(_ONE),
    "zero_optimization.zero_hpz_partition_size": _i(_ONE),
    "zero_optimization.mics_shard_size": _i(_ONE),
    "zero_optimization.mics_hierarchical_params_gather": _i(_ONE),
    "zero_optimization.compute_grad_norm": _i("the norm is computed when clipping or fp16 needs it"),
    "zero_optimization.load_from_fp32_weights": _i(
        "offloadpp's checkpoints hold the fp32 master weights; they are loaded"
    ),
    "zero_optimization.elastic_checkpoint": _i(
        "a checkpoint reshards to any world size when loaded (docs/distributed.md)"
    ),
    "zero_optimization.ignore_unused_parameters": _i(
        "a parameter without a gradient is skipped, as torch.optim does"
    ),
    "zero_optimization.parameter_alignment": _i("offloadpp aligns its flat buffers itself"),
    "zero_optimization.pipeline_loading_checkpoint": _i("pipeline parallelism is refused"),
    "zero_optimization.log_trace_cache_warnings": _i("a ZeRO-3 prefetch-trace detail"),
    "zero_optimization.enable_sanity_checks": _i("a ZeRO-3 debugging aid"),
    "zero_optimization.save_muon_momentum_buffer_in_memory": _i("Muon is not an optimizer offloadpp runs"),
    "zero_optimization.legacy_stage1": _r("offloadpp replaces ZeRO stage 3", False),
    "zero_optimization.zero_quantized_weights": _r("ZeRO++ quantization is not supported", False),
    "zero_optimization.zero_quantized_nontrainable_weights": _r(
        "ZeRO++ quantization is not supported", False
    ),
    "zero_optimization.zero_quantized_gradients": _r("ZeRO++ quantization is not supported", False),
    "zero_optimization.zeropp_loco_param": _r("ZeRO++ LoCo is not supported", None),
    "zero_optimization.zenflow": _r("offloadpp overlaps the CPU optimizer with backward itself", None),
    "zero_optimization.zenflow.*": _i(_OFF),
    # ---- I/O and checkpoints --------------------------------------------------------------------
    "aio": _h("the block"),
    "aio.block_size": _i(_AIO + "offloadpp.io.block_size_bytes sets ours"),
    "aio.queue_depth": _i(_AIO + "offloadpp.io.queue_depth sets ours"),
    "aio.intra_op_parallelism": _i(_AIO + "offloadpp.io.num_threads sets ours"),
    "aio.single_submit": _i("offloadpp's I/O engine submits in batches"),
    "aio.overlap_events": _i("offloadpp's I/O engine always overlaps submission and completion"),
    "aio.use_gds": _r(
        "GPUDirect Storage is not supported; offloadpp reads through pinned host buffers", False
    ),
    "checkpoint": _h("the block"),
    "checkpoint.tag_validation": _i("rank 0 names the checkpoint folder; every rank writes under it"),
    "checkpoint.use_node_local_storage": _h(
        "each node's first rank writes the node's manifest and `latest` into save_dir on its own disk, every rank "
        "its shards there; resumes on the same nodes (docs/distributed.md)"
    ),
    "checkpoint.parallel_write": _i("every rank writes its own shards, rank 0 the rest"),
    "checkpoint.checkpoint_serialization": _i(
        "offloadpp writes its own checkpoint format (runtime/checkpoint.py)"
    ),
    "checkpoint.load_universal": _h(
        "load_checkpoint reads a DeepSpeed universal checkpoint (ds_to_universal's folder, named by "
        "`latest_universal` or the tag) into the engine: master weights, Adam moments, steps, scheduler "
        "(docs/checkpoints.md, 'Moving a run over from ZeRO-Infinity')"
    ),
    "checkpoint.writer": _r("offloadpp writes its checkpoints itself", None),
    "checkpoint.writer.*": _i(_OFF),
    "datastates_ckpt": _r("offloadpp writes its checkpoints itself"),
    "dataloader_drop_last": _h("for the dataloader initialize returns"),
    # ---- features offloadpp refuses -------------------------------------------------------------
    "pipeline": _r("pipeline parallelism is not supported"),
    "tensor_parallel": _h("the block"),
    "tensor_parallel.autotp_size": _r("tensor parallelism is not supported", 0, 1),
    "tensor_parallel.*": _i(_OFF),
    "expert_parallel": _h("the block"),
    "expert_parallel.enabled": _r("expert parallelism is not supported", False),
    "expert_parallel.*": _i(_OFF),
    "sequence_parallel_size": _r("sequence parallelism is not supported", 1),
    "hybrid_engine": _h("the block"),
    "hybrid_engine.enabled": _r("DeepSpeed's hybrid (RLHF) engine is not supported", False),
    "hybrid_engine.*": _i(_OFF),
    "compile": _h("the block"),
    "compile.deepcompile": _r(
        "DeepCompile is not supported; torch.compile the model's blocks yourself", False
    ),
    "compile.*": _i(_OFF),
    "data_efficiency": _h("the block"),
    "data_efficiency.enabled": _r("DeepSpeed's data efficiency library is not supported", False),
    "data_efficiency.*": _i(_OFF),
    "weight_quantization": _r("weight quantization is not supported"),
    "weight_quantization.*": _i(_OFF),
    "autotuning": _h("the block"),
    "autotuning.enabled": _r(
        "the autotuner drives ZeRO's knobs; offloadpp's planner sizes its own (plan: auto)", False
    ),
    "autotuning.*": _i(_OFF),
    "activation_checkpointing": _i(
        "configures deepspeed.checkpointing for models that call it; offloadpp's engine does not act on it (its "
        "activation policies: offloadpp.activations)"
    ),
    "activation_checkpointing.*": _i("as activation_checkpointing"),
    "flops_profiler": _h("the block"),
    "flops_profiler.enabled": _r(
        "the step reports give each phase's time; torch.profiler sees offloadpp's record_function ranges",
        False,
    ),
    "flops_profiler.*": _i(_OFF),
    "tensorboard": _h("the block"),
    "tensorboard.enabled": _h(_MONITOR + " into TensorBoard event files (needs the tensorboard package)"),
    "tensorboard.output_path": _h("the events go in output_path/job_name, as DeepSpeed writes them"),
    "tensorboard.job_name": _h("the folder under output_path"),
    "wandb": _h("the block"),
    "wandb.enabled": _h(_MONITOR + " to Weights & Biases (needs the wandb package)"),
    "wandb.group": _h("passed to wandb.init by DeepSpeed's writer"),
    "wandb.team": _h("passed to wandb.init (entity) by DeepSpeed's writer"),
    "wandb.project": _h("passed to wandb.init by DeepSpeed's writer"),
    "csv_monitor": _h("the block"),
    "csv_monitor.enabled": _h(_MONITOR + " into one CSV file per event under output_path/job_name"),
    "csv_monitor.output_path": _h("the files go in output_path/job_name, as DeepSpeed writes them"),
    "csv_monitor.job_name": _h("the folder under output_path"),
    "comet": _h("the block"),
    "comet.enabled": _h(_MONITOR + " to Comet (needs comet_ml >= 3.41.0)"),
    "comet.samples_log_interval": _h("DeepSpeed's writer logs each event at most once per this many samples"),
    "comet.project": _h("passed to comet_ml.start by DeepSpeed's writer"),
    "comet.workspace": _h("passed to comet_ml.start by DeepSpeed's writer"),
    "comet.api_key": _h("passed to comet_ml.start by DeepSpeed's writer"),
    "comet.experiment_name": _h("passed to the experiment by DeepSpeed's writer"),
    "comet.experiment_key": _h("passed to comet_ml.start by DeepSpeed's writer"),
    "comet.online": _h("passed to comet_ml.start by DeepSpeed's writer"),
    "comet.mode": _h("passed to comet_ml.start by DeepSpeed's writer"),
    # ---- diagnostics, communication, the rest -------------------------------------------------------
    "wall_clock_breakdown": _h(
        "with a monitor on, DeepSpeed's Train/Samples/elapsed_time_ms_* events from the step report (docs/deepspeed.md, "
        "Monitors); every step report carries forward, backward and optimizer-wait times anyway"
    ),
    "memory_breakdown": _i("every step report carries each budget's peak"),
    "dump_state": _i("the plan and its budgets are logged at initialize"),
    "timers": _i("every step report carries the step time"),
    "timers.*": _i("every step report carries the step time"),
    "comms_logger": _i(_ONE),
    "comms_logger.*": _i(_ONE),
    "log_level": _i("DeepSpeed's own logger; offloadpp logs on 'offloadpp' and 'offloadpp.runtime'"),
    "disable_python_gc": _h(
        "automatic cyclic GC is off while the engine runs (DeepSpeed's python_gc_manager)"
    ),
    "disable_allgather": _i(_ONE),
    "communication_data_type": _i(_ONE),
    "seq_parallel_communication_data_type": _i(_ONE),
    "prescale_gradients": _i(_ONE),
    "gradient_predivide_factor": _i(_ONE),
    "gradient_allreduce_op": _i(_ONE),
    "use_data_before_expert_parallelism": _i("expert parallelism is refused"),
    "vocabulary_size": _i("not used by the training path"),
    "offloadpp": _h("this project's block (the next table)"),
    # ---- removed from DeepSpeed 0.19.8, which refuses them itself ------------------------------------
    "amp": _r(_REMOVED),
    "compression_training": _r(_REMOVED),
    "curriculum_learning": _r(_REMOVED),
    "eigenvalue": _r(_REMOVED),
    "elasticity": _r(_REMOVED),
    "graph_harvesting": _r(_REMOVED),
    "nebula": _r(_REMOVED),
    "progressive_layer_drop": _r(_REMOVED),
    "quantize_training": _r(_REMOVED),
    "sparse_attention": _r(_REMOVED),
    "sparse_gradients": _r(_REMOVED),
}

# Keys whose value is not a block of DeepSpeed keys: the optimizer's and scheduler's params are
# checked by the Adam reader and DeepSpeed's scheduler classes; the offloadpp block by parse_block.
_OPAQUE = ("optimizer.params", "scheduler.params", "offloadpp")


def entry(path: str) -> Optional[Key]:
    """The table's entry for a dotted key: its own, else the nearest `.*` above it."""
    if path in KEYS:
        return KEYS[path]
    parts = path.split(".")
    for i in range(len(parts) - 1, 0, -1):
        wild = ".".join(parts[:i]) + ".*"
        if wild in KEYS:
            return KEYS[wild]
    return None


def _has_children(path: str) -> bool:
    prefix = path + "."
    return any(k.startswith(prefix) for k in KEYS)


def check_keys(ds: dict, error=ValueError) -> dict:
    """Applies the table to a DeepSpeed config dict: an unknown key, a refused key set to
    something other than its allowed values, or "auto" left where a value is needed raise
    `error` naming the key. Returns a copy without the ignored keys, for DeepSpeed's own parser
    (their values do not matter, so they must not fail it either)."""
    return _walk(ds, "", error)


def _walk(block: dict, prefix: str, error) -> dict:
    out = {}
    for key, value in block.items():
        path = prefix + str(key)
        e = entry(path)
        if e is None:
            siblings = [
                k[len(prefix) :] for k in KEYS if k.startswith(prefix) and "." not in k[len(prefix) :]
            ]
            close = difflib.get_close_matches(str(key), siblings, n=1, cutoff=0.7)
            hint = f"; did you mean {prefix + close[0]!r}?" if close else ""
            raise error(
                f"{path}: not a key of the pinned DeepSpeed's config{hint} (DeepSpeed would ignore it; with "
                "offloadpp enabled every key is honoured, ignored on purpose or refused: docs/deepspeed.md)"
            )
        if e.status == IGNORED:
            continue
        if e.status == REFUSED and (e.allowed is None or not any(_same(value, a) for a in e.allowed)):
            raise error(f"{path}: {value!r} is not supported by offloadpp: {e.note}")
        if isinstance(value, str) and value.strip().lower() == "auto" and e.status == HONOURED:
            raise error(
                f'{path}: "auto" is filled in by Hugging Face Trainer or Accelerate; called directly, give a value'
            )
        if isinstance(value, dict) and path not in _OPAQUE and _has_children(path):
            value = _walk(value, path + ".", error)
        out[key] = value
    return out


def _same(value: Any, allowed: Any) -> bool:
    if isinstance(value, bool) != isinstance(allowed, bool) and allowed is not None:
        return False
    return value == allowed


def top_level_keys() -> frozenset:
    return frozenset(k for k in KEYS if "." not in k)
