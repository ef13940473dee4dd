"""Small things a first-hour user notices: `stage --only-ranks ''` is refused, a non-string metrics address is
refused in one line, and the engine's Prometheus counters export no `_created` series. Each fails on the
code before them (the empty flag staged every rank; the int address raised TypeError; every counter and
histogram label set had a `_created` series)."""

from __future__ import annotations

import socket
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest

from slacktier import cli
from slacktier.cache import RowCache
from slacktier.engine.metrics import EngineMetrics, serve_metrics
from slacktier.engine.step import StepEngine
from slacktier.errors import ErrorKind, SlackTierError
from slacktier.tables.engram_hash import EngramLayout
from slacktier.testing.engine import array_tables, real_token_ids

LAYOUT = EngramLayout.scaled(2000)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("only", ["", " ", ","])
def test_stage_refuses_an_only_ranks_that_names_no_rank_and_writes_nothing(tmp_path, capsys, only):
    target = tmp_path / "t.bin"
    rc = cli.main(["stage", "--engram", "300", "--ranks", "4", "--only-ranks", only, "--target", str(target),
                   "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert "--only-ranks" in err and "Traceback" not in err
    assert not target.exists() and not list(tmp_path.iterdir())


def test_stage_with_one_named_rank_still_stages_that_rank_only(tmp_path, capsys):
    """The control: a real --only-ranks is honoured (the refusal above is of the empty value alone)."""
    target = tmp_path / "t.bin"
    assert cli.main(["stage", "--engram", "300", "--ranks", "4", "--only-ranks", "3", "--target", str(target),
                     "--no-progress"]) == 0
    from slacktier.tables.manifest import Manifest
    regions = Manifest.load(f"{target}.manifest.json").regions
    assert regions and {r.rank for r in regions} == {3}


@pytest.mark.parametrize("addr", [2130706433, b"127.0.0.1", None])
def test_serve_metrics_refuses_a_non_string_address_in_one_line(addr):
    with pytest.raises(SlackTierError) as exc:
        serve_metrics(_free_port(), addr=addr, registry=CollectorRegistry())
    assert exc.value.kind is ErrorKind.BAD_INPUT
    assert "not a string" in exc.value.message and "addr='127.0.0.1'" in exc.value.fix


def test_engine_metrics_have_no_created_series_and_keep_their_values():
    registry = CollectorRegistry()
    rows = {layer: LAYOUT.rows(i) for i, layer in enumerate(LAYOUT.layer_ids)}
    tables, _, _ = array_tables(rows, cache_shares={1: 0.6, 14: 0.4})
    engine = StepEngine(tables, RowCache(3000), max_tokens=64, metrics=EngineMetrics(registry=registry))
    try:
        engine.begin_step(real_token_ids(16, LAYOUT))
        for layer in engine.layers:
            engine.gather(layer)
        engine.end_step()
    finally:
        engine.close()
    text = generate_latest(registry).decode()
    assert "slacktier_lookups_total{" in text and "slacktier_gather_stall_seconds_bucket{" in text
    assert "_created" not in text, [line for line in text.splitlines() if "_created" in line][:3]
    lookups = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  if line.startswith("slacktier_lookups_total{"))
    assert lookups == 16 * 24 * len(LAYOUT.layer_ids)


def test_prometheus_client_here_does_export_created_series():
    """The negative control: a plain counter in this environment has a `_created` series, so the check above
    can fail."""
    registry = CollectorRegistry()
    Counter("plain", "a plain counter", registry=registry).inc()
    assert "plain_created" in generate_latest(registry).decode()


def test_served_metrics_have_no_created_series():
    registry = CollectorRegistry()
    metrics = EngineMetrics(registry=registry)
    metrics.error(SlackTierError(ErrorKind.IO, "x"))
    server, _ = serve_metrics(_free_port(), registry=registry)
    try:
        port = server.server_address[1]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
    finally:
        server.shutdown()
        server.server_close()
    assert 'slacktier_errors_total{kind="io"' in text and "_created" not in text
