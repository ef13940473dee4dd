"""Cache policies over a lookup sequence, compiled: each returns a hit mask.

All kernels take dense item ids ([M] int32, 0..U-1, from `densify`), so their
state is a few arrays of U entries instead of a map over 384M rows. Capacity is
in items (rows); capacity 0 never hits. A lookup that finds its row cached is a
hit even if the row was inserted earlier in the same step (the engine reuses a
read already issued this step).

- LRU: doubly linked list over items, insert at the head on a miss.
- CLOCK: the served policy itself, not a model of it: `cache.simulate.replay_clock`
  runs the cache's directory pass step by step (`capacity` slots, a reference bit
  set on insert and on a hit, the hand clearing bits until it finds a clear one,
  never evicting a slot pinned by the current step). Given one lookup per step
  (no step bounds) no pin ever blocks the hand, and it is textbook CLOCK
  (`ref_clock` in benchmarks/micro/policy_reference.py).
- S3-FIFO-style (Yang et al., SOSP'23): a small FIFO S (10% of capacity, at least
  one), a main FIFO M, a ghost of the last |M| items evicted from S, and a 2-bit
  frequency per cached item (+1 per hit, at most 3). A miss goes to M if it is
  in the ghost, else to S. Evicting from S moves the tail to M when it was hit
  while in S (freq >= 1, freq reset to 0), else drops it into the ghost; evicting
  from M reinserts the tail with freq - 1 while freq > 0. S evicts while it holds
  at least its share (or M is empty).
- Static: a fixed set, given as each lookup's rank in the fit ranking.
- Static head + LRU: the top `head` ranks are pinned, the rest of the capacity is
  an LRU over the other lookups.
- Belady (the limit for decode hits): prefill lookups cost nothing and may load
  any row, decode lookups count. Holding a row between two consecutive accesses
  is worth a hit only when the later access is a decode lookup, so the best
  cache picks the most such intervals with at most `capacity` overlapping; the
  greedy that admits each interval and, on overflow, drops the one ending
  farthest in the future is optimal (Belady's rule with bypass). Any policy's
  decode hits are such an interval set, so none that starts empty can beat it.
- Belady, warm (`belady_warm`): static sets start full, so their ceiling is
  Belady on the trace preceded by free prefill lookups of the `capacity`
  best-ranked fit rows; it bounds every policy here, static ones included.
"""

from __future__ import annotations

import numba
import numpy as np

from slacktier.cache.directory import ADMISSIONS
from slacktier.cache.simulate import REUSE_FILLED, replay_clock
from slacktier.errors import ErrorKind, SlackTierError

POLICIES = ("lru", "clock", "s3fifo", "static", "static_lru", "belady", "belady_warm")
#: the served CLOCK with one of the engine's admission rules ("clock+prefill-cold", "clock+counters"): named
#: policies of their own, not part of POLICIES ("all"); KNOWN_POLICIES is every name, in table order
ADMITTED = tuple(f"clock+{rule}" for rule in ADMISSIONS if rule != "off")
KNOWN_POLICIES = POLICIES[:2] + ADMITTED + POLICIES[2:]
S3FIFO_SMALL_SHARE = 0.1
S3FIFO_MAX_FREQ = 3


def densify(rows: np.ndarray) -> tuple[np.ndarray, int]:
    """Dense ids [M] int32 and the item count U: rows [7, 9, 7] -> ([0, 1, 0], 2)."""
    uniq, inv = np.unique(rows, return_inverse=True)
    return inv.astype(np.int32).reshape(-1), int(uniq.shape[0])


def _check(ids: np.ndarray, n_items: int, capacity: int) -> np.ndarray:
    if capacity < 0:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"capacity {capacity} < 0", fix="pass a capacity >= 0 rows")
    ids = np.ascontiguousarray(ids, dtype=np.int32)
    if ids.size and (ids.min() < 0 or ids.max() >= n_items):
        raise SlackTierError(ErrorKind.BAD_INPUT, "dense ids outside 0..n_items-1", fix="build ids with densify()")
    return ids


@numba.njit(nogil=True, cache=True)
def _lru_kernel(ids, n_items, capacity, hit):
    # ids: [M] int32; hit: [M] uint8 out. Node n_items is the list head (sentinel).
    head = n_items
    nxt = np.empty(n_items + 1, dtype=np.int32)
    prv = np.empty(n_items + 1, dtype=np.int32)
    inc = np.zeros(n_items, dtype=np.uint8)
    nxt[head] = head
    prv[head] = head
    size = 0
    for i in range(ids.shape[0]):
        x = ids[i]
        if capacity == 0:
            hit[i] = 0
            continue
        if inc[x]:
            hit[i] = 1
            # unlink
            nxt[prv[x]] = nxt[x]
            prv[nxt[x]] = prv[x]
        else:
            hit[i] = 0
            if size == capacity:
                t = prv[head]
                nxt[prv[t]] = head
                prv[head] = prv[t]
                inc[t] = 0
            else:
                size += 1
            inc[x] = 1
        # push front
        f = nxt[head]
        nxt[x] = f
        prv[x] = head
        prv[f] = x
        nxt[head] = x


@numba.njit(nogil=True, cache=True)
def _s3fifo_kernel(ids, n_items, capacity, small_cap, hit):
    main_cap = capacity - small_cap
    ghost_cap = max(main_cap, 1)
    where = np.zeros(n_items, dtype=np.uint8)      # 0 absent, 1 in S, 2 in M
    freq = np.zeros(n_items, dtype=np.uint8)
    ghost_at = np.full(n_items, -1, dtype=np.int64)  # ghost push number, -1 none
    qs = np.empty(max(capacity, 1), dtype=np.int32)   # S ring
    qm = np.empty(capacity + 2, dtype=np.int32)       # M ring
    s_head = 0
    s_size = 0
    m_head = 0
    m_size = 0
    ns = qs.shape[0]
    nm = qm.shape[0]
    gpush = 0
    for i in range(ids.shape[0]):
        x = ids[i]
        if capacity == 0:
            hit[i] = 0
            continue
        if where[x] != 0:
            hit[i] = 1
            if freq[x] < 3:
                freq[x] += 1
            continue
        hit[i] = 0
        if s_size + m_size >= capacity:
            # evict exactly one item from the cache
            done = False
            if s_size >= small_cap or m_size == 0:
                while s_size > 0:
                    t = qs[s_head]
                    s_head += 1
                    if s_head == ns:
                        s_head = 0
                    s_size -= 1
                    if freq[t] >= 1:
                        freq[t] = 0
                        where[t] = 2
                        qm[(m_head + m_size) % nm] = t
                        m_size += 1
                        if m_size > main_cap:
                            break  # M overflows: evict from M below
                    else:
                        where[t] = 0
                        ghost_at[t] = gpush
                        gpush += 1
                        done = True
                        break
            if not done:
                while True:
                    t = qm[m_head]
                    m_head += 1
                    if m_head == nm:
                        m_head = 0
                    m_size -= 1
                    if freq[t] > 0:
                        freq[t] -= 1
                        qm[(m_head + m_size) % nm] = t
                        m_size += 1
                    else:
                        where[t] = 0
                        break
        g = ghost_at[x]
        freq[x] = 0
        if g >= 0 and gpush - g <= ghost_cap:
            ghost_at[x] = -1
            where[x] = 2
            qm[(m_head + m_size) % nm] = x
            m_size += 1
        else:
            where[x] = 1
            qs[(s_head + s_size) % ns] = x
            s_size += 1


@numba.njit(nogil=True, cache=True)
def _next_use(ids, n_items):
    m = ids.shape[0]
    nxt = np.empty(m, dtype=np.int64)
    last = np.full(n_items, m, dtype=np.int64)
    for i in range(m - 1, -1, -1):
        x = ids[i]
        nxt[i] = last[x]
        last[x] = i
    return nxt


@numba.njit(nogil=True, cache=True)
def _heap_up(heap, key, pos, k):
    while k > 0:
        p = (k - 1) >> 1
        if key[heap[p]] >= key[heap[k]]:
            break
        a = heap[p]
        heap[p] = heap[k]
        heap[k] = a
        pos[heap[p]] = p
        pos[heap[k]] = k
        k = p


@numba.njit(nogil=True, cache=True)
def _heap_down(heap, key, pos, k, size):
    while True:
        l = 2 * k + 1
        if l >= size:
            break
        c = l
        if l + 1 < size and key[heap[l + 1]] > key[heap[l]]:
            c = l + 1
        if key[heap[k]] >= key[heap[c]]:
            break
        a = heap[c]
        heap[c] = heap[k]
        heap[k] = a
        pos[heap[c]] = c
        pos[heap[k]] = k
        k = c


@numba.njit(nogil=True, cache=True)
def _belady_kernel(ids, is_decode, n_items, capacity, hit):
    # max-heap of held items keyed by their next decode access
    m = ids.shape[0]
    nxt = _next_use(ids, n_items)
    key = np.zeros(n_items, dtype=np.int64)
    pos = np.full(n_items, -1, dtype=np.int64)
    heap = np.empty(capacity + 1, dtype=np.int32)
    size = 0
    for i in range(m):
        x = ids[i]
        k = pos[x]
        if k >= 0:
            hit[i] = is_decode[i]
            # remove x (its interval ends now)
            size -= 1
            if k != size:
                last = heap[size]
                heap[k] = last
                pos[last] = k
                _heap_down(heap, key, pos, k, size)
                _heap_up(heap, key, pos, pos[last])
            pos[x] = -1
        else:
            hit[i] = 0
        nu = nxt[i]
        if capacity == 0 or nu >= m or not is_decode[nu]:
            continue
        key[x] = nu
        heap[size] = x
        pos[x] = size
        size += 1
        _heap_up(heap, key, pos, size - 1)
        if size > capacity:
            top = heap[0]
            pos[top] = -1
            size -= 1
            if size > 0:
                heap[0] = heap[size]
                pos[heap[0]] = 0
                _heap_down(heap, key, pos, 0, size)


def lru(ids: np.ndarray, n_items: int, capacity: int) -> np.ndarray:
    """Hit mask [M] uint8 of an LRU cache of `capacity` items."""
    ids = _check(ids, n_items, capacity)
    hit = np.empty(ids.shape[0], dtype=np.uint8)
    _lru_kernel(ids, n_items, int(capacity), hit)
    return hit


def clock(ids: np.ndarray, n_items: int, capacity: int, step_starts: np.ndarray | None = None,
          evict_ahead: bool = True, heat: np.ndarray | None = None, sketch: bool = False) -> np.ndarray:
    """Hit mask [M] uint8 of the served cache (the engine's CLOCK with step pins, and by default its
    evict_ahead between steps) of `capacity` slots.

    step_starts: [S + 1] lookup index where each step begins (None: one lookup per step). A hit is a
    lookup whose row has a slot: cached when the step began, or filled by a read earlier in the step.
    heat: [M] uint8 heat codes of the served admission rule per lookup (`cache.token_heat(admission,
    ~is_decode)`; `cache.simulate`); None: plain CLOCK. sketch: the cache keeps its frequency sketch (the
    rules of `cache.directory.SKETCHED`).
    """
    ids = _check(ids, n_items, capacity)
    outcome = replay_clock(ids, step_starts, n_items, int(capacity), evict_ahead, heat, sketch)
    return (outcome <= REUSE_FILLED).astype(np.uint8)


def s3fifo_small_capacity(capacity: int) -> int:
    """Size of S3-FIFO's small queue: 10% of the capacity, at least 1 (0 for capacity 0)."""
    return 0 if capacity == 0 else max(1, int(capacity * S3FIFO_SMALL_SHARE))


def s3fifo(ids: np.ndarray, n_items: int, capacity: int) -> np.ndarray:
    """Hit mask [M] uint8 of an S3-FIFO-style cache of `capacity` items."""
    ids = _check(ids, n_items, capacity)
    hit = np.empty(ids.shape[0], dtype=np.uint8)
    _s3fifo_kernel(ids, n_items, int(capacity), s3fifo_small_capacity(int(capacity)), hit)
    return hit


def belady(ids: np.ndarray, is_decode: np.ndarray, n_items: int, capacity: int) -> np.ndarray:
    """Hit mask [M] uint8 of the best possible cache for decode hits (1 only on decode lookups)."""
    ids = _check(ids, n_items, capacity)
    dec = np.ascontiguousarray(is_decode, dtype=np.uint8)
    if dec.shape != ids.shape:
        raise SlackTierError(ErrorKind.BAD_INPUT, "is_decode must have one flag per lookup",
                             fix="pass LookupTrace.lookup_decode()")
    hit = np.empty(ids.shape[0], dtype=np.uint8)
    _belady_kernel(ids, dec, n_items, int(capacity), hit)
    return hit


def belady_warm(ids: np.ndarray, is_decode: np.ndarray, ranks: np.ndarray, n_items: int, capacity: int,
                ) -> np.ndarray:
    """Belady's hit mask after free prefill lookups of the `capacity` best-ranked rows (ranks [M] per lookup)."""
    ids = _check(ids, n_items, capacity)
    item_rank = np.full(n_items, np.iinfo(np.int64).max, dtype=np.int64)
    item_rank[ids] = ranks
    warm = np.flatnonzero(item_rank < capacity)
    warm = warm[np.argsort(item_rank[warm], kind="stable")].astype(np.int32)
    dec = np.concatenate([np.zeros(warm.shape[0], dtype=bool), np.asarray(is_decode, dtype=bool)])
    return belady(np.concatenate([warm, ids]), dec, n_items, capacity)[warm.shape[0]:]


def static(ranks: np.ndarray, capacity: int) -> np.ndarray:
    """Hit mask of a static set holding the `capacity` best-ranked rows (ranks [M] int64, unseen = int64 max)."""
    return (np.asarray(ranks) < capacity).astype(np.uint8)


def static_lru(ids: np.ndarray, ranks: np.ndarray, n_items: int, capacity: int, head: int) -> np.ndarray:
    """Hit mask of `head` pinned top-ranked rows in front of an LRU of capacity - head."""
    if not 0 <= head <= capacity:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"head {head} outside 0..{capacity}",
                             fix="pin at most the whole capacity")
    pinned = np.asarray(ranks) < head
    hit = pinned.astype(np.uint8)
    rest = ~pinned
    hit[rest] = lru(ids[rest], n_items, capacity - head)
    return hit


def rank_rows(fit_rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The fit ranking: (sorted unique rows, rank of each), rank 0 the most frequent (ties: lower row first)."""
    uniq, counts = np.unique(fit_rows, return_counts=True)
    order = np.lexsort((uniq, -counts))
    ranks = np.empty(uniq.shape[0], dtype=np.int64)
    ranks[order] = np.arange(uniq.shape[0], dtype=np.int64)
    return uniq, ranks


def ranks_of(rows: np.ndarray, ranking: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """Rank of each row in a fit ranking, int64 max for rows the fit never saw."""
    uniq, ranks = ranking
    if uniq.shape[0] == 0:
        return np.full(rows.shape, np.iinfo(np.int64).max, dtype=np.int64)
    idx = np.searchsorted(uniq, rows)
    idx_c = np.minimum(idx, uniq.shape[0] - 1)
    found = uniq[idx_c] == rows
    return np.where(found, ranks[idx_c], np.iinfo(np.int64).max)
