"""DeepSpeed integration: `initialize`, `patch_deepspeed`, the engine adapter, the config bridge."""

from offloadpp.integrations.deepspeed.config import OffloadppBlock, OffloadppConfigError, parse_block
from offloadpp.integrations.deepspeed.initialize import initialize
from offloadpp.integrations.deepspeed.patch import is_patched, patch_deepspeed, unpatch_deepspeed
from offloadpp.integrations.deepspeed.zero_init import Init

__all__ = [
    "Init",
    "OffloadppBlock",
    "OffloadppConfigError",
    "initialize",
    "is_patched",
    "parse_block",
    "patch_deepspeed",
    "unpatch_deepspeed",
]
