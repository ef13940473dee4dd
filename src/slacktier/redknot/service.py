"""Build artifacts offline and serve prefills that reuse them, through a SlackTier page source.

`RedKnotService` ties the runner (model), an ArtifactStore (files + certificates)
and a page source kind ("dram" or "disk", slacktier.store.factory.open_source):
- `build(doc_id, tokens, context=())`: prefill the document alone at position 0
  (or after `context`), capture every reusable layer's Local z, publish per rank;
- `prefill(docs, query, protection)`: validate every certificate first; on any
  problem log it, count it in `counters`, and run full recompute (no artifact
  page is read, no Local row reused); otherwise issue every artifact page read
  at once (one ticket per document and layer, layer order, like a SlackTier
  step) and run reuse, each layer waiting only for its own pages.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.redknot.artifacts import (
    ArtifactStore,
    Certificate,
    Expectation,
    FallbackReason,
    RowFormat,
    TPGeometry,
    tokens_digest,
    validate,
)
from slacktier.redknot.model import model_digest
from slacktier.redknot.protect import ProtectionPolicy
from slacktier.redknot.runner import Layout, RedKnotRunner, RunResult, Segment
from slacktier.store.base import PageBufferPool, PageReads, RegionSpec
from slacktier.store.factory import open_source

log = logging.getLogger(__name__)

_DTYPE_NAMES = {torch.float64: "float64", torch.float32: "float32", torch.bfloat16: "bfloat16",
                torch.float16: "float16"}


@dataclass
class ReadCounters:
    """Artifact I/O of one prefill."""

    pages: int = 0
    bytes: int = 0
    tickets: int = 0
    wait_s: float = 0.0
    failed_layers: int = 0


class StoredLocal:
    """LocalSource over published artifacts, read through a SlackTier page source.

    All page reads are submitted in the constructor (step start); `layer(l)` waits
    for layer l's tickets only, checks nothing twice (the source verifies each
    page's CRC32C against the certificate), and assembles z_off [S, G*R] from the
    ranks' group slices. A failed read or checksum makes that layer unusable: it
    is logged, counted, and its Local heads are recomputed for every row.
    """

    def __init__(self, store: ArtifactStore, layout: Layout, doc_certs: dict[int, list[Certificate]],
                 tp: TPGeometry, o_lora_rank: int, dtype: torch.dtype, layers: tuple[int, ...],
                 source_kind: str = "dram", open_fn=None) -> None:
        """`open_fn(certs, regions, sums) -> PageSource` lends a (cached) source; None opens one per call."""
        self.layout = layout
        self.tp = tp
        self.o_lora_rank = o_lora_rank
        self.dtype = dtype
        self.counters = ReadCounters()
        self.failed_docs: set[str] = set()
        self.has_artifact = torch.zeros(layout.rows, dtype=torch.bool)
        self._sources = []  # sources this object opened and must close
        self._open_fn = open_fn
        self._tickets: dict[int, list[tuple]] = collections.defaultdict(list)
        total_pages = 0
        plans = []
        for seg_index, certs in doc_certs.items():
            s, e = layout.starts[seg_index], layout.ends[seg_index]
            self.has_artifact[s:e] = True
            regions, sums, where = [], [], {}
            for cert in certs:
                path = str(store.data_path(cert))
                for i, layer in enumerate(cert.covered_layers):
                    if layer not in layers:
                        continue
                    where[(layer, cert.rank)] = len(regions)
                    regions.append(RegionSpec(layer=layer, rank=cert.rank, path=path,
                                              offset_bytes=cert.region_offsets_bytes[i], pages=cert.region_pages[i]))
                    sums.append(np.asarray(cert.page_crc32c[i], dtype=np.uint32))
            plans.append((seg_index, certs, regions, sums, where))
            total_pages += sum(r.pages for r in regions)
        self.pool = PageBufferPool(max(total_pages, 1))
        try:
            self._submit_all(plans, layers, source_kind)
        except BaseException:
            self.close()  # sources already opened must not outlive a failed start
            raise

    def _submit_all(self, plans, layers, source_kind: str) -> None:
        next_buffer = 0
        for seg_index, certs, regions, sums, where in plans:
            if self._open_fn is not None:
                source = self._open_fn(certs, regions, sums)
            else:
                source = open_source(source_kind, regions, verify_reads=True, page_crc32c=sums)
                self._sources.append(source)
            for layer in sorted(layers):  # layer order: the earliest deadline first
                for cert in certs:
                    ri = where[(layer, cert.rank)]
                    n = regions[ri].pages
                    buffers = np.arange(next_buffer, next_buffer + n, dtype=np.int32)
                    next_buffer += n
                    reads = PageReads(np.full(n, ri, dtype=np.int32), np.arange(n, dtype=np.int64), buffers)
                    ticket = source.submit(reads, self.pool)
                    self._tickets[layer].append((source, ticket, seg_index, cert, buffers))
                    self.counters.tickets += 1

    def layer(self, layer: int) -> torch.Tensor | None:
        """z_off [S, G*R] of `layer` (rows without an artifact are zero), or None if a read failed."""
        z = torch.zeros(self.layout.rows, self.tp.o_groups * self.o_lora_rank, dtype=self.dtype)
        failed = False
        for source, ticket, seg_index, cert, buffers in self._tickets.pop(layer, []):
            t0 = time.perf_counter()
            try:
                stats = source.wait(ticket)
            except SlackTierError as exc:
                log.warning("artifact %s rank %d layer %d unusable: %s", cert.doc_id, cert.rank, layer, exc)
                failed = True
                self.failed_docs.add(cert.doc_id)
                continue
            finally:
                self.counters.wait_s += time.perf_counter() - t0
            self.counters.pages += stats.pages
            self.counters.bytes += stats.pages * 4096
            s, e = self.layout.starts[seg_index], self.layout.ends[seg_index]
            rows = cert.row_format.unpack(self.pool.pages[buffers], e - s)
            lo, hi = self.tp.groups(cert.rank)
            z[s:e, lo * self.o_lora_rank:hi * self.o_lora_rank] = rows.to(self.dtype)
        if failed:
            self.counters.failed_layers += 1
            return None
        return z

    def close(self) -> None:
        """Close the page sources this object opened (lent ones stay with their owner)."""
        for source in self._sources:
            source.close()
        self._sources.clear()


@dataclass
class PrefillReport:
    """What a prefill did besides its outputs."""

    result: RunResult
    fallback_reason: FallbackReason | None = None
    reads: ReadCounters = field(default_factory=ReadCounters)
    new_documents: int = 0


class RedKnotService:
    """Offline builds and online prefills over one model, profile, policy, store and TP geometry."""

    def __init__(self, runner: RedKnotRunner, store: ArtifactStore, *, tp_size: int = 1,
                 source_kind: str = "dram") -> None:
        self.runner = runner
        self.store = store
        cfg = runner.config
        self.tp = TPGeometry(tp_size, cfg.o_groups)
        self.source_kind = source_kind
        self.dtype = runner.model.model.embed_tokens.weight.dtype
        self.counters: collections.Counter[str] = collections.Counter()
        self._model_digest: str | None = None
        # open page sources, one per document build: a DRAM source keeps the artifact resident
        # across prefills (hot artifacts), a disk source keeps its files and rings open
        self._sources: dict[str, tuple[tuple, object]] = {}

    def _source_for(self, certs: list[Certificate], regions, sums):
        """The cached source of this exact build of the document (a new build or generation reopens it)."""
        doc_id = certs[0].doc_id
        key = (tuple(c.data_file for c in certs), tuple((r.layer, r.rank) for r in regions))
        cached = self._sources.get(doc_id)
        if cached is not None and cached[0] == key:
            return cached[1]
        if cached is not None:
            cached[1].close()
        source = open_source(self.source_kind, regions, verify_reads=True, page_crc32c=sums)
        self._sources[doc_id] = (key, source)
        self.counters["sources_opened"] += 1
        return source

    def drop_source(self, doc_id: str) -> None:
        """Close and forget a document's cached source (after a failed read, or when it is evicted)."""
        cached = self._sources.pop(doc_id, None)
        if cached is not None:
            cached[1].close()

    def close(self) -> None:
        """Close every cached page source."""
        for doc_id in list(self._sources):
            self.drop_source(doc_id)

    @property
    def model_digest(self) -> str:
        """Digest of the served weights (computed once)."""
        if self._model_digest is None:
            self._model_digest = model_digest(self.runner.model)
        return self._model_digest

    def expectation(self) -> Expectation:
        """What certificates must match for this service."""
        r = self.runner
        return Expectation(model_digest=self.model_digest, profile_name=r.profile.name,
                           profile_digest=r.profile.digest(), head_policy_digest=r.policy.digest(),
                           reusable_layers=r.profile.reusable, tp=self.tp, o_lora_rank=r.config.o_lora_rank,
                           dtype=_DTYPE_NAMES[self.dtype])

    # ---- offline ------------------------------------------------------------------
    def build(self, doc_id: str, tokens, *, context=(), layers: tuple[int, ...] | None = None,
              on_layer=None) -> list[Certificate]:
        """Prefill the document alone at position 0 (or after `context`) and publish one artifact per rank."""
        tokens = tuple(int(t) for t in tokens)
        context = tuple(int(t) for t in context)
        layers = tuple(self.runner.profile.reusable if layers is None else layers)
        bad = [l for l in layers if not self.runner.profile.is_reusable(l)]
        if bad:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"layers {bad} are fence layers",
                                 fix=f"cover only reusable layers {self.runner.profile.reusable}")
        segs = ([Segment("context", context)] if context else []) + [Segment(doc_id, tokens)]
        layout = Layout.of(segs)
        result = self.runner.full(layout, capture_layers=layers)
        doc_rows = slice(layout.starts[-1], layout.ends[-1])
        exp = self.expectation()
        generation = self.store.next_generation(doc_id)
        fields = dict(tp_size=self.tp.tp_size, o_groups=self.tp.o_groups, o_lora_rank=exp.o_lora_rank,
                      model_digest=exp.model_digest, tokens_digest=tokens_digest(tokens),
                      context_digest=tokens_digest(context), rows=len(tokens), profile_name=exp.profile_name,
                      profile_digest=exp.profile_digest, head_policy_digest=exp.head_policy_digest,
                      generation=generation, dtype=exp.dtype)
        R = exp.o_lora_rank
        certs = []
        for rank in range(self.tp.tp_size):
            lo, hi = self.tp.groups(rank)
            fmt = RowFormat((hi - lo) * R, exp.dtype)
            layer_pages = [(l, fmt.pack(result.captured[l][doc_rows, lo * R:hi * R])) for l in layers]
            certs.append(self.store.publish(doc_id=doc_id, rank=rank, layer_pages=layer_pages, fields=fields,
                                            on_layer=on_layer))
        self.counters["builds"] += 1
        return certs

    # ---- online -------------------------------------------------------------------
    def prefill(self, docs: list[tuple[str, tuple[int, ...]]], query: tuple[int, ...],
                protection: ProtectionPolicy, *, dirty: torch.Tensor | None = None) -> PrefillReport:
        """Prefill documents + query, reusing valid artifacts; full recompute on any certificate problem."""
        segs = [Segment(doc_id, tuple(toks)) for doc_id, toks in docs] + [Segment("query", tuple(query), "query")]
        layout = Layout.of(segs)
        exp = self.expectation()
        doc_certs: dict[int, list[Certificate]] = {}
        reason: FallbackReason | None = None
        new_docs = 0
        preceding: list[int] = []
        for i, (doc_id, toks) in enumerate(docs):
            certs = [self.store.certificate(doc_id, r) for r in range(self.tp.tp_size)]
            reason = validate(certs, exp, toks, preceding, self.store.floor(doc_id))
            if reason is not None:
                log.warning("RedKnot fallback to full recompute: document %s: %s", doc_id, reason.value)
                break
            if all(c is None for c in certs):
                new_docs += 1
            else:
                doc_certs[i] = certs
            preceding += list(toks)
        if reason is None and not doc_certs:
            reason = FallbackReason.NO_ARTIFACT
            log.info("RedKnot: no document of the request has an artifact; full recompute")
        if reason is not None:
            self.counters[f"fallback.{reason.value}"] += 1
            result = self.runner.full(layout)
            result.stats.mode = "fallback"
            result.stats.fallback_reason = reason.value
            return PrefillReport(result, reason, ReadCounters(), new_docs)
        try:
            local = StoredLocal(self.store, layout, doc_certs, self.tp, exp.o_lora_rank, self.dtype,
                                self.runner.profile.reusable, self.source_kind, open_fn=self._source_for)
        except SlackTierError as exc:  # a certified file that is gone or unreadable: still before reuse work
            log.warning("RedKnot fallback to full recompute: artifact data unreadable: %s", exc)
            reason = FallbackReason.UNREADABLE
            self.counters[f"fallback.{reason.value}"] += 1
            result = self.runner.full(layout)
            result.stats.mode = "fallback"
            result.stats.fallback_reason = reason.value
            return PrefillReport(result, reason, ReadCounters(), new_docs)
        try:
            result = self.runner.reuse(layout, local, protection, dirty)
        finally:
            local.close()
        for doc_id in local.failed_docs:  # a bad page in a resident copy: reload it next time
            self.drop_source(doc_id)
        self.counters["reuse"] += 1
        self.counters["new_documents"] += new_docs
        return PrefillReport(result, None, local.counters, new_docs)
