"""cache room: the device row cache (slots, per-layer directories, CLOCK, pins, shares)."""

from slacktier.cache.rowcache import CacheLayer, RowCache, split_slots

__all__ = ["CacheLayer", "RowCache", "split_slots"]
