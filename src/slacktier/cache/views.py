"""The directory pass's arguments as a few typed structs, and the compiled pass's packed form of them.

`directory.resolve_layer(ids, geo, cache, step, out)` reads and writes four structs, each a NamedTuple of
arrays and integers (numba passes one as its fields, so a struct costs what its loose arguments cost):

- `GeoView`: the layer's rows and their split over rank regions (a `LayerGeometry`, as arrays);
- `CacheView`: the cache's slot arrays and the layer's own directory, owned slots and CLOCK state;
- `StepView`: this pass's step: its pin stamp, the step hash table and the pass's stamp in it, where its page
  buffers start, and the pass's settings (owned_only, lossy, pad id);
- `OutView`: what the pass writes: a `PassScratch`'s arrays and its counts (`directory.Count`).

The compiled pass (`cache.compiled.run_layers`) receives one int64 array per step, not these structs: unboxing
a struct from Python costs what its arrays cost, about 33 per layer. That array is a `PASS_HEADER` record naming
a `PASS_LAYER` record per layer by address; arrays appear in them as an address and, where the compiled code
needs it, a length. These two dtypes are the one statement of that layout: `PassPlan` fills them from Python
objects, `header`, `layer_records`, `geo_view`, `cache_view`, `step_view` and `out_view` rebuild the structs
inside compiled code, and Python's per-step writes find a field's word by name (`HEADER_WORD`, `LAYER_WORD`).

Worked example: a pass over layers (1, 14) -> a header (layers = 2, records = the address of a [2] PASS_LAYER
array); run_layers reads record 1's `directory` and `dir_len` and sees layer 14's directory as an int64 array.
"""

from __future__ import annotations

from enum import IntEnum
from typing import NamedTuple

import numpy as np
from numba import carray, from_dtype, njit, types
from numba.extending import intrinsic

from slacktier.cache.directory import (N_COUNTS, NO_INDEX_KEYS, NO_INDEX_ORDINALS, NO_PACKED, NO_SEEN, LayerGeometry,
                                       PassScratch)
from slacktier.cache.kernels import LSTATE_WORDS, NO_SKETCH
from slacktier.errors import ErrorKind, SlackTierError


class GeoView(NamedTuple):
    """A layer's rows as the pass reads them (LayerGeometry's fields)."""

    row_start: int              # first global row id of the layer
    rows: int                   # local rows this process serves
    rank_starts: np.ndarray     # [R + 1] int64 local-row bounds of each rank's shard
    rank_region: np.ndarray     # [R] int32 source region of each rank's shard
    seen: np.ndarray            # lossy: [ceil(rows / 8)] uint8 bitmap over local rows (NO_SEEN otherwise)
    table_end: int              # the whole layer's ids are [0, table_end); 0: not known
    pk_keys: np.ndarray         # context packing (directory.PackedGeometry): [H] int64 index keys, [0] none
    pk_ordinals: np.ndarray     # [H] int32 their context ordinals
    pk_bits: int                # log2 H
    pk_region: np.ndarray       # [R] int32 each rank's packed region (source index), -1 none
    pk_slot: np.ndarray         # [C] int32 each column's place in its owner's packed pages
    pk_ppc: int                 # pages per packed context


class CacheView(NamedTuple):
    """The cache arrays one layer's pass reads and updates (cache.rowcache: the slots, and the layer's own)."""

    key: int                    # the layer's key in slot_layer
    directory: np.ndarray       # [E] int64 the layer's row -> slot table (cache.rowdir)
    owned: np.ndarray           # [S_l] int32 the layer's slots, in CLOCK order
    lstate: np.ndarray          # [4] int64 the layer's CLOCK state (kernels.HAND, PINNED, EVICTIONS, spare)
    slot_layer: np.ndarray      # [S] int32 per slot of the cache: its layer's key, -1 empty
    slot_row: np.ndarray        # [S] int64 its local row
    state: np.ndarray           # [S] int64 its pin stamp and fill mark (cache.kernels)
    ref: np.ndarray             # [S] uint8 its CLOCK reference bit
    fill_miss: np.ndarray       # [S] int32 the miss index filling it this step
    sketch: np.ndarray          # the layer's frequency sketch, uint8 (kernels.new_sketch; NO_SKETCH: none)


class StepView(NamedTuple):
    """The step one layer's pass belongs to, and the pass's settings."""

    step: int                   # the cache's step: pins are this stamp
    htab: np.ndarray            # [H, 3] int64 the step hash table (directory.StepTable)
    stamp: int                  # this pass's stamp in htab
    hbits: int                  # log2 of the htab entries this pass uses
    buf_base: int               # the first page buffer this pass's pages take
    owned_only: bool            # ids outside the layer's rows are another rank's (foreign), not an error
    lossy: bool                 # rows outside geo.seen are zero rows, not read
    pad_id: int                 # negative: ids equal to it are padding (zero rows); 0: no padding


class OutView(NamedTuple):
    """What one layer's pass writes: PassScratch's arrays, all of one length, and the counts."""

    desc_kind: np.ndarray       # [N] int8 KIND_*
    desc_idx: np.ndarray        # [N] int64 slot or miss index
    miss_buf: np.ndarray        # [N] int32 page buffer of a missed row
    miss_inpage: np.ndarray     # [N] int32 its row within that page
    miss_slot: np.ndarray       # [N] int32 slot to fill, -1 none
    miss_row: np.ndarray        # [N] int64 its local row
    page_region: np.ndarray     # [N] int32 pages to read: region,
    page_no: np.ndarray         # [N] int64 page,
    page_buf: np.ndarray        # [N] int32 and buffer
    own_pos: np.ndarray         # [N] int32 the pass's list of in-table lookups: positions,
    own_row: np.ndarray         # [N] int64 and local rows
    counts: np.ndarray          # [N_COUNTS] int64 (directory.Count)


# ---- the packed form -----------------------------------------------------------------------------------------

_I8 = np.int64

#: The compiled pass's header: what every layer's pass shares, and the call's in/out words.
PASS_HEADER = np.dtype([
    ("layers", _I8),        # layers in window order (records)
    ("records", _I8),       # address of the [layers] PASS_LAYER records
    ("start", _I8),         # in: the first layer this call resolves
    ("stop", _I8),          # out: the layer it stopped at (its pass done), or layers when it ran them all
    ("why", _I8),           # out: compiled.WHY_* for a stop before the end
    ("buf_base", _I8),      # in/out: the first page buffer the next layer's pages take
    ("slots", _I8),         # the cache's slot arrays: their length, then addresses
    ("slot_layer", _I8),
    ("slot_row", _I8),
    ("state", _I8),
    ("ref", _I8),
    ("fill_miss", _I8),
    ("step", _I8),          # per step: the cache's step
    ("htab", _I8),          # the step hash table [hrows, 3] int64
    ("hrows", _I8),
    ("stamp", _I8),         # per step: layer i's pass uses stamp + i
    ("hbits", _I8),         # per step
    ("owned_only", _I8),
    ("lossy", _I8),
    ("pad_id", _I8),
    ("pool_addr", _I8),     # the page pool's first buffer and buffer count (the engine's PageBufferPool)
    ("pool_buffers", _I8),
    ("clock_fn", _I8),      # address of clock_gettime
    ("ts", _I8),            # address of two words: clock_gettime's timespec
    ("out", _I8),           # address of the results [layers, ROW_WORDS] int64
    ("errors", _I8),        # address of [layers] int64: each layer's submit error word
    ("heat_lut", _I8),      # address of [2] uint8: an admission rule's (prefill, decode) heat codes; 0: none
    ("heat_buf", _I8),      # address of the [tokens] uint8 heat codes the pass makes from decode flags
])

#: One layer's record: where its lookups sit in the step's ids, its geometry, cache arrays, scratch and submit.
PASS_LAYER = np.dtype([
    ("axis", _I8),          # its index in the ids' layer axis
    ("row_start", _I8),
    ("rows", _I8),
    ("table_end", _I8),     # LayerGeometry.table_end
    ("pk_keys", _I8),       # context packing (LayerGeometry.packed): index keys' address and entries (0: none),
    ("pk_len", _I8),
    ("pk_ordinals", _I8),   # the ordinals' address,
    ("pk_bits", _I8),       # log2 of the entries,
    ("pk_region", _I8),     # each rank's packed region (ranks entries),
    ("pk_slot", _I8),       # each column's slot (pk_cols entries),
    ("pk_cols", _I8),
    ("pk_ppc", _I8),        # pages per context
    ("rank_starts", _I8),   # address; ranks + 1 entries
    ("ranks", _I8),
    ("rank_region", _I8),
    ("seen", _I8),          # address and bytes of the seen bitmap (NO_SEEN when not lossy)
    ("seen_len", _I8),
    ("key", _I8),
    ("directory", _I8),
    ("dir_len", _I8),       # the directory's entries (cache.rowdir)
    ("owned", _I8),
    ("owned_len", _I8),
    ("lstate", _I8),        # address; kernels.LSTATE_WORDS entries
    ("sketch", _I8),        # the layer's frequency sketch: address and counters (kernels.NO_SKETCH: none)
    ("sketch_len", _I8),
    ("capacity", _I8),      # the scratch arrays' length
    ("desc_kind", _I8),
    ("desc_idx", _I8),
    ("miss_buf", _I8),
    ("miss_inpage", _I8),
    ("miss_slot", _I8),
    ("miss_row", _I8),
    ("page_region", _I8),
    ("page_no", _I8),
    ("page_buf", _I8),
    ("own_pos", _I8),
    ("own_row", _I8),
    ("engine", _I8),        # per step: the C engine handle its pages go to, 0 = Python submits them
    ("submit_fn", _I8),     # address of the submit its pages go to, st_eng_submit's signature (0: Python submits)
])


class Row(IntEnum):
    """A layer's row of the compiled pass's results (CompiledPass.out): its counts (directory.Count, in order,
    PassResult's fields), then these; Python reads all layers' rows with one tolist()."""

    JOB = N_COUNTS          # its pages' C job, 0 none
    T0 = N_COUNTS + 1       # CLOCK_MONOTONIC ns (perf_counter_ns's clock) before the pass, after it, after submitting
    T1 = N_COUNTS + 2
    T2 = N_COUNTS + 3


ROW_WORDS = N_COUNTS + len(Row)

#: int64 word of each field within its record, for Python's per-step reads and writes through a memoryview
#: (numpy's structured scalar access costs microseconds on this path)
HEADER_WORD = {name: PASS_HEADER.fields[name][1] // 8 for name in PASS_HEADER.names}
LAYER_WORD = {name: PASS_LAYER.fields[name][1] // 8 for name in PASS_LAYER.names}
LAYER_WORDS = PASS_LAYER.itemsize // 8


class PassPlan:
    """The packed header and layer records of a compiled pass, and every array they name, kept alive here."""

    def __init__(self, n_layers: int) -> None:
        self.words = np.zeros(PASS_HEADER.itemsize // 8, dtype=np.int64)   # what run_layers takes
        self.header = self.words.view(PASS_HEADER)[0]
        self.layer_words = np.zeros(max(n_layers, 1) * LAYER_WORDS, dtype=np.int64)
        self.records = self.layer_words.view(PASS_LAYER)[:n_layers]
        self._keep: list[np.ndarray] = []
        self.header["layers"] = n_layers
        self.header["records"] = _address(self.layer_words)

    def put(self, record: np.void, name: str, a: np.ndarray, length: str | None = None) -> None:
        """Name array `a` (C-contiguous) in `record`'s field `name`, its length in field `length`."""
        if not a.flags.c_contiguous:
            raise ValueError("the compiled pass names C-contiguous arrays only")
        self._keep.append(a)
        record[name] = _address(a)
        if length is not None:
            record[length] = a.shape[0]

    def put_layer(self, i: int, axis: int, geo: LayerGeometry, key: int, directory: np.ndarray, owned: np.ndarray,
                  lstate: np.ndarray, scratch: PassScratch, sketch: np.ndarray = NO_SKETCH) -> None:
        """Fill layer i's record: its axis, geometry, the layer's cache arrays, and its scratch."""
        rec = self.records[i]
        rec["axis"] = axis
        rec["row_start"] = geo.row_start
        rec["rows"] = geo.rows
        rec["table_end"] = geo.table_end
        self.put(rec, "rank_starts", geo.rank_starts)
        self.put(rec, "rank_region", geo.rank_region, "ranks")
        self.put(rec, "seen", geo.seen if geo.seen is not None else NO_SEEN, "seen_len")
        pk = geo.packed
        self.put(rec, "pk_keys", pk.keys if pk is not None else NO_INDEX_KEYS, "pk_len")
        self.put(rec, "pk_ordinals", pk.ordinals if pk is not None else NO_INDEX_ORDINALS)
        rec["pk_bits"] = pk.bits if pk is not None else 0
        self.put(rec, "pk_region", pk.region if pk is not None else np.full(geo.rank_region.shape[0], -1, np.int32))
        self.put(rec, "pk_slot", pk.slots if pk is not None else NO_PACKED, "pk_cols")
        rec["pk_ppc"] = pk.pages_per_context if pk is not None else 1
        rec["key"] = key
        self.put(rec, "directory", directory, "dir_len")
        self.put(rec, "owned", owned, "owned_len")
        if lstate.shape[0] != LSTATE_WORDS:
            raise ValueError(f"a layer state has {LSTATE_WORDS} words (kernels.empty_lstate)")
        self.put(rec, "lstate", lstate)
        self.put(rec, "sketch", sketch, "sketch_len")
        self.put(rec, "desc_kind", scratch.desc_kind, "capacity")
        for name in OutView._fields[1:-1]:
            arr = getattr(scratch, name)
            same_length(arr, scratch.desc_kind, "a pass scratch's arrays")
            self.put(rec, name, arr)


def same_length(a: np.ndarray, like: np.ndarray, what: str) -> None:
    """Refuse arrays the compiled code would index with one length (it has no bounds checks)."""
    if a.shape[0] != like.shape[0]:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"{what} differ in length ({a.shape[0]} vs {like.shape[0]})",
                             fix="rebuild the cache and its scratch together")


def _address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


# ---- unpacking, inside compiled code ------------------------------------------------------------------------

def _pointer_from(nbtype):
    @intrinsic
    def as_pointer(typingctx, addr):
        """A typed pointer from an int64 address (what `numba.carray` takes)."""
        sig = types.CPointer(nbtype)(types.int64)

        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], context.get_value_type(signature.return_type))

        return sig, codegen

    return as_pointer


p_i8 = _pointer_from(types.int8)
p_u8 = _pointer_from(types.uint8)
p_i32 = _pointer_from(types.int32)
p_i64 = _pointer_from(types.int64)
_p_header = _pointer_from(from_dtype(PASS_HEADER))
_p_layer = _pointer_from(from_dtype(PASS_LAYER))


@njit(nogil=True, cache=True, inline="always")
def header(words):
    """The PASS_HEADER record at `words` (PassPlan.words), read and written in place."""
    return carray(_p_header(words.ctypes.data), 1)[0]


@njit(nogil=True, cache=True, inline="always")
def layer_records(h):
    """The header's [layers] PASS_LAYER records, read and written in place."""
    return carray(_p_layer(h.records), h.layers)


@njit(nogil=True, cache=True, inline="always")
def slot_arrays(h):
    """The cache's slot arrays the header names: (slot_layer, slot_row, state, ref, fill_miss)."""
    n = h.slots
    return (carray(p_i32(h.slot_layer), n), carray(p_i64(h.slot_row), n), carray(p_i64(h.state), n),
            carray(p_u8(h.ref), n), carray(p_i32(h.fill_miss), n))


@njit(nogil=True, cache=True, inline="always")
def geo_view(rec):
    """Layer record `rec`'s GeoView."""
    return GeoView(rec.row_start, rec.rows, carray(p_i64(rec.rank_starts), rec.ranks + 1),
                   carray(p_i32(rec.rank_region), rec.ranks), carray(p_u8(rec.seen), rec.seen_len), rec.table_end,
                   carray(p_i64(rec.pk_keys), rec.pk_len), carray(p_i32(rec.pk_ordinals), rec.pk_len), rec.pk_bits,
                   carray(p_i32(rec.pk_region), rec.ranks), carray(p_i32(rec.pk_slot), rec.pk_cols), rec.pk_ppc)


@njit(nogil=True, cache=True, inline="always")
def cache_view(rec, slots):
    """Layer record `rec`'s CacheView, over the cache's `slot_arrays`."""
    slot_layer, slot_row, state, ref, fill_miss = slots
    return CacheView(rec.key, carray(p_i64(rec.directory), rec.dir_len), carray(p_i32(rec.owned), rec.owned_len),
                     carray(p_i64(rec.lstate), LSTATE_WORDS), slot_layer, slot_row, state, ref, fill_miss,
                     carray(p_u8(rec.sketch), rec.sketch_len))


@njit(nogil=True, cache=True, inline="always")
def step_view(h, htab, li, buf_base):
    """The StepView of layer li's pass: the header's step, htab, stamp + li, and settings."""
    return StepView(h.step, htab, h.stamp + li, h.hbits, buf_base, h.owned_only != 0, h.lossy != 0, h.pad_id)


@njit(nogil=True, cache=True, inline="always")
def out_view(rec, counts):
    """Layer record `rec`'s OutView, its counts in `counts`."""
    cap = rec.capacity
    return OutView(carray(p_i8(rec.desc_kind), cap), carray(p_i64(rec.desc_idx), cap),
                   carray(p_i32(rec.miss_buf), cap), carray(p_i32(rec.miss_inpage), cap),
                   carray(p_i32(rec.miss_slot), cap), carray(p_i64(rec.miss_row), cap),
                   carray(p_i32(rec.page_region), cap), carray(p_i64(rec.page_no), cap),
                   carray(p_i32(rec.page_buf), cap), carray(p_i32(rec.own_pos), cap),
                   carray(p_i64(rec.own_row), cap), counts)
