"""`offloadpp.patch_deepspeed()`: unchanged DeepSpeed programs, Trainer and Accelerate on offloadpp.

Afterwards `deepspeed.initialize`, from any caller (a script, Accelerate's prepare, Trainer),
is `offloadpp.initialize`: offloadpp's engine for a config whose `offloadpp` block is enabled,
DeepSpeed's own initialize otherwise. Five smaller changes make the Hugging Face stack work:

- Accelerate converts a torch optimizer to DeepSpeedCPUAdam when the optimizer is offloaded
  (which JIT-builds DeepSpeed's cpu_adam op). The conversion now waits for initialize: offloadpp
  reads the torch optimizer's param groups itself; DeepSpeed still gets the conversion.
- transformers asks its DeepSpeed config `is_zero3()` to decide whether `from_pretrained` builds
  the model under `deepspeed.zero.Init` (ZeRO-3's partitioned parameters). With the block
  enabled the answer is False: offloadpp takes an ordinary model and partitions nothing.
- Trainer.save_model, Accelerator.save_model and Accelerator.get_state_dict on an offloadpp
  engine stream the weights to files or refuse naming the streaming call, rather than build the
  whole model as one dict in memory (patch_save.py).
- Trainer's accumulation window runs whole on an offloadpp engine (vertically where its plan
  says), not micro-batch by micro-batch (trainer_window.py).
- Code that imported `initialize` from deepspeed before the patch keeps its old reference;
  patch first (`python -m offloadpp run` does it before the script runs).

Idempotent; `unpatch_deepspeed()` restores everything.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Optional

import offloadpp.integrations.deepspeed.patch_save as patch_save
import offloadpp.integrations.deepspeed.trainer_window as trainer_window

logger = logging.getLogger("offloadpp")

_saved: dict[str, Any] = {}  # what the patch replaced, by name


def _block_enabled(config: Any) -> bool:
    block = config.get("offloadpp") if isinstance(config, dict) else None
    return isinstance(block, dict) and block.get("enabled") is True


def patch_deepspeed() -> None:
    """Routes deepspeed.initialize through offloadpp.initialize (see the module's docstring)."""
    if _saved:
        return
    import deepspeed

    from offloadpp.integrations.deepspeed.initialize import ClientOptimizer, initialize

    original = deepspeed.initialize

    @functools.wraps(original)
    def patched_initialize(*args, **kwargs):
        return initialize(*args, _deepspeed_initialize=original, **kwargs)

    patched_initialize.__offloadpp__ = True
    _saved["deepspeed.initialize"] = original
    deepspeed.initialize = patched_initialize

    try:
        import accelerate.accelerator as acc_accelerator
        import accelerate.utils.deepspeed as acc_ds
    except ImportError:
        return  # no Accelerate, nothing more to patch
    convert = acc_accelerator.map_pytorch_optim_to_deepspeed

    def defer_conversion(optimizer):
        return ClientOptimizer(optimizer, convert)

    _saved["accelerate.map_pytorch_optim_to_deepspeed"] = convert
    acc_accelerator.map_pytorch_optim_to_deepspeed = defer_conversion

    is_zero3 = acc_ds.HfDeepSpeedConfig.is_zero3

    def offloadpp_is_not_zero3(self) -> bool:
        return False if _block_enabled(self.config) else is_zero3(self)

    _saved["accelerate.HfDeepSpeedConfig.is_zero3"] = is_zero3
    acc_ds.HfDeepSpeedConfig.is_zero3 = offloadpp_is_not_zero3
    patch_save.patch(_saved)
    trainer_window.patch(_saved)


def unpatch_deepspeed() -> None:
    """Undoes patch_deepspeed()."""
    if not _saved:
        return
    import deepspeed

    patch_save.unpatch(_saved)
    trainer_window.unpatch(_saved)
    deepspeed.initialize = _saved.pop("deepspeed.initialize")
    convert: Optional[Any] = _saved.pop("accelerate.map_pytorch_optim_to_deepspeed", None)
    if convert is not None:
        import accelerate.accelerator as acc_accelerator
        import accelerate.utils.deepspeed as acc_ds

        acc_accelerator.map_pytorch_optim_to_deepspeed = convert
        acc_ds.HfDeepSpeedConfig.is_zero3 = _saved.pop("accelerate.HfDeepSpeedConfig.is_zero3")
    _saved.clear()


def is_patched() -> bool:
    return bool(_saved)
