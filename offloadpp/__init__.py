"""offloadpp: fine-tune models larger than GPU and CPU memory by streaming training state through SSDs.

Layers (see DESIGN.md): csrc -> offloadpp.io / offloadpp.optim -> offloadpp.planner (pure)
-> offloadpp.runtime -> offloadpp.integrations.deepspeed. Imports here stay light: torch is
imported by the submodules that need it, not by `import offloadpp`.
"""

__version__ = "0.1.0"


def Init(*args, **kwargs):  # noqa: N802 - named as deepspeed.zero.Init, whose role it plays
    """A context manager under which a model is built without its weights in memory; offloadpp's
    initialize fills them unit by unit (offloadpp.integrations.deepspeed.zero_init)."""
    from offloadpp.integrations.deepspeed.zero_init import Init as _Init

    return _Init(*args, **kwargs)


def initialize(*args, **kwargs):
    """`deepspeed.initialize`'s signature; offloadpp's engine when the config enables it (see
    offloadpp.integrations.deepspeed.initialize)."""
    from offloadpp.integrations.deepspeed import initialize as _initialize

    return _initialize(*args, **kwargs)


def patch_deepspeed() -> None:
    """Afterwards `deepspeed.initialize`, from any caller (Hugging Face Trainer and Accelerate
    included), returns offloadpp's engine for a config whose `offloadpp` block is enabled and
    DeepSpeed's otherwise (see offloadpp.integrations.deepspeed.patch)."""
    from offloadpp.integrations.deepspeed import patch_deepspeed as _patch

    _patch()


def unpatch_deepspeed() -> None:
    """Undoes patch_deepspeed()."""
    from offloadpp.integrations.deepspeed import unpatch_deepspeed as _unpatch

    _unpatch()


def __getattr__(name: str):
    # get_fp32_state_dict_from_checkpoint (zero_to_fp32's counterpart) is the function itself,
    # imported on first use (torch stays out of `import offloadpp`)
    if name == "get_fp32_state_dict_from_checkpoint":
        from offloadpp.runtime.checkpoint_weights import get_fp32_state_dict_from_checkpoint

        return get_fp32_state_dict_from_checkpoint
    raise AttributeError(f"module 'offloadpp' has no attribute {name!r}")
