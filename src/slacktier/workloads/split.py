"""Fit/holdout splits by source: statistics are fitted on some repositories or conversations, evaluated on others."""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Generic, Sequence, TypeVar

from slacktier.errors import ErrorKind, SlackTierError

S = TypeVar("S")


@dataclass(frozen=True)
class Split(Generic[S]):
    """Sessions to fit statistics on and sessions to evaluate on; no source is on both sides."""

    fit: tuple[S, ...]
    holdout: tuple[S, ...]
    fit_sources: frozenset[str]
    holdout_sources: frozenset[str]

    def __post_init__(self) -> None:
        shared = self.fit_sources & self.holdout_sources
        if shared:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"fit and holdout share sources: {sorted(shared)[:5]}",
                                 fix="split by source with split_by_source")


def split_by_source(sessions: Sequence[S], holdout_sources: int | None = None, holdout_share: float = 0.5,
                    seed: int = 0) -> Split[S]:
    """Put whole sources on one side: sources are ordered by crc32(seed:source), the first ones are the holdout.

    `holdout_sources` (a count) wins over `holdout_share`. Every session needs a
    `source` attribute.
    """
    sources = sorted({s.source for s in sessions}, key=lambda src: (zlib.crc32(f"{seed}:{src}".encode()), src))
    if len(sources) < 2:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"need at least 2 sources to split, got {len(sources)}",
                             fix="draw sessions from more repositories or conversations")
    n_hold = holdout_sources if holdout_sources is not None else round(len(sources) * holdout_share)
    n_hold = min(max(int(n_hold), 1), len(sources) - 1)
    hold = frozenset(sources[:n_hold])
    fit = frozenset(sources[n_hold:])
    return Split(tuple(s for s in sessions if s.source in fit), tuple(s for s in sessions if s.source in hold),
                 fit, hold)
