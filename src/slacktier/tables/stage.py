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
from typing import TYPE_CHECKING, Any

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.tables.checkpoint_source import CHECKPOINT_NAME_TEMPLATES, CheckpointSource, _checkpoint_files, \
    checkpoint_tensors
from slacktier.tables.manifest import Manifest, StagedLayout
from slacktier.tables.page_writer import DEFAULT_CHUNK_BYTES, DEFAULT_FILLERS, DEFAULT_WRITERS, StageStats, \
    check_targets, stage_table
from slacktier.tables.ple_checkpoint_source import FORMAT as PLE_FORMAT
from slacktier.tables.ple_checkpoint_source import PleCheckpointSource, ple_tensor_names
from slacktier.tables.row_source import RowSource
from slacktier.tables.synthetic_source import SYNTHETIC_GENERATOR, SyntheticSource, layer_seed
from slacktier.tables.table_layout import TableLayout

if TYPE_CHECKING:
    from slacktier.tables.engram_hash import EngramLayout

__all__ = ["CHECKPOINT_NAME_TEMPLATES", "CONFIG_NAME", "CheckpointSource", "DEFAULT_CHUNK_BYTES", "DEFAULT_FILLERS",
           "DEFAULT_WRITERS", "PleCheckpointSource", "RowSource", "SYNTHETIC_GENERATOR", "StageStats",
           "SyntheticSource", "check_targets", "config_beside", "is_ple_checkpoint", "layer_seed",
           "layout_from_model_config", "source_from_manifest", "stage_checkpoint", "stage_synthetic", "stage_table",
           "staged_layout"]


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
        if layers is None:   # the layout's layers, each of which the checkpoint must hold
            layers = list(exp.layer_ids)
        column_bounds = {k: v for k, v in exp.column_bounds.items() if k in layers}
    bounds = {int(k): tuple(int(x) for x in v) for k, v in (column_bounds or {}).items()}
    source = CheckpointSource(checkpoint, layers=layers, column_bounds=bounds, expected=exp)
    return stage_table(source, targets, ranks, overwrite=overwrite, **kwargs)


def is_ple_checkpoint(checkpoint: str | Path | list[str | Path]) -> bool:
    """Whether a checkpoint holds Qwen4Exp PLE row tensors and no Engram table (its headers only are read)."""
    names = list(checkpoint_tensors(_checkpoint_files(checkpoint)))
    return bool(ple_tensor_names(names)) and not any(n.endswith("engram.embed.weight") for n in names)


#: a model config's Engram keys, as SGLang's and vLLM's EngramLayout read them
_CONFIG_KEYS = ("engram_layer_ids", "engram_num_embeddings", "engram_max_ngram_size", "engram_n_heads",
                "engram_vocab_size")
CONFIG_NAME = "config.json"


def config_beside(checkpoint: str | Path | list[str | Path]) -> Path | None:
    """The model's config.json in the checkpoint's directory (the first path's, or that file's folder), if any."""
    first = Path(checkpoint[0] if isinstance(checkpoint, list) else checkpoint)
    found = (first if first.is_dir() else first.parent) / CONFIG_NAME
    return found if found.is_file() else None


def layout_from_model_config(path: str | Path) -> EngramLayout:
    """The Engram hash layout a model's config.json gives, as the serving engines build it (their
    `EngramLayout.from_config`): engram_* keys at the top level or in "text_config" (top level wins, as SGLang's
    DeepSeek-V4.1 config normalises it). Refused: no Engram keys, and table sizes that are not the primes' sums
    (SGLang asserts the same)."""
    import json

    from slacktier.tables.engram_hash import (V41_COMPRESSED_VOCAB, V41_ENGRAM_VOCAB_SIZE, V41_LAYER_IDS,
                                              V41_MAX_NGRAM, V41_N_HEADS, V41_PAD_TOKEN_ID, EngramLayout)

    p = Path(path)
    fix = "pass the model's own config.json (DeepSeek-V4.1: engram_layer_ids, engram_vocab_size, ...), or --engram v41"
    try:
        d = json.loads(p.read_text(encoding="utf-8"))
    except OSError as exc:
        raise SlackTierError(ErrorKind.MISSING, f"cannot read model config {p}: {exc.strerror}", fix=fix) from None
    except ValueError as exc:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"model config {p} is not JSON: {exc}", fix=fix) from None
    if not isinstance(d, dict):
        raise SlackTierError(ErrorKind.BAD_INPUT, f"model config {p} is not a JSON object", fix=fix)
    text = d.get("text_config")
    values = {**text, **d} if isinstance(text, dict) else d
    missing = [k for k in _CONFIG_KEYS if k not in values]
    if missing:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"model config {p} has no {', '.join(missing)}: not an Engram "
                             "model's config", fix=fix)
    try:
        layer_ids = tuple(int(x) for x in values["engram_layer_ids"])
        rows = tuple(int(x) for x in values["engram_num_embeddings"])
        shape = (int(values["engram_max_ngram_size"]), int(values["engram_n_heads"]),
                 int(values["engram_vocab_size"]))
        compressed = int(values.get("engram_compressed_vocab_size") or V41_COMPRESSED_VOCAB)
        pad = int(values.get("engram_pad_token_id", V41_PAD_TOKEN_ID))
    except (TypeError, ValueError) as exc:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"model config {p}: an engram_* value is not an integer ({exc})",
                             fix=fix) from None
    if (layer_ids, shape, compressed, pad) == (V41_LAYER_IDS, (V41_MAX_NGRAM, V41_N_HEADS, V41_ENGRAM_VOCAB_SIZE),
                                                V41_COMPRESSED_VOCAB, V41_PAD_TOKEN_ID):
        layout = EngramLayout.v41()
    else:
        layout = EngramLayout.scaled(shape[2], layer_ids, n_heads=shape[1], max_ngram=shape[0],
                                     compressed_vocab=compressed, pad_token_id=pad)
    if rows != layout.rows_per_layer:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"model config {p}: engram_num_embeddings {list(rows)} are not "
                             f"the sums of its hash primes, {list(layout.rows_per_layer)}", fix=fix)
    return layout


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
