"""Prometheus metrics of the step engine, published once per step from `end_step`'s counters.

Off by default: an engine without an `EngineMetrics` does no metrics work at
all (begin_step and gather never look at it; end_step tests one attribute).
On with the control file's `[engine] metrics = true` (the default registry) or
`StepEngine(..., metrics=EngineMetrics(registry=app_registry))` to register
into a host application's registry (an inference server's own).

What is exported (labels `layer`, `tier`, `rank`; rank "all" for a process
serving every rank's region):

    slacktier_lookups_total        lookups (padding included)
    slacktier_hits_total           lookups served from the row cache
    slacktier_rows_read_total      unique rows read from the tier
    slacktier_pages_read_total     unique 4 KiB pages read
    slacktier_evictions_total      cache slots given to another row
    slacktier_padded_total         lookups of the pad id (zero rows, nothing read)
    slacktier_out_of_table_total   lookups of ids outside the layer (zero rows, nothing read)
    slacktier_errors_total{kind,layer,rank}   errors the engine raised, by SlackTierError kind
    slacktier_gather_stall_seconds histogram: per step, how long gather(layer) blocked on its reads
    slacktier_read_seconds         histogram: per step with reads, submit-to-completion of the layer's reads
    slacktier_cache_rows           gauge: cache slots the layer owns
    slacktier_host_table_bytes     gauge: bytes of the table held in host memory (the dram tier), else 0
    slacktier_table_tier           gauge: 1 for the tier serving the layer (an info-style series)

Units follow Prometheus' conventions (seconds, bytes, `_total` counters), as
vLLM's `vllm:*` and SGLang's `sglang:*` metrics do. No `_created` series: vLLM
turns them off (prometheus_client's process-wide disable_created_metrics); we
drop ours in our own collector instead, so a host's own metrics stay as the
host set them.

Several tensor-parallel rank processes: set PROMETHEUS_MULTIPROC_DIR (an empty
folder shared by the processes) before prometheus_client is imported;
each process then writes its values to files there and `serve_metrics` (or the
host's own exporter) sums them with prometheus_client's MultiProcessCollector.
The gauges use the "livesum" mode: a dead process's values drop out.

Worked example: two steps of one layer with 24 and 48 lookups, 10 and 0
hits -> slacktier_lookups_total{layer="1",...} 72, slacktier_hits_total 10,
slacktier_gather_stall_seconds_count 2.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from slacktier.errors import ErrorKind, SlackTierError

if TYPE_CHECKING:
    from slacktier.engine.counters import StepCounters

LABELS = ("layer", "tier", "rank")
# Seconds: 10 us .. 5 s, dense where a prefetch window ends (0.1 .. 10 ms).
TIME_BUCKETS_S = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25,
                  0.5, 1.0, 2.5, 5.0)


@dataclass(frozen=True)
class _Families:
    """The metric families of one registry (registered once, shared by every engine of the process)."""

    lookups: Counter
    hits: Counter
    rows_read: Counter
    pages_read: Counter
    evictions: Counter
    padded: Counter
    out_of_table: Counter
    errors: Counter
    stall: Histogram
    read: Histogram
    cache_rows: Gauge
    host_bytes: Gauge
    tier: Gauge


_BY_REGISTRY: weakref.WeakKeyDictionary[CollectorRegistry, _Families] = weakref.WeakKeyDictionary()


class _WithoutCreated:
    """A collector of our metric families with their `_created` samples left out (a Counter's and a
    Histogram's creation time per label set: a series per series, which vLLM and dashboards do without)."""

    def __init__(self, metrics: tuple) -> None:
        self._metrics = metrics

    def describe(self) -> list:
        return [family for m in self._metrics for family in m.describe()]

    def collect(self):
        for m in self._metrics:
            for family in m.collect():
                family.samples = [s for s in family.samples if not s.name.endswith("_created")]
                yield family


def _families(registry: CollectorRegistry) -> _Families:
    fam = _BY_REGISTRY.get(registry)
    if fam is None:
        # Made unregistered (registry=None) and registered together through _WithoutCreated.
        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, LABELS, registry=None)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, LABELS, registry=None, multiprocess_mode="livesum")

        fam = _Families(
            lookups=counter("slacktier_lookups", "Table lookups (padding included)"),
            hits=counter("slacktier_hits", "Lookups served from the row cache"),
            rows_read=counter("slacktier_rows_read", "Unique rows read from the tier"),
            pages_read=counter("slacktier_pages_read", "Unique 4 KiB pages read from the tier"),
            evictions=counter("slacktier_evictions", "Cache slots given to another row"),
            padded=counter("slacktier_padded", "Lookups of the pad id (zero rows, nothing read)"),
            out_of_table=counter("slacktier_out_of_table", "Lookups of ids outside the layer (zero rows, nothing "
                                 "read)"),
            errors=Counter("slacktier_errors", "Errors the engine raised, by kind", ("kind", "layer", "rank"),
                           registry=None),
            stall=Histogram("slacktier_gather_stall_seconds", "Per step: how long gather(layer) blocked on "
                            "its reads", LABELS, registry=None, buckets=TIME_BUCKETS_S),
            read=Histogram("slacktier_read_seconds", "Per step with reads: submit-to-completion time of the "
                           "layer's reads", LABELS, registry=None, buckets=TIME_BUCKETS_S),
            cache_rows=gauge("slacktier_cache_rows", "Cache slots the layer owns"),
            host_bytes=gauge("slacktier_host_table_bytes", "Bytes of the table held in host memory"),
            tier=gauge("slacktier_table_tier", "1 for the tier serving the layer"),
        )
        registry.register(_WithoutCreated(tuple(getattr(fam, f.name) for f in dataclasses.fields(fam))))
        _BY_REGISTRY[registry] = fam
    return fam


@dataclass(frozen=True)
class LayerLabels:
    """What a layer's series are labelled with: its tier's name and the rank it serves (-1: all)."""

    layer: int
    tier: str
    rank: int = -1
    cache_rows: int = 0
    host_table_bytes: int = 0

    def values(self) -> tuple[str, str, str]:
        """Label values in LABELS order."""
        return str(self.layer), self.tier, "all" if self.rank < 0 else str(self.rank)


class _LayerSeries:
    """One layer's bound children, so a step's update is a few `inc`/`observe` calls."""

    __slots__ = ("lookups", "hits", "rows_read", "pages_read", "evictions", "padded", "out_of_table", "stall",
                 "read")

    def __init__(self, fam: _Families, values: tuple[str, str, str]) -> None:
        for name in self.__slots__:
            setattr(self, name, getattr(fam, name).labels(*values))


class EngineMetrics:
    """An engine's metrics in `registry` (default: prometheus_client's global one)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        check_multiproc_dir()
        self.registry = REGISTRY if registry is None else registry
        self._fam = _families(self.registry)
        self._series: dict[int, _LayerSeries] = {}
        self._labels: dict[int, LayerLabels] = {}

    def bind(self, layers: list[LayerLabels]) -> None:
        """Label the engine's layers (at build and after every apply); sets the gauges, drops gone layers'."""
        fam = self._fam
        new = {lab.layer: lab for lab in layers}
        for layer, old in self._labels.items():
            if new.get(layer) != old:
                for g in (fam.cache_rows, fam.host_bytes, fam.tier):
                    try:
                        g.remove(*old.values())
                    except KeyError:   # pragma: no cover - never set
                        pass
        self._labels = new
        self._series = {}
        for lab in layers:
            values = lab.values()
            self._series[lab.layer] = _LayerSeries(fam, values)
            fam.cache_rows.labels(*values).set(lab.cache_rows)
            fam.host_bytes.labels(*values).set(lab.host_table_bytes)
            fam.tier.labels(*values).set(1)

    def observe(self, counters: StepCounters) -> None:
        """Add one step's counters (called by end_step; once per step, never per lookup)."""
        series = self._series
        for layer, c in counters.layers.items():
            s = series.get(layer)
            if s is None:   # a layer bound after this engine's last bind: label it tier "unknown"
                self.bind([*self._labels.values(), LayerLabels(layer, "unknown")])
                s = self._series[layer]
            s.lookups.inc(c.lookups)
            s.hits.inc(c.hits)
            s.rows_read.inc(c.rows_read)
            s.pages_read.inc(c.pages_read)
            s.evictions.inc(c.evictions)
            if c.padded:
                s.padded.inc(c.padded)
            if c.out_of_table:
                s.out_of_table.inc(c.out_of_table)
            s.stall.observe(c.wait_us / 1e6)
            if c.pages_read:
                s.read.observe(c.read_us / 1e6)

    def error(self, exc: BaseException) -> None:
        """Count an error the engine is about to raise."""
        kind = getattr(exc, "kind", None)
        layer = getattr(exc, "layer", None)
        lab = self._labels.get(layer) if layer is not None else None
        rank = lab.values()[2] if lab is not None else "all"
        self._fam.errors.labels(getattr(kind, "value", "internal"), "" if layer is None else str(layer),
                                rank).inc()


def check_multiproc_dir() -> None:
    """Refuse (BAD_INPUT) a PROMETHEUS_MULTIPROC_DIR that is not a writable folder, before a step writes there.

    prometheus_client would otherwise fail deep inside the first step's counter update (a missing folder, a
    file, a read-only folder)."""
    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not path:
        return
    fix = "point PROMETHEUS_MULTIPROC_DIR at an empty folder this process can write, or unset it"
    if not os.path.isdir(path):
        what = "is a file" if os.path.exists(path) else "does not exist"
        raise SlackTierError(ErrorKind.BAD_INPUT, f"PROMETHEUS_MULTIPROC_DIR {path} {what}", fix=fix)
    if not os.access(path, os.W_OK | os.X_OK):
        raise SlackTierError(ErrorKind.BAD_INPUT, f"PROMETHEUS_MULTIPROC_DIR {path} is not writable", fix=fix)


def check_metrics_address(addr: str, port: int) -> None:
    """Refuse (BAD_INPUT) a metrics address that is not an IP address ("127.0.0.1", "::1", "0.0.0.0" for every
    interface, or "localhost"), or a port outside 0..65535 (0: the kernel picks one)."""
    if not isinstance(addr, str):   # ipaddress would take an int (2130706433 is 127.0.0.1); the server would not
        raise SlackTierError(ErrorKind.BAD_INPUT, f"metrics address {addr!r} is a {type(addr).__name__}, not a "
                             "string", fix="pass the address as a string, e.g. addr='127.0.0.1' (the default), or "
                             "'0.0.0.0' to serve every interface")
    try:
        if addr != "localhost":
            ipaddress.ip_address(addr)
    except ValueError:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"metrics address {addr!r} is not an IP address",
                             fix="pass an address of this host, e.g. --metrics-addr 127.0.0.1 (the default), or "
                                 "0.0.0.0 to serve every interface") from None
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"metrics port {port!r} is outside 0..65535",
                             fix="pass a free TCP port, e.g. --metrics-port 9400")


def serve_metrics(port: int, addr: str = "127.0.0.1", registry: CollectorRegistry | None = None) -> tuple:
    """Serve /metrics over HTTP on `addr`:`port` in a daemon thread; returns (server, thread).

    Loopback only by default: metrics say which tables a node serves and how fast, so another interface
    ("0.0.0.0": every one) is the caller's explicit choice. A bad address or port is BAD_INPUT; one that
    cannot be bound (in use, not this host's) is UNAVAILABLE.
    With PROMETHEUS_MULTIPROC_DIR set and no `registry`, it serves the sum over every process writing
    to that folder (prometheus_client's MultiProcessCollector), so one rank can export all ranks.
    """
    check_metrics_address(addr, port)
    if registry is None and os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
    try:
        return start_http_server(port, addr=addr, registry=REGISTRY if registry is None else registry)
    except OSError as exc:
        raise SlackTierError(ErrorKind.UNAVAILABLE, f"cannot serve metrics on {addr} port {port}: "
                             f"{exc.strerror or exc}", fix="pick a free port, or an address of this host") from None
