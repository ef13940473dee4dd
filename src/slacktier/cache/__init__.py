"""cache room: the device row cache (slots, per-layer directories sized to the slots, the one CLOCK, pins,
shares), the compiled pass of `begin_step`, and the replay of that policy over a lookup trace for
characterization."""

from slacktier.cache.compiled import CompiledPass, PassLayer
from slacktier.cache.directory import (ADMISSIONS, KIND_FOREIGN, KIND_MISS, KIND_SLOT, KIND_ZERO, NO_HEAT, NO_SEEN,
                                       LayerGeometry, PassResult, PassScratch, fill_foreign, token_heat)
from slacktier.cache.rowcache import CacheLayer, RowCache, split_slots

__all__ = ["CacheLayer", "RowCache", "split_slots", "LayerGeometry", "PassScratch", "PassResult", "fill_foreign",
           "CompiledPass", "PassLayer", "KIND_SLOT", "KIND_MISS", "KIND_ZERO", "KIND_FOREIGN", "NO_SEEN",
           "NO_HEAT", "ADMISSIONS", "token_heat"]
