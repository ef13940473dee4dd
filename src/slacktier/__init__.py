"""SlackTier: serve token-indexed LLM lookup tables by each layer's prefetch deadline."""

from slacktier.errors import SlackTierError

__all__ = ["SlackTierError"]
__version__ = "0.1.0"
