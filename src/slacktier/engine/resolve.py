"""The directory pass of `begin_step`: one compiled loop per layer over its T x 24 lookups.

For each lookup (global row id g, local row r = g - row_start):
1. r in the directory, slot filled earlier this step -> reuse that read (miss m);
   r in the directory otherwise -> hit: record the slot, pin it;
2. r requested earlier this step without a slot (cache full of pins) -> reuse that read;
3. lossy mode and r not in the seen-set -> zero row, nothing read;
   (owned_only: r outside [0, rows), a row another rank's process serves -> foreign,
   nothing read, nothing cached; without owned_only such an id is an error);
4. miss: r's rank by shard bounds, its page; a page buffer for that page unless
   the page is already being read this step; a slot to fill (CLOCK, never a pinned
   slot; -1 when all the layer's slots are pinned: the row is served from its page
   buffer and not cached).

Descriptors out: kind [N] int8 (0 slot, 1 miss, 2 zero, 3 foreign) and idx [N] int64 (slot
or miss index). Misses out: buffer, row-in-page, slot to fill (or -1), local row.
Pages out: region, page, buffer: exactly the PageReads to submit.

Pages and slot-less rows of this step are found in one open-addressing hash
table whose entries are valid only when their stamp equals this call's stamp,
so nothing is cleared between calls.

Worked example: rows 31 and 32 of a one-rank table, cache empty -> one page
(page 2), two misses in buffer 0 at rows-in-page 1 and 2, two slots claimed.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from slacktier.cache.kernels import EVICTIONS, FILL, HAND, PINNED, REF
from slacktier.tables.layout import ROWS_PER_PAGE

KIND_SLOT = 0
KIND_MISS = 1
KIND_ZERO = 2
KIND_FOREIGN = 3   # owned_only: another rank's row; gather writes -0.0 (see step.StepEngine)

# counts[] fields written by resolve_layer
C_HITS = 0
C_MISSES = 1     # unique rows read (M)
C_PAGES = 2      # unique pages read (P)
C_ZERO = 3       # lossy: skipped
C_BYPASS = 4     # misses with no slot (served from the page buffer, not cached)
C_REUSE = 5      # lookups served by a read already requested this step
C_BAD = 6        # index of the first bad row id, -1 if none
C_SPARE = 7      # keeps the directory prefetch loop from being optimized away
C_FOREIGN = 8    # owned_only: lookups of rows outside this process's shard
N_COUNTS = 9

_PAGE_TAG = np.int64(1) << np.int64(62)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


@njit(nogil=True, cache=True, inline="always")
def _probe(key, htab, stamp, shift, mask):
    """Index of `key`'s entry in the hash table, or of the empty entry where it would go.

    htab: [H, 3] int64 rows (stamp, key, value), one entry per 24 B so a probe touches one line.
    """
    h = np.int64((np.uint64(key) * _GOLDEN) >> np.uint64(shift))
    while htab[h, 0] == stamp and htab[h, 1] != key:
        h = (h + 1) & mask
    return h


@njit(nogil=True, cache=True)
def resolve_layer(ids, row_start, rows, owned_only, rank_starts, rank_region, lossy, seen,
                  layer_key, directory, owned, lstate, slot_layer, slot_row, state, fill_miss, step,
                  htab, stamp, hbits,
                  desc_kind, desc_idx, miss_buf, miss_inpage, miss_slot, miss_row,
                  page_region, page_no, page_buf, buf_base, counts):
    """Resolve one layer's lookups `ids` [N] int64; returns 0, or 1 on a row id outside the table.

    owned_only: ids outside [row_start, row_start + rows) are foreign (kind 3), not an error.
    """
    shift = 64 - hbits
    mask = (np.int64(1) << hbits) - 1
    n_hits = 0
    n_miss = 0
    n_pages = 0
    n_zero = 0
    n_bypass = 0
    n_reuse = 0
    n_foreign = 0
    hand = lstate[HAND]
    pinned = lstate[PINNED]
    evictions = lstate[EVICTIONS]
    counts[C_BAD] = -1
    # Touch every lookup's directory entry first: these loads are independent, so the CPU
    # overlaps their cache misses (a V4.1 directory is 1.5 GB per layer, each lookup a random
    # DRAM access); the main loop below then finds them in cache.
    touch = np.int64(0)
    for i in range(ids.shape[0]):
        r = ids[i] - row_start
        if r >= 0 and r < rows:
            touch += directory[r]
    # Second wave: the state word of every hit's slot, also independent loads; count the misses.
    n_absent = 0
    for i in range(ids.shape[0]):
        r = ids[i] - row_start
        if r >= 0 and r < rows:
            s = directory[r]
            if s >= 0:
                touch += state[s]
            else:
                n_absent += 1
    # Third wave: the rows the CLOCK hand will evict next have directory entries at random places;
    # touch those of the next slots (twice the misses, as the hand skips pinned and referenced slots).
    n_owned = owned.shape[0]
    if n_absent > 0 and n_owned > 0:
        for k in range(min(2 * n_absent + 16, n_owned)):
            j = lstate[HAND] + k
            if j >= n_owned:
                j -= n_owned
            s = owned[j]
            if slot_layer[s] >= 0:
                touch += directory[slot_row[s]]
    counts[C_SPARE] = touch
    for i in range(ids.shape[0]):
        r = ids[i] - row_start
        if r < 0 or r >= rows:
            if owned_only:
                desc_kind[i] = KIND_FOREIGN
                desc_idx[i] = -1
                n_foreign += 1
                continue
            lstate[HAND] = hand
            lstate[PINNED] = pinned
            lstate[EVICTIONS] = evictions
            counts[C_BAD] = i
            counts[C_HITS] = n_hits
            counts[C_MISSES] = n_miss
            counts[C_PAGES] = n_pages
            return 1
        s = directory[r]
        if s >= 0:
            if state[s] == (step << 2) | REF | FILL:
                desc_kind[i] = KIND_MISS
                desc_idx[i] = fill_miss[s]
                n_reuse += 1
            else:
                # cache.kernels.pin_slot, inlined, with the layer's counters in locals: updating
                # lstate in memory on every lookup made this loop several times slower.
                v = state[s]
                if (v >> 2) != step:
                    state[s] = (step << 2) | REF
                    pinned += 1
                else:
                    state[s] = v | REF
                desc_kind[i] = KIND_SLOT
                desc_idx[i] = s
                n_hits += 1
            continue
        h = _probe(r, htab, stamp, shift, mask)
        if htab[h, 0] == stamp:
            desc_kind[i] = KIND_MISS
            desc_idx[i] = htab[h, 2]
            n_reuse += 1
            continue
        if lossy and (seen[r >> 3] >> (r & 7)) & 1 == 0:
            desc_kind[i] = KIND_ZERO
            desc_idx[i] = -1
            n_zero += 1
            continue
        k = 0
        while r >= rank_starts[k + 1]:
            k += 1
        shard_row = r - rank_starts[k]
        pg = shard_row // ROWS_PER_PAGE
        region = np.int64(rank_region[k])
        pkey = _PAGE_TAG | (region << np.int64(40)) | pg
        ph = _probe(pkey, htab, stamp, shift, mask)
        if htab[ph, 0] == stamp:
            b = htab[ph, 2]
        else:
            b = buf_base + n_pages
            htab[ph, 0] = stamp
            htab[ph, 1] = pkey
            htab[ph, 2] = b
            page_region[n_pages] = region
            page_no[n_pages] = pg
            page_buf[n_pages] = b
            n_pages += 1
        m = n_miss
        n_miss += 1
        miss_buf[m] = b
        miss_inpage[m] = shard_row - pg * ROWS_PER_PAGE
        miss_row[m] = r
        # cache.kernels.claim_slot (CLOCK, never a pinned slot), inlined with locals as above.
        sl = -1
        if n_owned > 0 and pinned < n_owned:
            if hand >= n_owned:
                hand = 0
            for _ in range(2 * n_owned + 1):
                c = owned[hand]
                hand += 1
                if hand == n_owned:
                    hand = 0
                v = state[c]
                if (v >> 2) == step:
                    continue
                if v & REF:
                    state[c] = v & ~np.int64(REF)
                    continue
                sl = c
                break
        miss_slot[m] = sl
        if sl >= 0:
            if slot_layer[sl] >= 0:
                directory[slot_row[sl]] = -1
                evictions += 1
            slot_layer[sl] = layer_key
            slot_row[sl] = r
            directory[r] = sl
            state[sl] = (step << 2) | REF | FILL    # it was unpinned: a new pin
            pinned += 1
            fill_miss[sl] = m
        else:
            # The page probe may have moved the row's empty entry: probe again.
            h = _probe(r, htab, stamp, shift, mask)
            htab[h, 0] = stamp
            htab[h, 1] = r
            htab[h, 2] = m
            n_bypass += 1
        desc_kind[i] = KIND_MISS
        desc_idx[i] = m
    lstate[HAND] = hand
    lstate[PINNED] = pinned
    lstate[EVICTIONS] = evictions
    counts[C_HITS] = n_hits
    counts[C_MISSES] = n_miss
    counts[C_PAGES] = n_pages
    counts[C_ZERO] = n_zero
    counts[C_BYPASS] = n_bypass
    counts[C_REUSE] = n_reuse
    counts[C_FOREIGN] = n_foreign
    return 0


@njit(nogil=True, cache=True)
def fill_foreign(desc_kind, n, out):
    """Write -0.0 (bf16 bits 0x8000) into the output rows of foreign lookups; out: [n, 256] uint16."""
    for i in range(n):
        if desc_kind[i] == KIND_FOREIGN:
            for j in range(out.shape[1]):
                out[i, j] = 0x8000
