"""Slow, plain-Python cache simulators: the specification the compiled kernels are tested against.

Written for clarity over speed (OrderedDict, deque, sets, linear scans); each
returns a list of 0/1 hits, one per lookup, with the semantics documented in
slacktier.workloads.policies.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from typing import Sequence


def ref_lru(seq: Sequence[int], capacity: int) -> list[int]:
    """LRU: hit if cached; a miss inserts and evicts the least recently used."""
    cache: OrderedDict[int, None] = OrderedDict()
    out = []
    for x in seq:
        if capacity == 0:
            out.append(0)
            continue
        if x in cache:
            cache.move_to_end(x)
            out.append(1)
            continue
        out.append(0)
        if len(cache) == capacity:
            cache.popitem(last=False)
        cache[x] = None
    return out


def ref_clock(seq: Sequence[int], capacity: int) -> list[int]:
    """CLOCK: slots with reference bits set on insert and hit; the hand clears bits until a clear one."""
    slots: list[int] = []
    refbit: list[int] = []
    hand = 0
    out = []
    for x in seq:
        if capacity == 0:
            out.append(0)
            continue
        if x in slots:
            refbit[slots.index(x)] = 1
            out.append(1)
            continue
        out.append(0)
        if len(slots) < capacity:
            slots.append(x)
            refbit.append(1)
            continue
        while refbit[hand]:
            refbit[hand] = 0
            hand = (hand + 1) % capacity
        slots[hand] = x
        refbit[hand] = 1
        hand = (hand + 1) % capacity
    return out


def ref_s3fifo(seq: Sequence[int], capacity: int, small_capacity: int) -> list[int]:
    """S3-FIFO-style: small FIFO, main FIFO with reinsertion, ghost of recent small-queue evictions."""
    main_capacity = capacity - small_capacity
    ghost_capacity = max(main_capacity, 1)
    small: deque[int] = deque()
    main: deque[int] = deque()
    freq: dict[int, int] = {}
    ghost: list[int] = []  # evicted from S, oldest first; only the last ghost_capacity count
    out = []

    def in_ghost(x: int) -> bool:
        return x in ghost[-ghost_capacity:]

    def evict_main() -> None:
        while True:
            t = main.popleft()
            if freq[t] > 0:
                freq[t] -= 1
                main.append(t)
            else:
                del freq[t]
                return

    for x in seq:
        if capacity == 0:
            out.append(0)
            continue
        if x in freq:
            freq[x] = min(freq[x] + 1, 3)
            out.append(1)
            continue
        out.append(0)
        if len(small) + len(main) >= capacity:
            evicted = False
            if len(small) >= small_capacity or not main:
                while small:
                    t = small.popleft()
                    if freq[t] >= 1:
                        freq[t] = 0
                        main.append(t)
                        if len(main) > main_capacity:
                            break
                    else:
                        del freq[t]
                        ghost.append(t)
                        evicted = True
                        break
            if not evicted:
                evict_main()
        freq[x] = 0
        if in_ghost(x):
            # forget it: mark its ghost entries dead without shifting the window
            ghost[:] = [g if g != x else None for g in ghost]
            main.append(x)
        else:
            small.append(x)
    return out


def ref_belady(seq: Sequence[int], is_decode: Sequence[bool], capacity: int) -> list[int]:
    """Hold a row until its next access only if that access is a decode; over capacity drop the farthest."""
    n = len(seq)
    held: dict[int, int] = {}  # row -> position of its next (decode) access
    out = []
    for i, x in enumerate(seq):
        if x in held:
            del held[x]
            out.append(1 if is_decode[i] else 0)
        else:
            out.append(0)
        nxt = next((j for j in range(i + 1, n) if seq[j] == x), None)
        if capacity == 0 or nxt is None or not is_decode[nxt]:
            continue
        held[x] = nxt
        if len(held) > capacity:
            far = max(held, key=held.get)
            del held[far]
    return out


def brute_force_best_decode_hits(seq: Sequence[int], is_decode: Sequence[bool], capacity: int) -> int:
    """Most decode hits any cache of `capacity` rows can get (exhaustive search; tiny inputs only).

    After each access the cache may keep any subset of (its contents plus the
    row just accessed) of size <= capacity.
    """
    best: dict[frozenset, int] = {frozenset(): 0}
    for i, x in enumerate(seq):
        nxt: dict[frozenset, int] = {}
        for state, hits in best.items():
            h = hits + (1 if (x in state and is_decode[i]) else 0)
            pool = sorted(state | {x})
            for k in range(0, min(capacity, len(pool)) + 1):
                for keep in itertools.combinations(pool, k):
                    s = frozenset(keep)
                    if nxt.get(s, -1) < h:
                        nxt[s] = h
        best = nxt
    return max(best.values())
