"""offloadpp.Init: build a model that never holds all its weights (deepspeed.zero.Init's role).

    with offloadpp.Init(config="ds_config.json"):
        model = GPT2LMHeadModel(config)                      # parameters: shape only, no memory
        # or: AutoModelForCausalLM.from_pretrained("path")   # nothing read yet
    engine, *_ = offloadpp.initialize(model=model, config="ds_config.json")

Inside the context, modules register their parameters on the meta device (buffers stay real:
a rotary embedding's frequencies are computed as usual). offloadpp.initialize then gives each unit its weights one unit at a time, straight into
the store: the module's own initialisation (Hugging Face's _init_weights, which deepspeed.zero.Init
skips: GPT-2's loss then starts near 330 instead of 11), or, for a model from from_pretrained,
the tensors of its safetensors files, read one by one. Memory stays near one unit throughout.

Note: why not accelerate's init_empty_weights. It wraps every parameter registered in a new
Parameter object, also one that is already on the meta device, which unties tied weights (a
language model's head and its embeddings become two parameters). Here a parameter already on
the meta device is registered as it is.

Note: from_pretrained. Inside the context `PreTrainedModel.from_pretrained(folder)` builds the
model empty from the folder's config and remembers the folder; the weights are read at
initialize, unit by unit. Only a local folder with safetensors weights can be streamed so.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from torch import nn

_register_parameter = nn.Module.register_parameter


def _register_empty_parameter(module: nn.Module, name: str, param) -> None:
    _register_parameter(module, name, param)
    p = module._parameters.get(name)
    if p is not None and not p.is_meta:  # a parameter already on meta (a tie) keeps its identity
        extra = dict(p.__dict__)
        new = type(p)(p.to("meta"), requires_grad=p.requires_grad)
        new.__dict__.update(extra)
        module._parameters[name] = new


class Init:
    """Context manager; see the module docstring. `config` (a DeepSpeed config dict or path) is
    checked here so a bad one fails before the model is built; `enabled=False` does nothing."""

    def __init__(self, config: Any = None, enabled: bool = True, **_deepspeed_kwargs):
        self.enabled = enabled
        if config is not None and enabled:
            from offloadpp.integrations.deepspeed.config import load_ds_config, offloadpp_enabled, parse_block

            ds = load_ds_config(config)
            if offloadpp_enabled(ds):
                parse_block(ds)
        self._from_pretrained = None

    def __enter__(self) -> Init:
        if not self.enabled:
            return self
        nn.Module.register_parameter = _register_empty_parameter
        try:
            import transformers

            self._from_pretrained = transformers.PreTrainedModel.__dict__["from_pretrained"]
            transformers.PreTrainedModel.from_pretrained = classmethod(_streaming_from_pretrained)
        except ImportError:
            self._from_pretrained = None
        return self

    def __exit__(self, *exc) -> None:
        if not self.enabled:
            return
        if self._from_pretrained is not None:
            import transformers

            transformers.PreTrainedModel.from_pretrained = self._from_pretrained
        nn.Module.register_parameter = _register_parameter


def _streaming_from_pretrained(cls, pretrained_model_name_or_path, *model_args, config: Optional[Any] = None,
                               **kwargs):  # fmt: skip
    from offloadpp.runtime.sources import SafetensorsSource

    folder = os.fspath(pretrained_model_name_or_path)
    if not os.path.isdir(folder):
        raise ValueError(
            f"offloadpp.Init: from_pretrained({folder!r}) streams the weights of a local model folder; download it "
            "first (huggingface-cli download ...) and pass its path"
        )
    if config is None:
        config = cls.config_class.from_pretrained(folder)
    source = SafetensorsSource(folder)  # fails now, naming the folder, if there is nothing to stream
    model = cls(config, *model_args)
    if hasattr(model, "tie_weights"):
        model.tie_weights()  # as from_pretrained does: a tied head is stored once, under the embeddings
    model._offloadpp_source = source
    model.eval()  # as from_pretrained returns it
    return model
