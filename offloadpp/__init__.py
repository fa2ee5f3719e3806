"""offloadpp: fine-tune models larger than GPU and CPU memory by streaming training state through SSDs.

Layers (see DESIGN.md): csrc -> offloadpp.io / offloadpp.optim -> offloadpp.planner (pure)
-> offloadpp.runtime -> offloadpp.integrations.deepspeed. Imports here stay light: torch is
imported by the submodules that need it, not by `import offloadpp`.
"""

__version__ = "0.1.0"


def initialize(*args, **kwargs):
    """`deepspeed.initialize`'s signature; offloadpp's engine when the config enables it (see
    offloadpp.integrations.deepspeed.initialize)."""
    from offloadpp.integrations.deepspeed import initialize as _initialize

    return _initialize(*args, **kwargs)
