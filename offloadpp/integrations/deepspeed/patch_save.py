"""The Hugging Face stack's save calls on an offloadpp engine, for `patch_deepspeed()`.

Under DeepSpeed, Trainer.save_model asks Accelerate's get_state_dict for the whole model as one
dict (DeepSpeed's `_zero3_consolidated_16bit_state_dict`), then hands it to save_pretrained;
Accelerator.save_model does the same before writing. A model whose weights do not fit in memory
would be killed there. With the patch, on an offloadpp engine:

- Trainer.save_model writes the folder by streaming (engine.save_pretrained: the weights unit by
  unit, sharded with an index when large, config.json), then what the Trainer writes beside the
  weights (the tokenizer or processor, training_args.bin), as it does without DeepSpeed;
- Accelerator.save_model streams the weights with its max_shard_size and safe_serialization;
- Accelerator.get_state_dict returns the engine's consolidated dict when it fits and otherwise
  refuses naming the streaming calls (whatever the config's ZeRO stage: Accelerate would call
  the model's own state_dict for a stage other than 3, the same whole dict).

- Trainer._move_model_to_device leaves a module whose weights an offloadpp engine holds where it
  is. A Trainer built without a DeepSpeed config moves its model to `args.device`, which on the
  CPU is `cpu:0`, a device torch counts as different from the placeholders' `cpu`: `.to()` then
  copies every placeholder (a stride-0 view of one NaN) into a whole tensor, the model's full
  weights in memory (8.7 GiB at GPT-2 2.3B). The engine places the weights; nothing else may.

Every other model goes to the original methods.
"""

from __future__ import annotations

import os
from typing import Any, Callable


def _offloadpp_engine(model) -> Any:
    from offloadpp.integrations.deepspeed.engine import OffloadppEngine

    return model if isinstance(model, OffloadppEngine) else None


def _trainer_save_model(original: Callable) -> Callable:
    def save_model(self, output_dir=None, _internal_call: bool = False):
        engine = _offloadpp_engine(getattr(self, "model_wrapped", None))
        if engine is None:
            return original(self, output_dir, _internal_call)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        # every rank takes part (each holds its shard of the masters); rank 0 writes
        engine.save_pretrained(output_dir, safe_serialization=getattr(self.args, "save_safetensors", True))
        if self.args.should_save:
            from transformers.trainer import TRAINING_ARGS_NAME

            processor = getattr(self, "processing_class", None) or getattr(self, "tokenizer", None)
            if processor is not None:  # (`tokenizer` in transformers before 4.46)
                processor.save_pretrained(output_dir)
            elif getattr(getattr(self, "data_collator", None), "tokenizer", None) is not None:
                self.data_collator.tokenizer.save_pretrained(output_dir)
            import torch

            torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=getattr(self.args, "hub_revision", None))

    save_model.__offloadpp__ = True
    return save_model


def holds_placeholders(model) -> bool:
    """Whether some parameter of `model` is an engine's placeholder (runtime/device.py: a stride-0
    view of one value; no trained parameter has that shape of storage)."""
    return any(p.numel() > 1 and not any(p.stride()) for p in model.parameters())


def _trainer_move_model_to_device(original: Callable) -> Callable:
    def _move_model_to_device(self, model, device):
        if holds_placeholders(model):
            return None  # (see the module's note: the move would materialize every weight)
        return original(self, model, device)

    _move_model_to_device.__offloadpp__ = True
    return _move_model_to_device


def _accelerator_save_model(original: Callable) -> Callable:
    def save_model(self, model, save_directory, max_shard_size="10GB", safe_serialization: bool = True):
        engine = _offloadpp_engine(model)
        if engine is None:
            return original(self, model, save_directory, max_shard_size, safe_serialization)
        from accelerate.utils import convert_file_size_to_int

        name = "model.safetensors" if safe_serialization else "pytorch_model.bin"
        from offloadpp.integrations.deepspeed.export import save_weights

        save_weights(
            engine, str(save_directory), name, False, max_shard_bytes=convert_file_size_to_int(max_shard_size)
        )

    save_model.__offloadpp__ = True
    return save_model


def _accelerator_get_state_dict(original: Callable) -> Callable:
    def get_state_dict(self, model, unwrap: bool = True):
        engine = _offloadpp_engine(model)
        if engine is None:
            return original(self, model, unwrap)
        return engine._zero3_consolidated_16bit_state_dict()

    get_state_dict.__offloadpp__ = True
    return get_state_dict


def patch(saved: dict) -> None:
    """Replaces the four methods, keeping the originals in `saved` (patch.py's)."""
    try:
        import accelerate

        targets = [(accelerate.Accelerator, "save_model", _accelerator_save_model),
                   (accelerate.Accelerator, "get_state_dict", _accelerator_get_state_dict)]  # fmt: skip
    except ImportError:
        return
    try:
        import transformers

        targets.append((transformers.Trainer, "save_model", _trainer_save_model))
        targets.append((transformers.Trainer, "_move_model_to_device", _trainer_move_model_to_device))
    except ImportError:
        pass
    for cls, name, make in targets:
        original = cls.__dict__[name]
        saved[f"save:{cls.__name__}.{name}"] = (cls, name, original)
        setattr(cls, name, make(original))


def unpatch(saved: dict) -> None:
    for key in [k for k in saved if k.startswith("save:")]:
        cls, name, original = saved.pop(key)
        setattr(cls, name, original)
