"""Slow, plain-Python CLOCK with admission rules: the specification `slacktier.workloads.admission` is tested against.

Written for clarity over speed (a list of slots, a deque, a list-of-lists
sketch); one function per rule decides, and `ref_clock_admit` strings them
together in the order the module docstring gives. Returns a list of 0/1 hits.
"""

from __future__ import annotations

from collections import deque
from typing import Sequence

MASK64 = (1 << 64) - 1
MULTIPLIERS = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93)
COUNTER_MAX = 15


class CountMinSketch:
    """4 rows of 4-bit saturating counters, 2^bits per row; every counter halves after `reset_every` adds."""

    def __init__(self, bits: int, reset_every: int) -> None:
        self.bits = bits
        self.reset_every = reset_every
        self.rows = [[0] * (1 << bits) for _ in MULTIPLIERS]
        self.added = 0

    def _cells(self, x: int) -> list[int]:
        return [(((x + 1) * m) & MASK64) >> (64 - self.bits) for m in MULTIPLIERS]

    def add(self, x: int) -> None:
        for row, k in zip(self.rows, self._cells(x)):
            row[k] = min(row[k] + 1, COUNTER_MAX)
        self.added += 1
        if self.added == self.reset_every:
            self.rows = [[c // 2 for c in row] for row in self.rows]
            self.added = 0

    def estimate(self, x: int) -> int:
        return min(row[k] for row, k in zip(self.rows, self._cells(x)))


class Clock:
    """Textbook CLOCK over `n` slots, with a hook to refuse the victim's replacement."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.items: list[int] = []
        self.refbit: list[int] = []
        self.hand = 0

    def __contains__(self, x: int) -> bool:
        return x in self.items

    def touch(self, x: int) -> None:
        self.refbit[self.items.index(x)] = 1

    def insert(self, x: int, refbit: int, admit_over=None) -> None:
        """Put x in a free slot, or in the hand's victim's slot if `admit_over(victim)` (None: always)."""
        if len(self.items) < self.n:
            self.items.append(x)
            self.refbit.append(refbit)
            return
        while self.refbit[self.hand]:
            self.refbit[self.hand] = 0
            self.hand = (self.hand + 1) % self.n
        if admit_over is not None and not admit_over(self.items[self.hand]):
            return
        self.items[self.hand] = x
        self.refbit[self.hand] = refbit
        self.hand = (self.hand + 1) % self.n


def order_admits(order: int, decode: bool, prefill_max_order: int, decode_max_order: int) -> bool:
    """The n-gram order rule: a row of a higher order than its phase's bound is not cached."""
    return order <= (decode_max_order if decode else prefill_max_order)


def ref_clock_admit(seq: Sequence[int], is_decode: Sequence[bool], orders: Sequence[int], capacity: int,
                    prefill_max_order: int = 4, decode_max_order: int = 4, probation: int = 0,
                    prefill_cold: bool = False, sketch: str = "off", sketch_bits: int = 4,
                    sketch_reset_every: int = 1, allow: Sequence[bool] | None = None) -> list[int]:
    """CLOCK of capacity - probation slots, a probationary FIFO of `probation` slots, and the admission rules."""
    clock = Clock(capacity - probation)
    fifo: deque[int] = deque()
    hit_on_probation: set[int] = set()
    cms = CountMinSketch(sketch_bits, sketch_reset_every) if sketch != "off" else None
    allow = [True] * len(seq) if allow is None else allow
    out = []
    for x, dec, order, allowed in zip(seq, is_decode, orders, allow):
        if cms is not None:
            cms.add(x)
        if x in clock:
            clock.touch(x)
            out.append(1)
            continue
        if x in fifo:
            hit_on_probation.add(x)
            out.append(1)
            continue
        out.append(0)
        if capacity == 0 or not allowed or not order_admits(order, dec, prefill_max_order, decode_max_order):
            continue
        filtered = cms is not None and (sketch == "all" or not dec)
        if not dec and probation > 0:
            leaving = None
            if len(fifo) == probation:
                leaving = fifo.popleft()
            fifo.append(x)
            hit_on_probation.discard(x)
            if leaving is None or leaving not in hit_on_probation:
                continue
            hit_on_probation.discard(leaving)
            x, filtered = leaving, False   # promoted: it was read again while on probation
        refbit = 0 if (prefill_cold and not dec and probation == 0) else 1
        admit_over = (lambda victim, x=x: cms.estimate(x) > cms.estimate(victim)) if filtered else None
        clock.insert(x, refbit, admit_over)
    return out


def ref_oracle_allow(seq: Sequence[int], is_decode: Sequence[bool]) -> list[bool]:
    """Per lookup: the row is looked up again and that next lookup is a decode one."""
    out = []
    for i, x in enumerate(seq):
        nxt = next((j for j in range(i + 1, len(seq)) if seq[j] == x), None)
        out.append(nxt is not None and bool(is_decode[nxt]))
    return out
