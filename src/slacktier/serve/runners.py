"""Model runners the serving loop drives: one step of many sessions, each with its own cache.

A runner turns a list of `StepItem`s (a session's new tokens and its cache)
plus the step's row ids into each session's logits at its last new token. It
issues every lookup of the step (`provider.begin_step`) before the forward
starts, then runs the model. Runners own no scheduling.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol

import numpy as np
import torch

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.models.rows import RowProvider

if TYPE_CHECKING:   # the models need transformers (the `models` extra): imported where a runner runs them
    from slacktier.models.deepseek_v41 import V41Model
    from slacktier.models.qwen38 import Q38Served


@dataclass
class StepItem:
    """One session's share of a step: new tokens [S] int64 and the session's own cache."""

    tokens: np.ndarray
    cache: object


class Runner(Protocol):
    """What the serving loop needs of a model."""

    def new_cache(self): ...

    def set_provider(self, provider: RowProvider) -> None: ...

    def run(self, items: list[StepItem], ids: np.ndarray,
            after_begin: Callable[[], None] | None = None) -> list[torch.Tensor]:
        """Per item, the logits [V] of its last new token; ids [sum S, L, C] are the step's row ids."""


class V41Runner:
    """The V4.1-shaped model; the step's Engram ids come with the step (hashed by tables.engram_hash)."""

    def __init__(self, model: V41Model) -> None:
        from slacktier.models.deepseek_v41 import StepSlot

        self.model = model
        self._slot = StepSlot

    def new_cache(self):
        """An empty per-session cache."""
        return self.model.new_cache()

    def set_provider(self, provider: RowProvider) -> None:
        """Switch where Engram rows come from."""
        self.model.provider = provider

    def run(self, items: list[StepItem], ids: np.ndarray, after_begin=None) -> list[torch.Tensor]:
        """Issue, run layer-major; per item the last token's logits [V]."""
        if ids.ndim != 3 or ids.shape[1:] != (len(self.model.config.engram_layer_ids), self.model.config.engram_columns):
            raise SlackTierError(ErrorKind.BAD_INPUT, f"step ids {ids.shape} do not match the model's Engram layers",
                                 fix="replay with a hasher built on the model's layout")
        slots = [self._slot(torch.from_numpy(np.ascontiguousarray(it.tokens, dtype=np.int64))[None], it.cache)
                 for it in items]
        return self.model.forward_step(slots, torch.from_numpy(np.ascontiguousarray(ids)), after_begin=after_begin)


class Q38Runner:
    """The Qwen3.8-shaped model. Its row ids are transformers' own hashing (Q38Served); the step's ids are unused."""

    def __init__(self, served: Q38Served) -> None:
        from slacktier.models.qwen38 import QwenSlot

        self.served = served
        self._slot = QwenSlot

    def new_cache(self):
        """An empty per-session cache."""
        return self.served.new_cache()

    def set_provider(self, provider: RowProvider) -> None:
        """Switch where n-gram rows come from."""
        self.served.provider = provider

    def run(self, items: list[StepItem], ids: np.ndarray | None = None, after_begin=None) -> list[torch.Tensor]:
        """Issue all PLE lookups, run each session; per item the last token's logits [V]."""
        slots = [self._slot(torch.from_numpy(np.ascontiguousarray(it.tokens, dtype=np.int64))[None], it.cache)
                 for it in items]
        return [logits[-1] for logits in self.served.forward_step(slots, after_begin=after_begin)]
