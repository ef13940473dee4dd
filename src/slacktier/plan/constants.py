"""Hardware and layout constants the planner uses, in one place, each with its unit and source.

plan/ is a room of pure functions that imports only config, so the page layout
(slacktier.tables.layout) is restated here; tests/test_plan_planner.py checks
that the two agree.
"""

from __future__ import annotations

# ---- page layout (DESIGN section 2; slacktier.tables.layout) ----------------------------------------------
PAGE_BYTES = 4096                  # bytes per page on every tier
ROWS_PER_PAGE = 15                 # rows of 264 B per page
DIRECTORY_BYTES_PER_ROW = 0        # per table row (paper: int32 row -> slot, 4 B; ours follows the cache)

# ---- the paper's NVMe read-time model (paper section 4.1) --------------------------------------------------
# One NVMe disk shared by four TP ranks, least squares over the paper's end-to-end runs (R^2 = 0.997):
#   T_1 = 0.30 ms + 3.05 us * P_1 + 0.37 us * P_14.
# Layer 1 is submitted first, so layer 14's pages are queued behind it: the 0.37 us is the per-page cost of
# pages queued *behind* a layer (contention only). The paper does not fit T_14; it states that T_14 includes
# the time layer 14 waits behind layer 1 on the shared disk, i.e. a page queued *ahead* costs a page's read
# time (the 3.05 us). Quoted for reference and for tests; measure your own disk (`slacktier probe --read-fit`).
PAPER_NVME_INTERCEPT_MS = 0.30          # ms, a
PAPER_NVME_PAGE_MS = 3.05e-3            # ms per page of the layer itself, b
PAPER_NVME_AHEAD_PAGE_MS = 3.05e-3      # ms per page queued ahead (the paper's "waits behind layer 1"), c
PAPER_NVME_BEHIND_PAGE_MS = 0.37e-3     # ms per page queued behind (the paper's fitted 0.37 us)

# ---- the paper's devices as the what-if emulates them (slacktier.whatif.models) ----------------------------
PAPER_NVME_RANKS = 4                    # TP ranks that shared the one NVMe when the read-time model was fitted
PAPER_NVME_QUEUE_DEPTH = 128            # reads in flight the emulated NVMe records (the terms hold at it)
# RDMA reads (paper section 6.8): 600-740 pages per rank and layer land in 0.21-0.25 ms, one 400 Gb/s NIC per
# rank, 4 threads x 2 queue pairs. No contention term is stated (layer 14's reads are "fully hidden").
PAPER_RDMA_PAGES = (600, 740)           # pages per rank and layer, the two ends of the paper's range
PAPER_RDMA_MS = (0.21, 0.25)            # ms for those pages
PAPER_RDMA_QUEUE_DEPTH = 8              # reads in flight per rank: 4 threads x 2 queue pairs
