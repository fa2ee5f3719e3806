"""DeepSpeed integration: `initialize`, the engine adapter, the config bridge."""

from offloadpp.integrations.deepspeed.config import OffloadppBlock, OffloadppConfigError, parse_block
from offloadpp.integrations.deepspeed.initialize import initialize

__all__ = ["OffloadppBlock", "OffloadppConfigError", "initialize", "parse_block"]
