"""DeepSpeed integration: `initialize`, the engine adapter, the config bridge."""

from offloadpp.integrations.deepspeed.config import OffloadppBlock, OffloadppConfigError, parse_block
from offloadpp.integrations.deepspeed.initialize import initialize
from offloadpp.integrations.deepspeed.zero_init import Init

__all__ = ["Init", "OffloadppBlock", "OffloadppConfigError", "initialize", "parse_block"]
