"""A run record (slacktier.serve.runs.RunRecord) as plain JSON data and back, for the harness's results files."""

from __future__ import annotations

import dataclasses
from typing import Any

from slacktier.serve.runs import LayerStats, RunRecord


def record_to_json(rec: RunRecord) -> dict[str, Any]:
    """Plain data for JSON (layer keys become strings there)."""
    return dataclasses.asdict(rec)


def record_from_json(doc: dict[str, Any]) -> RunRecord:
    """The record `record_to_json` wrote, after a JSON round trip (layer keys back to ints)."""
    d = dict(doc)
    d["layers"] = {int(l): LayerStats(**v) for l, v in d.get("layers", {}).items()}
    d["step_reads_ms"] = [{int(l): float(v) for l, v in st.items()} for st in d.get("step_reads_ms", [])]
    d["delays_ms"] = {int(l): float(v) for l, v in d.get("delays_ms", {}).items()}
    return RunRecord(**d)
