"""Staging entry points: a seeded synthetic table or a safetensors checkpoint onto files or raw block devices.

The work is split by role: the row sources (tables.synthetic_source,
tables.checkpoint_source, behind tables.row_source.RowSource) fill pages, and
the page writer (tables.page_writer) checks the targets, writes the header
pages and regions O_DIRECT with several writes in flight, then the checksum
file and the manifest. This module wires them together and rebuilds a
manifest's source for verification; the names callers use are re-exported here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.tables.checkpoint_source import CHECKPOINT_NAME_TEMPLATES, CheckpointSource, _checkpoint_files, \
    _read_safetensors_header
from slacktier.tables.manifest import Manifest, StagedLayout
from slacktier.tables.page_writer import DEFAULT_CHUNK_BYTES, DEFAULT_FILLERS, DEFAULT_WRITERS, StageStats, \
    check_targets, stage_table
from slacktier.tables.ple_checkpoint_source import FORMAT as PLE_FORMAT
from slacktier.tables.ple_checkpoint_source import PleCheckpointSource, ple_tensor_names
from slacktier.tables.row_source import RowSource
from slacktier.tables.synthetic_source import SYNTHETIC_GENERATOR, SyntheticSource, layer_seed
from slacktier.tables.table_layout import TableLayout

__all__ = ["CHECKPOINT_NAME_TEMPLATES", "DEFAULT_CHUNK_BYTES", "DEFAULT_FILLERS", "DEFAULT_WRITERS",
           "SYNTHETIC_GENERATOR", "CheckpointSource", "PleCheckpointSource", "RowSource", "StageStats",
           "SyntheticSource", "check_targets", "is_ple_checkpoint", "layer_seed", "source_from_manifest",
           "stage_checkpoint", "stage_synthetic", "stage_table", "staged_layout"]


def staged_layout(layout: StagedLayout | TableLayout | Mapping[int, int],
                  column_bounds: Mapping[int, Sequence[int]] | None = None) -> StagedLayout:
    """The StagedLayout of a layout record, a TableLayout (EngramLayout, PleLayout), or `{layer_id: rows}`.

    `column_bounds` goes with `{layer_id: rows}` only: a layout carries its own.
    """
    if isinstance(layout, Mapping):
        return StagedLayout.from_rows(layout, column_bounds)
    if column_bounds is not None:
        raise SlackTierError(ErrorKind.BAD_INPUT, "column_bounds given with a layout that has its own",
                             fix="pass column_bounds only with {layer_id: rows}")
    if isinstance(layout, StagedLayout):
        return layout
    return StagedLayout.from_layout(layout)


def stage_synthetic(targets: list[str | Path], layout: StagedLayout | TableLayout | Mapping[int, int], ranks: int,
                    seed: int, column_bounds: Mapping[int, Sequence[int]] | None = None, overwrite: bool = False,
                    **kwargs: Any) -> Manifest:
    """Stage a seeded synthetic table of `layout` (see `staged_layout`); returns the saved manifest.

    kwargs go to `stage_table` (manifest_path, max_bytes, chunk_bytes, buffered, progress, fillers, writers, stats).
    """
    return stage_table(SyntheticSource(staged_layout(layout, column_bounds), seed), targets, ranks,
                       overwrite=overwrite, **kwargs)


def stage_checkpoint(checkpoint: str | Path | list[str | Path], targets: list[str | Path], ranks: int,
                     layers: list[int] | None = None, column_bounds: Mapping[int, Sequence[int]] | None = None,
                     overwrite: bool = False, expected: StagedLayout | TableLayout | Mapping[int, int] | None = None,
                     **kwargs: Any) -> Manifest:
    """Stage a safetensors checkpoint's Engram tables, or a Qwen4Exp checkpoint's PLE tables (all layers found, or
    `layers`; a checkpoint with PLE row tensors and no Engram ones is read by tables.ple_checkpoint_source).

    `expected` (see `staged_layout`) refuses a checkpoint whose row counts differ
    and, unless `column_bounds` is given, supplies the column bounds. kwargs go
    to `stage_table`.
    """
    if is_ple_checkpoint(checkpoint):
        if column_bounds is not None:
            raise SlackTierError(ErrorKind.BAD_INPUT, "column_bounds given for a Qwen4Exp PLE checkpoint, whose "
                                 "head sizes come from its config.json", fix="drop column_bounds")
        ple = PleCheckpointSource(checkpoint, layers=layers)
        if expected is not None and staged_layout(expected).rows != ple.layout.rows:
            raise SlackTierError(ErrorKind.CHECKPOINT, f"the PLE tables have rows {ple.layout.rows}, the layout "
                                 f"expects {staged_layout(expected).rows}", fix="check the layout against the "
                                 "checkpoint and its config.json")
        return stage_table(ple, targets, ranks, overwrite=overwrite, **kwargs)
    exp = staged_layout(expected) if expected is not None else None
    if exp is not None and column_bounds is None:
        column_bounds = exp.column_bounds
    bounds = {int(k): tuple(int(x) for x in v) for k, v in (column_bounds or {}).items()}
    source = CheckpointSource(checkpoint, layers=layers, column_bounds=bounds, expected=exp)
    return stage_table(source, targets, ranks, overwrite=overwrite, **kwargs)


def is_ple_checkpoint(checkpoint: str | Path | list[str | Path]) -> bool:
    """Whether a checkpoint holds Qwen4Exp PLE row tensors and no Engram table (its headers only are read)."""
    names: list[str] = []
    for f in _checkpoint_files(checkpoint):
        names += list(_read_safetensors_header(f))
    return bool(ple_tensor_names(names)) and not any(n.endswith("engram.embed.weight") for n in names)


def source_from_manifest(manifest: Manifest, checkpoint: str | Path | list[str | Path] | None = None) -> RowSource:
    """Rebuild the row source a manifest was staged from (`checkpoint` overrides the recorded files)."""
    src = manifest.source
    if src["kind"] == "synthetic":
        if src.get("generator") != SYNTHETIC_GENERATOR:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"synthetic generator {src.get('generator')} is not "
                                 f"{SYNTHETIC_GENERATOR}", fix="restage the table with this version")
        return SyntheticSource(manifest.layout, int(src["seed"]))
    if src["kind"] == "checkpoint" and src.get("format") == PLE_FORMAT:
        return PleCheckpointSource(checkpoint if checkpoint is not None else list(src["files"]),
                                   layers=list(manifest.layout.layer_ids),
                                   config=None if checkpoint is not None else src.get("config"))
    if src["kind"] == "checkpoint":
        return CheckpointSource(checkpoint if checkpoint is not None else list(src["files"]),
                                layers=list(manifest.layout.layer_ids), column_bounds=manifest.layout.column_bounds,
                                expected=manifest.layout)
    raise SlackTierError(ErrorKind.BAD_INPUT, f"unknown source kind {src['kind']!r}", fix="restage the table")
