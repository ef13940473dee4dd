"""Context packing: a token's owned rows of one table layer stored together, so a miss reads one page, not six.

A *context* is the C global row ids the hasher gives one token at a layer (C = 24 on V4.1: 8 heads of each of
the 2-, 3- and 4-gram orders). The ids determine every row the token reads at that layer, so keying by them is
exact. The traffic side chooses contexts worth packing and writes them, best first, to a *pack list*
(`.npz`, the writer is `slacktier.workloads.packing.write_pack_list`; `read_pack_list` here). Staging takes
them in file order, within its budgets, and writes per (layer, staged rank) one more region, the *packed
region*, on the target of that rank's row region: the same header page, stage id, manifest record and
per-page CRC32C as any region, so open-time identity checks and checked reads apply to it unchanged.

The pack list file (`.npz`, plain arrays): `layers` int64 [L], the table layer ids; per layer `ids_<layer>`
int64 [n, 24], one context per row, best first (most page reads saved on the fit half of the traffic first),
and `saved_<layer>` float64 [n], those savings (reports only); `meta`, a 0-d str array of JSON {"format":
"slacktier-pack-list", "version": 1, "workload", "split" (always "fit": the held-out half measures the
list), "seed", "batch", "cache_rows", "ranks", "partition", "tokens"}.

Packed page layout. Context p of a rank with `n_owned` owned columns takes `pages_per_context` =
ceil(n_owned / 15) pages from page p * pages_per_context of the rank's packed region; owned column j (the j-th
of the rank's columns, ascending) sits at page j // 15, row slot j % 15, at byte (j % 15) * 264: the row
geometry of every page, so the gather reads a packed row exactly as it reads any row. The 136 bytes after the
15 row slots, zero in a row page, hold the packed page's own header: bytes 3960..3963 `PACK_MAGIC`, 3964..3965
the rows in the page (uint16), 3966..3967 the page's index within its context, 3968 + 8 s the global id of
the row in slot s (int64, -1 past the rows), 4088..4091 the context's ordinal (uint32). The engine compares the
id of every row it takes from a packed page with the id it asked for (`check_packed_reads`): an index or a page
that disagrees is a fault, never a wrong row.

Worked example: V4.1, TP4 `columns`, rank 1 owns columns 6..11 -> one page per context; context 7's page is
page 7 of rank 1's packed region, column 9's row at slot 3, byte 792, its id at byte 3968 + 24. At TP1 all 24
columns are owned -> two pages per context (15 rows, then 9).

One context per page group, never two contexts sharing a page: a token needs the whole group it was packed
in, so sharing a page would only save disk (half at TP4), at the cost of page-level dedup across tokens of
different contexts, which packing does not rely on. The budget is in bytes, so either way it is what staging
spends.

The index. Per layer, `PackIndex`: an open-addressing table of `context_key` (a 64-bit mix of the C ids as the
layer's pass reads them: global ids, stored rows under a rank partition other than `columns`) -> the
context's ordinal, as two flat arrays (keys int64, 0 = empty; ordinals int32) the compiled directory pass
probes (`probe_index`). Every rank packs the same contexts in the same order (each owns the same number of
columns), so one index per layer serves every rank; each serving rank holds its own copy in host memory
(`PackIndex.nbytes`). Two contexts whose keys collide (one in 2**64 per pair) are refused at staging; a token
whose key matches a packed context it is not (the same odds) reads a page whose ids disagree: a fault.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from numba import njit

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.tables.layout import PAGE_BYTES, PAGE_USED_BYTES, ROW_BYTES, ROWS_PER_PAGE
from slacktier.tables.regions import StagedRegion

PACK_LIST_FORMAT = "slacktier-pack-list"
PACK_LIST_VERSION = 1
PACK_MAGIC = 0x4B505453            # b"STPK" little-endian, at byte PAGE_USED_BYTES of a packed page
IDS_AT = PAGE_USED_BYTES + 8       # 3968: the slot ids, int64 each
CTX_AT = IDS_AT + 8 * ROWS_PER_PAGE   # 4088: the context ordinal, uint32
MIN_INDEX_ENTRIES = 16
INDEX_ENTRY_BYTES = 8 + 4          # a key (int64) and an ordinal (int32)
_META_KEYS = ("format", "version", "workload", "split", "seed", "batch", "cache_rows", "ranks", "partition",
              "tokens")
_FIX_LIST = ("write the pack list with slacktier.workloads.packing.write_pack_list (the format, in "
             "slacktier.tables.packing's module doc: layers, ids_<layer> [n, 24] int64, saved_<layer> [n] float64, "
             "meta JSON)")

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_SEED = np.uint64(0x243F6A8885A308D3)


# ---- the pack list --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PackList:
    """A pack list as read from its file: per layer the contexts [n, C] int64, best first, and their savings."""

    layers: tuple[int, ...]
    ids: dict[int, np.ndarray]        # layer -> [n, C] int64 global row ids, best first
    saved: dict[int, np.ndarray]      # layer -> [n] float64 page reads saved on the fit half (reports only)
    meta: dict[str, Any]
    path: str = ""


def read_pack_list(path: str | Path) -> PackList:
    """The pack list at `path` (module doc); anything else is refused naming the file and what is wrong."""
    p = Path(path)
    if not p.is_file():
        raise SlackTierError(ErrorKind.MISSING, f"pack list {p} does not exist", fix=_FIX_LIST)
    try:
        with np.load(p, allow_pickle=False) as z:
            arrays = {name: z[name] for name in z.files}
    except (OSError, ValueError, EOFError) as exc:   # not a zip, a pickled array, a truncated member
        raise SlackTierError(ErrorKind.BAD_INPUT, f"pack list {p} is not a .npz of plain arrays: {exc}",
                             fix=_FIX_LIST) from None
    except Exception as exc:   # zipfile.BadZipFile and kin: still a file that is not a pack list
        raise SlackTierError(ErrorKind.BAD_INPUT, f"pack list {p} cannot be read as .npz: {exc}",
                             fix=_FIX_LIST) from None

    def bad(what: str) -> SlackTierError:
        return SlackTierError(ErrorKind.BAD_INPUT, f"pack list {p}: {what}", fix=_FIX_LIST)

    for name in ("layers", "meta"):
        if name not in arrays:
            raise bad(f"has no {name!r} array")
    meta_arr = arrays["meta"]
    if meta_arr.shape != () or meta_arr.dtype.kind != "U":
        raise bad(f"'meta' is {meta_arr.dtype} {meta_arr.shape}, want a 0-d str array of JSON")
    try:
        meta = json.loads(str(meta_arr))
    except ValueError as exc:
        raise bad(f"'meta' is not JSON: {exc}") from None
    if not isinstance(meta, dict):
        raise bad("'meta' is not a JSON object")
    missing = [k for k in _META_KEYS if k not in meta]
    if missing:
        raise bad(f"'meta' has no {', '.join(missing)}")
    if meta["format"] != PACK_LIST_FORMAT or meta["version"] != PACK_LIST_VERSION:
        raise bad(f"'meta' says format {meta['format']!r} version {meta['version']!r}, want "
                  f"{PACK_LIST_FORMAT!r} version {PACK_LIST_VERSION}")
    if meta["split"] != "fit":
        raise bad(f"'meta' split is {meta['split']!r}: a pack list is chosen on the fit half of the traffic only, "
                  "so the held-out half measures it")
    layers_arr = arrays["layers"]
    if layers_arr.dtype != np.int64 or layers_arr.ndim != 1 or layers_arr.shape[0] == 0:
        raise bad(f"'layers' is {layers_arr.dtype} {layers_arr.shape}, want a non-empty int64 [L]")
    layers = tuple(int(x) for x in layers_arr)
    if len(set(layers)) != len(layers) or min(layers) < 0:
        raise bad(f"'layers' {list(layers)} lists a layer twice or a negative one")
    known = {"layers", "meta"} | {f"ids_{k}" for k in layers} | {f"saved_{k}" for k in layers}
    extra = sorted(set(arrays) - known)
    if extra:
        raise bad(f"holds {extra[0]!r}, which is no array of a pack list over layers {list(layers)}")
    ids: dict[int, np.ndarray] = {}
    saved: dict[int, np.ndarray] = {}
    for k in layers:
        a = arrays.get(f"ids_{k}")
        s = arrays.get(f"saved_{k}")
        if a is None or s is None:
            raise bad(f"layer {k} has no {'ids' if a is None else 'saved'}_{k} array")
        if a.dtype != np.int64 or a.ndim != 2 or a.shape[1] < 1:
            raise bad(f"ids_{k} is {a.dtype} {a.shape}, want int64 [n, 24]")
        if s.dtype != np.float64 or s.shape != (a.shape[0],):
            raise bad(f"saved_{k} is {s.dtype} {s.shape}, want float64 [{a.shape[0]}], one per context")
        if a.size and a.min() < 0:
            raise bad(f"ids_{k} holds a negative row id ({int(a.min())}): a context is the hasher's row ids")
        ids[k] = np.ascontiguousarray(a)
        saved[k] = s
    return PackList(layers, ids, saved, meta, str(p))


# ---- context keys and the index -------------------------------------------------------------------------------

@njit(nogil=True, cache=True, inline="always")
def _mix(x):
    x = (x ^ (x >> np.uint64(30))) * _MIX1
    x = (x ^ (x >> np.uint64(27))) * _MIX2
    return x ^ (x >> np.uint64(31))


@njit(nogil=True, cache=True)
def context_key(ids, t):
    """The 64-bit key of token t's context: ids [T, C] int64 (any strides) -> int64, never 0 (the empty entry).

    Each column's id, offset by its column (so the key is order-dependent), is scrambled on its own (one
    multiply, one xor-shift) and the terms are summed, then the sum gets a full splitmix64 finalizer: the
    terms do not wait on each other, so the begin_step pass pays a fraction of a chained hash's latency."""
    acc = _SEED
    for c in range(ids.shape[1]):
        x = (np.uint64(ids[t, c]) + np.uint64(c + 1) * _GOLDEN) * _MIX1
        acc += x ^ (x >> np.uint64(29))
    k = np.int64(_mix(acc))
    return k if k != 0 else np.int64(1)


@njit(nogil=True, cache=True)
def _keys_of(ids, out):
    for t in range(ids.shape[0]):
        out[t] = context_key(ids, t)


def context_keys(ids: np.ndarray) -> np.ndarray:
    """ids [n, C] int64 -> [n] int64 context keys (`context_key` of each row)."""
    a = np.ascontiguousarray(ids, dtype=np.int64)
    out = np.empty(a.shape[0], dtype=np.int64)
    _keys_of(a, out)
    return out


@njit(nogil=True, cache=True, inline="always")
def probe_index(keys, ordinals, bits, key):
    """The ordinal of context `key` in an index (keys [H = 2**bits] int64, 0 = empty; ordinals [H] int32), or
    -1 when it is not packed."""
    mask = keys.shape[0] - 1
    h = np.int64((np.uint64(key) * _GOLDEN) >> np.uint64(64 - bits))
    while keys[h] != 0:
        if keys[h] == key:
            return np.int64(ordinals[h])
        h = (h + 1) & mask
    return np.int64(-1)


def index_bits(entries: int) -> int:
    """log2 of an index's entries (a power of two, at least MIN_INDEX_ENTRIES)."""
    return int(entries).bit_length() - 1


@njit(nogil=True, cache=True)
def _log2(n):
    b = 0
    while (np.int64(1) << b) < n:
        b += 1
    return b


@njit(nogil=True, cache=True)
def _insert_all(keys_in, keys, ordinals):
    """Insert keys_in[i] -> i; returns the index of the first key already present, or -1."""
    mask = keys.shape[0] - 1
    bits = _log2(keys.shape[0])
    for i in range(keys_in.shape[0]):
        key = keys_in[i]
        h = np.int64((np.uint64(key) * _GOLDEN) >> np.uint64(64 - bits))
        while keys[h] != 0:
            if keys[h] == key:
                return i
            h = (h + 1) & mask
        keys[h] = key
        ordinals[h] = i
    return -1


def index_entries(contexts: int) -> int:
    """Entries of an index of `contexts` contexts: a power of two, load at most 1/2 (1,000 -> 2,048)."""
    return max(MIN_INDEX_ENTRIES, 1 << max(0, (2 * contexts - 1).bit_length()))


def index_bytes(contexts: int) -> int:
    """Host bytes of one layer's index of `contexts` contexts (keys and ordinals): 1,000 -> 24,576."""
    return index_entries(contexts) * INDEX_ENTRY_BYTES


def contexts_within(index_budget_bytes: int) -> int:
    """The most contexts whose index fits `index_budget_bytes` (0 when not even the smallest index does)."""
    if index_budget_bytes < index_bytes(1):
        return 0
    entries = 1 << ((index_budget_bytes // INDEX_ENTRY_BYTES).bit_length() - 1)
    return entries // 2


@dataclass(frozen=True)
class PackIndex:
    """One layer's index: context key -> ordinal, open addressing over two flat arrays (module doc)."""

    keys: np.ndarray       # [H] int64, 0 = empty
    ordinals: np.ndarray   # [H] int32
    contexts: int

    @classmethod
    def build(cls, keys_in: np.ndarray, layer: int) -> PackIndex:
        """The index of contexts with keys `keys_in` [n] (ordinal = position); two equal keys are refused."""
        n = int(keys_in.shape[0])
        h = index_entries(n)
        keys = np.zeros(h, dtype=np.int64)
        ordinals = np.full(h, -1, dtype=np.int32)
        dup = _insert_all(np.ascontiguousarray(keys_in, dtype=np.int64), keys, ordinals)
        if dup >= 0:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"layer {layer}: context {dup} of the pack list has the key "
                                 "of an earlier one (the same 24 ids listed twice, or a 64-bit key collision)",
                                 layer=layer, fix="list each context once (write_pack_list does)")
        return cls(keys, ordinals, n)

    @property
    def nbytes(self) -> int:
        """Host bytes the index takes."""
        return int(self.keys.nbytes + self.ordinals.nbytes)

    def lookup(self, key: int) -> int:
        """The ordinal of context `key`, or -1."""
        return int(probe_index(self.keys, self.ordinals, index_bits(self.keys.shape[0]), np.int64(key)))


INDEX_MAGIC = b"SLACKTIER-PACKIX"


def index_file_bytes(indexes: dict[int, PackIndex]) -> bytes:
    """The pack index file's bytes: `INDEX_MAGIC`, a uint32 length, JSON {layer: [entries, contexts]}, then per
    layer (ascending) its keys (int64 LE) and ordinals (int32 LE). Deterministic: the same contexts give the same
    bytes, so restaging the same table keeps its stage id."""
    head = json.dumps({str(k): [int(ix.keys.shape[0]), ix.contexts] for k, ix in sorted(indexes.items())},
                      sort_keys=True, separators=(",", ":")).encode()
    parts = [INDEX_MAGIC, len(head).to_bytes(4, "little"), head]
    for _, ix in sorted(indexes.items()):
        parts.append(ix.keys.astype("<i8").tobytes())
        parts.append(ix.ordinals.astype("<i4").tobytes())
    return b"".join(parts)


def save_indexes(path: Path, data: bytes) -> None:
    """Write the index file's bytes (`index_file_bytes`) to `path`, atomically."""
    from slacktier.tables.odirect import write_file_atomic

    write_file_atomic(path, data, what="pack index")


def load_index(path: Path, sha256: str, layer: int, contexts: int) -> PackIndex:
    """Layer `layer`'s index from the file staging wrote, refused (CHECKSUM) unless its bytes are the manifest's."""
    fix = "restore the pack index staging wrote beside the manifest, or stage the table again with --pack-list"
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise SlackTierError(ErrorKind.MISSING, f"pack index {path} does not exist", layer=layer, fix=fix) from None
    except OSError as exc:
        raise SlackTierError(ErrorKind.IO, f"cannot read pack index {path}: {exc.strerror}", layer=layer,
                             fix=fix) from None
    if hashlib.sha256(data).hexdigest() != sha256.removeprefix("sha256:"):
        raise SlackTierError(ErrorKind.CHECKSUM, f"pack index {path} does not match its manifest's sha256 (edited "
                             "or from another staging run)", layer=layer, fix=fix)
    n_head = int.from_bytes(data[len(INDEX_MAGIC):len(INDEX_MAGIC) + 4], "little")
    at = len(INDEX_MAGIC) + 4
    head = json.loads(data[at:at + n_head])
    at += n_head
    for k, (entries, n) in sorted(((int(k), v) for k, v in head.items())):
        if k == layer:
            if n != contexts or entries != index_entries(contexts):
                raise SlackTierError(ErrorKind.CHECKSUM, f"pack index {path}: layer {layer} holds {n} contexts in "
                                     f"{entries} entries, the manifest {contexts}", layer=layer, fix=fix)
            keys = np.frombuffer(data, dtype="<i8", count=entries, offset=at).astype(np.int64)
            ordinals = np.frombuffer(data, dtype="<i4", count=entries, offset=at + 8 * entries).astype(np.int32)
            return PackIndex(keys, ordinals, contexts)
        at += entries * INDEX_ENTRY_BYTES
    raise SlackTierError(ErrorKind.MISSING, f"pack index {path} has no layer {layer}", layer=layer, fix=fix)


# ---- which columns a rank packs ---------------------------------------------------------------------------------

def pages_per_context(n_owned: int) -> int:
    """Pages one context takes in a rank's packed region: 6 owned columns -> 1, 24 -> 2."""
    return -(-n_owned // ROWS_PER_PAGE)


def column_slots(rank_columns: Sequence[Sequence[int]], n_columns: int) -> np.ndarray:
    """[C] int32: column c's place among its owner's packed columns (TP4 columns: 6 -> 0, 11 -> 5)."""
    slots = np.full(n_columns, -1, dtype=np.int32)
    for cols in rank_columns:
        for j, c in enumerate(sorted(cols)):
            slots[c] = j
    return slots


# ---- the packed pages -------------------------------------------------------------------------------------------

@njit(nogil=True, cache=True, inline="always")
def _put(pg, at, value, nbytes):
    """Little-endian `nbytes` bytes of `value` (an integer; two's complement) at byte `at` of page `pg`."""
    v = np.uint64(value)
    for k in range(nbytes):
        pg[at + k] = np.uint8((v >> np.uint64(8 * k)) & np.uint64(0xFF))


@njit(nogil=True, cache=True, inline="always")
def _get(pg, at, nbytes):
    """The little-endian unsigned integer of `nbytes` bytes at byte `at` of page `pg`, as int64 bits."""
    v = np.uint64(0)
    for k in range(nbytes):
        v |= np.uint64(pg[at + k]) << np.uint64(8 * k)
    return np.int64(v)


@njit(nogil=True, cache=True)
def _fill_packed(rows, ids, ctx0, n_owned, ppc, pages):
    """pages [n * ppc, 4096] uint8 of contexts ctx0.. from rows [n * n_owned, 264] and ids [n, n_owned]."""
    n = ids.shape[0]
    for i in range(n):
        for q in range(ppc):
            pg = pages[i * ppc + q]
            pg[:] = 0
            first = q * ROWS_PER_PAGE
            m = min(ROWS_PER_PAGE, n_owned - first)
            for s in range(m):
                src = rows[i * n_owned + first + s]
                for b in range(ROW_BYTES):
                    pg[s * ROW_BYTES + b] = src[b]
            _put(pg, PAGE_USED_BYTES, PACK_MAGIC, 4)
            _put(pg, PAGE_USED_BYTES + 4, m, 2)
            _put(pg, PAGE_USED_BYTES + 6, q, 2)
            for s in range(ROWS_PER_PAGE):
                _put(pg, IDS_AT + 8 * s, ids[i, first + s] if s < m else -1, 8)
            _put(pg, CTX_AT, ctx0 + i, 4)


def fill_packed_pages(rows: np.ndarray, ids: np.ndarray, first_context: int, pages: np.ndarray) -> None:
    """Write packed pages (module doc) of contexts first_context.. into pages [n * ppc, 4096] uint8.

    rows [n * n_owned, 264] uint8: each context's owned rows in owned-column order; ids [n, n_owned] int64:
    their global ids."""
    n, n_owned = ids.shape
    ppc = pages_per_context(n_owned)
    if rows.shape != (n * n_owned, ROW_BYTES) or pages.shape != (n * ppc, PAGE_BYTES):
        raise SlackTierError(ErrorKind.BAD_INPUT, f"packed pages {pages.shape} for rows {rows.shape} of {n} "
                             f"contexts x {n_owned} columns", fix="pass one page group per context")
    _fill_packed(np.ascontiguousarray(rows), np.ascontiguousarray(ids, dtype=np.int64), first_context, n_owned,
                 ppc, pages)


@njit(nogil=True, cache=True)
def check_packed_reads(miss_buf, miss_inpage, expected, n_miss, page_region, page_buf, n_pages, first_packed,
                       pages):
    """Index of the first miss read from a packed page (page_region >= first_packed) whose page does not name
    `expected[m]` in its slot, or -1: pool pages [B, 4096] uint8, the pass's miss and page arrays."""
    if n_pages == 0:
        return -1
    b0 = page_buf[0]   # a layer's page buffers are numbered b0, b0 + 1, ... (cache.directory)
    for m in range(n_miss):
        b = miss_buf[m]
        if page_region[b - b0] < first_packed:
            continue
        pg = pages[b]
        s = miss_inpage[m]
        if (_get(pg, PAGE_USED_BYTES, 4) != PACK_MAGIC or s >= _get(pg, PAGE_USED_BYTES + 4, 2)
                or _get(pg, IDS_AT + 8 * s, 8) != expected[m]):
            return m
    return -1


def page_slot_ids(page: np.ndarray) -> tuple[int, list[int]] | None:
    """(context ordinal, the ids of its rows) a packed page names, or None when it is not a packed page."""
    page = np.ascontiguousarray(page, dtype=np.uint8)
    if int(page[PAGE_USED_BYTES:PAGE_USED_BYTES + 4].view(np.uint32)[0]) != PACK_MAGIC:
        return None
    m = int(page[PAGE_USED_BYTES + 4:PAGE_USED_BYTES + 6].view(np.uint16)[0])
    ids = page[IDS_AT:CTX_AT].view(np.int64)[:m].tolist()
    return int(page[CTX_AT:CTX_AT + 4].view(np.uint32)[0]), ids


# ---- staging: what to pack, and where -------------------------------------------------------------------------

@dataclass(frozen=True)
class PackRequest:
    """What `stage --pack-list` asks for: the list and the per-rank budgets (extra disk, index host memory)."""

    pack_list: PackList
    disk_bytes: int         # extra disk per rank, all layers together
    index_bytes: int        # index host memory per rank, all layers together

    def __post_init__(self) -> None:
        if self.disk_bytes <= 0:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"--pack-disk-gb gives {self.disk_bytes} bytes",
                                 fix="give the extra disk per rank packing may use, e.g. --pack-disk-gb 1")
        if self.index_bytes <= 0:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"--pack-index-mb gives {self.index_bytes} bytes",
                                 fix="give the host memory per rank the index may use, e.g. --pack-index-mb 64")


@dataclass
class PackPlan:
    """What staging packs: per layer the contexts (ids [n, C], keys, index) and each rank's packed columns."""

    layers: tuple[int, ...]
    ids: dict[int, np.ndarray]                       # layer -> [n, C] int64 global ids of the packed contexts
    index_ids: dict[int, np.ndarray]                 # layer -> [n, C] the ids the layer's pass reads (stored rows)
    indexes: dict[int, PackIndex]
    rank_columns: tuple[tuple[int, ...], ...]        # per rank, the columns it owns
    request: PackRequest
    disk_bytes_per_rank: int = 0
    index_bytes_per_rank: int = 0
    regions: list[StagedRegion] = field(default_factory=list)

    @property
    def pages_per_context(self) -> int:
        """Pages per context in every rank's packed region (every rank owns as many columns)."""
        return pages_per_context(len(self.rank_columns[0]))


def plan_packing(request: PackRequest, layer_rows: dict[int, int], column_bounds: dict[int, Sequence[int]],
                 rank_columns: Sequence[Sequence[int]] | None, ranks: int, to_stored: Any = None) -> PackPlan:
    """Choose the contexts to pack, in file order, within both budgets; refuse what cannot be packed.

    Each of the table's layers that the list holds gets an equal share of each budget. `rank_columns`: each
    rank's owned columns (None: one rank owns every column); `to_stored(layer, ids)`: the ids the layer's
    pass reads, where a rank partition maps them (None: the global ids). Refused: a list with none of the
    table's layers, contexts of another column count or outside their columns' rows, an index budget too
    small for one context (naming --pack-index-mb), a disk budget smaller than one context's pages.
    """
    pl = request.pack_list
    layers = tuple(k for k in pl.layers if k in layer_rows)
    fix = "write the pack list from traffic hashed with this table's layout"
    if not layers:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"pack list {pl.path} holds layers {list(pl.layers)}, the table "
                             f"{sorted(layer_rows)}", fix=fix)
    n_cols = {len(b) - 1 for k, b in column_bounds.items() if k in layers}
    c_list = {pl.ids[k].shape[1] for k in layers}
    if len(c_list) != 1:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"pack list {pl.path}: layers have {sorted(c_list)} columns",
                             fix=fix)
    n_columns = c_list.pop()
    if n_cols and n_cols != {n_columns}:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"pack list {pl.path}: contexts of {n_columns} ids, the table's "
                             f"layers have {sorted(n_cols)} hash columns", fix=fix)
    if rank_columns is None:
        if ranks != 1:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"packing a table of {ranks} ranks needs each rank to own "
                                 "whole hash columns", fix="stage from the model's hash layout with a rank count "
                                 "that divides its columns")
        rank_columns = (tuple(range(n_columns)),)
    rank_columns = tuple(tuple(sorted(int(c) for c in cols)) for cols in rank_columns)
    if len({len(c) for c in rank_columns}) != 1:
        raise SlackTierError(ErrorKind.BAD_INPUT, "ranks own different numbers of hash columns",
                             fix="stage with a rank count that divides the columns")
    ppc = pages_per_context(len(rank_columns[0]))
    disk_share = request.disk_bytes // len(layers)
    index_share = request.index_bytes // len(layers)
    by_disk = disk_share // (ppc * PAGE_BYTES)
    by_index = contexts_within(index_share)
    if by_index == 0:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"--pack-index-mb gives {index_share} bytes per layer and rank "
                             f"({len(layers)} layers share {request.index_bytes}), less than the smallest index "
                             f"({index_bytes(1)} bytes): the index would exceed its budget",
                             fix="raise --pack-index-mb, or stage without --pack-list")
    if by_disk == 0:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"--pack-disk-gb gives {disk_share} bytes per layer and rank, "
                             f"less than one context's {ppc} page(s)", fix="raise --pack-disk-gb")
    ids: dict[int, np.ndarray] = {}
    index_ids: dict[int, np.ndarray] = {}
    indexes: dict[int, PackIndex] = {}
    for k in layers:
        a = pl.ids[k][:min(by_disk, by_index)]
        bounds = column_bounds.get(k)
        if bounds is not None:
            lo = np.asarray(bounds[:-1], dtype=np.int64)
            hi = np.asarray(bounds[1:], dtype=np.int64)
            bad = np.argwhere((a < lo) | (a >= hi))
        else:
            bad = np.argwhere((a < 0) | (a >= layer_rows[k]))
        if bad.shape[0]:
            i, c = (int(x) for x in bad[0])
            raise SlackTierError(ErrorKind.BAD_INPUT, f"pack list {pl.path}: layer {k} context {i} has id "
                                 f"{int(a[i, c])} in column {c}, outside that column's rows", layer=k, fix=fix)
        ids[k] = np.ascontiguousarray(a)
        index_ids[k] = np.ascontiguousarray(to_stored(k, a) if to_stored is not None else a)
        indexes[k] = PackIndex.build(context_keys(index_ids[k]), k)
    plan = PackPlan(layers, ids, index_ids, indexes, rank_columns, request)
    plan.disk_bytes_per_rank = sum(ids[k].shape[0] * ppc * PAGE_BYTES for k in layers)
    plan.index_bytes_per_rank = sum(ix.nbytes for ix in indexes.values())
    return plan


def place_packed_regions(plan: PackPlan, row_regions: Sequence[StagedRegion], targets: Sequence[str],
                         next_offset: Sequence[int], crc_first: int) -> list[StagedRegion]:
    """Per (layer, staged rank) a packed region on the target of that rank's row region, after every row
    region (`next_offset[d]`: where target d's row regions end), checksums numbered on from `crc_first`."""
    offsets = list(next_offset)
    ppc = plan.pages_per_context
    out: list[StagedRegion] = []
    for layer in plan.layers:
        n = plan.ids[layer].shape[0]
        if n == 0:
            continue
        for r in row_regions:
            if r.layer != layer:
                continue
            pages = n * ppc
            out.append(StagedRegion(layer, r.rank, r.device, targets[r.device], offsets[r.device], pages, 0, 0,
                                    crc_first))
            offsets[r.device] += pages * PAGE_BYTES
            crc_first += pages
    plan.regions = out
    return out


@dataclass(frozen=True)
class PackedTable:
    """The manifest's "packing" record: the packed regions, contexts per layer, index file, budgets, list meta."""

    regions: tuple[StagedRegion, ...]
    contexts: dict[int, int]                 # layer -> contexts packed
    pages_per_context: int
    rank_columns: tuple[tuple[int, ...], ...]
    index_file: str                          # beside the manifest
    index_sha256: str
    index_bytes_per_rank: int
    disk_bytes_per_rank: int
    budget_disk_bytes: int
    budget_index_bytes: int
    pack_list: dict[str, Any]                # the pack list's meta, and its file name

    def to_json(self) -> dict[str, Any]:
        """The manifest's "packing" object."""
        from dataclasses import asdict

        return {"regions": [asdict(r) for r in self.regions],
                "contexts": {str(k): int(v) for k, v in sorted(self.contexts.items())},
                "pages_per_context": self.pages_per_context,
                "rank_columns": [list(c) for c in self.rank_columns],
                "index": {"file": self.index_file, "sha256": self.index_sha256,
                          "bytes_per_rank": self.index_bytes_per_rank},
                "disk_bytes_per_rank": self.disk_bytes_per_rank,
                "budgets": {"disk_bytes_per_rank": self.budget_disk_bytes,
                            "index_bytes_per_rank": self.budget_index_bytes},
                "pack_list": self.pack_list}

    def layer_regions(self, layer: int) -> list[StagedRegion]:
        """The packed regions of `layer`, in rank order."""
        return sorted((r for r in self.regions if r.layer == layer), key=lambda r: r.rank)
