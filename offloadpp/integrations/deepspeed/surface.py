"""Which of DeepSpeedEngine's public methods OffloadppEngine inherits, and which it refuses.

OffloadppEngine subclasses DeepSpeedEngine without running its `__init__`, so an inherited
method is only safe if it reads nothing but the parsed config (`self._config`) and other such
getters: those are INHERITED (tests/test_ds_engine_surface.py checks each one's source). The
methods written in engine.py are the engine's own. Every other public method would touch
DeepSpeed's internal state, which does not exist here: `complete` replaces each with one that
raises NotImplementedError naming what to use instead (UNSUPPORTED).
"""

from __future__ import annotations

INHERITED = (
    "aio_config", "autotp_size", "autotuning_enabled", "autotuning_end_profile_step", "autotuning_metric",
    "autotuning_metric_path", "autotuning_model_info_path", "autotuning_profile_model_info",
    "autotuning_start_profile_step", "bf16_master_weights_and_gradients", "bf16_optimizer_states",
    "bfloat16_enabled", "checkpoint_serialization_enabled", "checkpoint_tag_validation_enabled",
    "checkpoint_tag_validation_fail", "checkpoint_writer_enabled", "communication_data_type",
    "compile_autosp", "compile_autotp", "compile_zero_optimization_stage", "cpuadam_cores_perc",
    "curriculum_learning_config", "curriculum_learning_enabled", "data_efficiency_config",
    "data_efficiency_enabled", "data_sampling_config", "data_sampling_enabled", "dataloader_drop_last",
    "dump_state", "dynamic_loss_scale", "dynamic_loss_scale_args", "flops_profiler_detailed",
    "flops_profiler_enabled", "flops_profiler_module_depth", "flops_profiler_output_file",
    "flops_profiler_profile_step", "flops_profiler_recompute_fwd_factor", "flops_profiler_top_modules",
    "fp16_auto_cast", "fp16_enabled", "fp16_master_weights_and_gradients", "get_batch_info",
    "gradient_accumulation_steps", "gradient_clipping", "gradient_predivide_factor", "initial_dynamic_scale",
    "is_deepcompile_enabled", "is_iterable_style_dataset", "is_map_style_dataset", "is_sanity_checks_enabled",
    "load_universal_checkpoint", "log_level", "loss_scale", "managed_gradient_accumulation", "memory_breakdown",
    "optimizer_legacy_fusion", "optimizer_params", "postscale_gradients", "random_ltd_config",
    "random_ltd_enabled", "scheduler_name", "scheduler_params", "steps_per_print", "super_offload",
    "swap_tensor_config", "tensor_parallel_config", "torch_autocast_dtype", "torch_autocast_enabled",
    "torch_autocast_lower_precision_safe_modules", "train_batch_size", "train_micro_batch_size_per_gpu",
    "use_node_local_storage", "wall_clock_breakdown", "zenflow_config", "zero_allgather_bucket_size",
    "zero_allgather_partitions", "zero_allgather_sequential", "zero_allow_untested_optimizer",
    "zero_compute_grad_norm", "zero_contiguous_gradients", "zero_cpu_offload", "zero_elastic_checkpoint",
    "zero_force_ds_cpu_optimizer", "zero_hpz_partition_size", "zero_ignore_unused_parameters",
    "zero_legacy_stage1", "zero_load_from_fp32_weights", "zero_log_trace_cache_warnings",
    "zero_max_live_parameters", "zero_max_reuse_distance", "zero_model_persistence_threshold",
    "zero_module_granularity_threshold", "zero_multi_rank_bucket_allreduce", "zero_offload_optimizer",
    "zero_offload_param", "zero_optimization", "zero_optimization_partition_gradients",
    "zero_optimization_partition_weights", "zero_optimization_stage", "zero_overlap_comm",
    "zero_param_persistence_threshold", "zero_parameter_alignment", "zero_partial_offload",
    "zero_prefetch_bucket_size", "zero_quantized_gradients", "zero_quantized_nontrainable_weights",
    "zero_quantized_weights", "zero_reduce_bucket_size", "zero_reduce_scatter", "zero_round_robin_gradients",
    "zero_save_muon_momentum_buffer_in_memory", "zero_sub_group_size", "zero_use_cpu_optimizer",
    "is_first_weights_partition_group",
)  # fmt: skip

_ONE = "offloadpp reduces the gradients itself, unit by unit during backward (docs/distributed.md)"
_REPORT = "the StepReport of each step (engine.last_report, engine.reports) carries the times and bytes"
_COMPILE = (
    "DeepCompile and engine.compile are not supported (offloadpp's hooks run between the model's blocks)"
)
_DATA = "DeepSpeed's data efficiency library is not supported"

UNSUPPORTED = {
    "allreduce_gradients": _ONE,
    "allreduce_bucket": _ONE,
    "allreduce_and_copy": _ONE,
    "allreduce_no_retain": _ONE,
    "buffered_allreduce_fallback": _ONE,
    "sparse_allreduce": _ONE,
    "sparse_allreduce_bucket": _ONE,
    "sparse_allreduce_no_retain": _ONE,
    "sparse_all_gather": _ONE,
    "all_gather_scalar": _ONE,
    "get_sequence_parallel_group": "sequence parallelism is not supported",
    "get_wall_clock_timers": _REPORT,
    "print_forward_breakdown": _REPORT,
    "compile": _COMPILE,
    "get_compile_time": _COMPILE,
    "register_compile_pass": _COMPILE,
    "is_deepcompile_active": _COMPILE,
    "get_deepcompile_backend": _COMPILE,
    "get_deepspeed_compile_backend": _COMPILE,
    "get_autosp_backend": _COMPILE,
    "get_autotp_backend": _COMPILE,
    "uses_parallelization_pass_only": _COMPILE,
    "set_data_post_process_func": _DATA,
    "set_custom_curriculum_learning_schedule": _DATA,
    "random_ltd_initialize": _DATA,
    "set_train_batch_size": "the plan is made for the configured batch: set train_batch_size in the config and "
    "start a new engine",
    "set_train_micro_batch_size": "the plan is made for the configured batch: set train_micro_batch_size_per_gpu "
    "in the config and start a new engine",
    "clip_fp32_gradients": "set gradient_clipping in the config: the engine clips exactly, inside the update",
    "scale": "call engine.backward(loss): offloadpp's hooks must run around backward",
    "load_module_state_dict": "load weights into the model before initialize, or use engine.load_checkpoint",
    "load_moe_state_dict": "mixture-of-experts checkpoints are not supported",
    "get_optimizer_configuration": "the optimizer is offloadpp's fused CPU Adam (engine.optimizer.param_groups "
    "has each group's hyper-parameters)",
    "offload_states": "the training state already lives on SSD between uses (the plan says where)",
    "reload_states": "the training state already lives on SSD between uses (the plan says where)",
    "cpu": "the engine places the weights itself",
    "cuda": "the engine places the weights itself",
    "half": "set the compute dtype with the config's fp16 block",
    "bfloat16": "set the compute dtype with the config's bf16 block",
    "float": "the engine keeps fp32 master weights; the compute dtype comes from the fp16/bf16 blocks",
    "double": "the engine computes in fp32, bf16 or fp16",
    "type": "the compute dtype comes from the fp16/bf16 blocks",
    "to_empty": "the engine places the weights itself",
    "load_state_dict": "use engine.load_checkpoint(dir), or load weights into the model before initialize",
}


def _raiser(name: str, alternative: str):
    def refused(self, *args, **kwargs):
        raise NotImplementedError(
            f"DeepSpeedEngine.{name} is not supported by offloadpp's engine: {alternative}"
        )

    refused.__name__ = name
    refused.__doc__ = f"Not supported: {alternative}."
    return refused


def public_methods(cls) -> set:
    """DeepSpeedEngine's public methods and properties that nn.Module does not define."""
    import torch
    from deepspeed.runtime.engine import DeepSpeedEngine

    module_names = set(dir(torch.nn.Module))
    return {n for n in vars(DeepSpeedEngine) if not n.startswith("_") and n not in module_names}


def own(cls) -> set:
    """The names offloadpp writes on `cls`: its own and those of the parts it mixes in from
    offloadpp's modules (integrations/deepspeed/pipeline_api.py), not DeepSpeedEngine's."""
    return {n for k in cls.__mro__ if k.__module__.startswith("offloadpp.") for n in vars(k)}


def complete(cls) -> None:
    """Gives `cls` a refusing method for every UNSUPPORTED name it does not define itself, and
    for any public DeepSpeedEngine method neither written nor inherited on purpose (a newer
    DeepSpeed's: the surface test names those)."""
    own_names = own(cls)
    for name, alternative in UNSUPPORTED.items():
        if name not in own_names:
            setattr(cls, name, _raiser(name, alternative))
    for name in public_methods(cls) - own_names - set(INHERITED) - set(UNSUPPORTED):
        setattr(cls, name, _raiser(name, "not part of the surface offloadpp implements"))
    cls._unclassified = frozenset(public_methods(cls) - own_names - set(INHERITED) - set(UNSUPPORTED))
