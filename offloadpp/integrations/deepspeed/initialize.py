"""`offloadpp.initialize`: `deepspeed.initialize`'s signature and return value.

With `"offloadpp": {"enabled": true}` in the config it returns an OffloadppEngine on offloadpp's
runtime; without it, it is `deepspeed.initialize` (every argument passed through), after one
check DeepSpeed does not make: a top-level key close to "offloadpp" (a misspelt block, which
DeepSpeed would ignore) is an error rather than a silent ZeRO-Infinity run.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch

from offloadpp.integrations.deepspeed.config import (
    OffloadppConfigError,
    check_block_name,
    load_ds_config,
    offloadpp_enabled,
    parse_block,
)

logger = logging.getLogger("offloadpp")


class ClientOptimizer:
    """A torch optimizer on its way to initialize whose conversion to DeepSpeedCPUAdam
    (Accelerate's, for an offloaded optimizer) waits until the config is known: offloadpp reads
    the torch optimizer itself; DeepSpeed gets the conversion (patch.py)."""

    def __init__(self, optimizer: torch.optim.Optimizer, convert: Callable):
        self.optimizer = optimizer
        self.convert = convert


def initialize(
    args: Any = None,
    model: Optional[torch.nn.Module] = None,
    optimizer: Any = None,
    model_parameters: Any = None,
    training_data: Optional[torch.utils.data.Dataset] = None,
    lr_scheduler: Any = None,
    distributed_port: Optional[int] = None,
    mpu: Any = None,
    dist_init_required: Optional[bool] = None,
    collate_fn: Optional[Callable] = None,
    config: Any = None,
    mesh_param: Any = None,
    config_params: Any = None,
    *,
    _deepspeed_initialize: Optional[Callable] = None,
):
    """Returns (engine, optimizer, training_dataloader, lr_scheduler), as deepspeed.initialize."""
    if config is None and config_params is not None:
        config = config_params
    ds_dict = load_ds_config(config, args)
    check_block_name(ds_dict)
    if not offloadpp_enabled(ds_dict):
        if _deepspeed_initialize is None:
            import deepspeed

            _deepspeed_initialize = deepspeed.initialize
        if isinstance(optimizer, ClientOptimizer):
            optimizer = optimizer.convert(optimizer.optimizer)
        kwargs = dict(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                      training_data=training_data, lr_scheduler=lr_scheduler, mpu=mpu,
                      dist_init_required=dist_init_required, collate_fn=collate_fn, config=config,
                      mesh_param=mesh_param, config_params=config_params)  # fmt: skip
        if distributed_port is not None:
            kwargs["distributed_port"] = distributed_port
        return _deepspeed_initialize(**kwargs)

    if isinstance(optimizer, ClientOptimizer):
        optimizer = optimizer.optimizer
    if model is None:
        raise OffloadppConfigError("initialize: model is required")
    if mpu is not None or mesh_param is not None:
        what = "mpu=" if mpu is not None else "mesh_param="
        raise OffloadppConfigError(
            f"initialize: model, pipeline or sequence parallelism ({what}) is not supported by offloadpp: it "
            "partitions the optimizer state over data-parallel ranks only (every rank holds the whole model's "
            "compute and a shard of its state)"
        )
    from offloadpp.integrations.deepspeed.build import Given, build_engine

    given = Given(model, optimizer, model_parameters, training_data, lr_scheduler, collate_fn)
    return build_engine(
        ds_dict,
        parse_block(ds_dict),
        given,
        dist_init_required=dist_init_required,
        distributed_port=distributed_port,
    )
