"""`PleCheckpointSource`: a Qwen3.8 (transformers' `Qwen4Exp`) checkpoint's per-layer n-gram tables, by their own names.

Where the rows are: per PLE decoder layer L (0-indexed, the `N` of
`model.layers.N.ple` that control files key a PLE table by), the checkpoint holds
`model.language_model.layers.L.ple.ple_embedding.ngram_embedding.shard_I.weight`,
I = 0, 1, ... (transformers' `save_pretrained` layout, `split_ngram_parts`
shards; SGLang and vLLM load these), or one unsharded `...ngram_embedding.weight`;
`model.layers.L...` and `layers.L...` spellings are accepted too. Each is fp8 E4M3
[rows, 256]. The per-tensor `weight_scale` is not staged: it stays the
engine's, applied by its own code after the gather (adapters.sglang_ple's
module docstring), so every staged row carries E8M0 block scales 0x7F (2^0).

The padding SGLang applies: the table holds the sum of the layer's 16 head
sizes (`PleLayout.rows`), padded up to a multiple of
`make_ngram_vocab_size_divisible_by` (`PleLayout.padded_rows`), and SGLang's
loader places shard I at row I * ceil(padded_rows / split_ngram_parts). The
shards must tile exactly those padded rows; the padding rows past
`PleLayout.rows` are never hashed to and are not staged. The head sizes come
from the model's `config.json` (its `text_config`: `ngram_vocab_size_base`,
`ple_layer_ids`, `vocab_size`, `eos_token_id`, `ngram_size`, `heads_per_ngram`,
`seed`, `make_ngram_vocab_size_divisible_by`, `split_ngram_parts`), found
beside the checkpoint files; PLE layer index k of layer L is L + 1's position
in the sorted one-indexed `ple_layer_ids`.

Worked example: padded_rows 16,896 and split_ngram_parts 4 -> shard size
4,224; row 9,000 is row 552 of shard 2.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.tables.checkpoint_source import _checkpoint_files, _opened, _pack_pages, _pack_pages_crc, \
    _pread_rows, _TensorInfo, checkpoint_tensors, files_digest, header_entry
from slacktier.tables.identity import source_identity
from slacktier.tables.layout import ROW_BYTES, ROW_SCALES, ROW_VALUES
from slacktier.tables.manifest import StagedLayout
from slacktier.tables.pagecrc import HW_CRC32C, page_crcs
from slacktier.tables.ple_hash import PleLayout

FORMAT = "qwen4exp-ple"
UNIT_SCALE = 0x7F   # E8M0 2^0: the engine returns bf16(v), the engine's per-tensor scale is applied after
PLE_ROWS = re.compile(r"(?:model\.(?:language_model\.)?)?layers\.(\d+)\.ple\.ple_embedding\.ngram_embedding\."
                      r"(?:shard_(\d+)\.)?weight")


def ple_tensor_names(names: list[str]) -> dict[int, dict[int | None, str]]:
    """Decoder layer -> {shard index (None: unsharded) -> tensor name} of a checkpoint's PLE row tensors."""
    out: dict[int, dict[int | None, str]] = {}
    for name in names:
        m = PLE_ROWS.fullmatch(name)
        if m is not None:
            shard = int(m.group(2)) if m.group(2) is not None else None
            out.setdefault(int(m.group(1)), {})[shard] = name
    return out


def _config_for(files: list[str], config: str | Path | None) -> tuple[Path, dict[str, Any]]:
    """(path, text config) of the model's config.json: `config`, else beside the first checkpoint file."""
    path = Path(config) if config is not None else Path(files[0]).parent / "config.json"
    fix = "stage from the model's directory, which holds its config.json beside the safetensors files"
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise SlackTierError(ErrorKind.MISSING, f"{path} is missing: a Qwen4Exp PLE table's head sizes come from "
                             "the model's config", fix=fix) from None
    except (OSError, ValueError) as exc:
        raise SlackTierError(ErrorKind.CHECKPOINT, f"cannot read the model config {path}: {exc}", fix=fix) from None
    if not isinstance(doc, dict):
        raise SlackTierError(ErrorKind.CHECKPOINT, f"{path} is not a JSON object", fix=fix)
    text = doc.get("text_config", doc)
    return path, text if isinstance(text, dict) else doc


def ple_layout_of(text: dict[str, Any], layer: int, where: str) -> tuple[PleLayout, int]:
    """(PleLayout of decoder layer `layer`, split_ngram_parts) from a Qwen4Exp text config."""
    ids = sorted({int(i) for i in text.get("ple_layer_ids") or []})
    if layer + 1 not in ids:
        raise SlackTierError(ErrorKind.CHECKPOINT, f"the checkpoint has PLE rows for decoder layer {layer}, but "
                             f"{where}'s ple_layer_ids (one-indexed) are {ids}", layer=layer,
                             fix="stage with the config.json of the model the checkpoint belongs to")
    eos = text.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) else eos
    try:
        layout = PleLayout.scaled(int(text.get("ngram_vocab_size_base", 20_000_000)),
                                  vocab_size=int(text["vocab_size"]), eos_token_id=int(eos),
                                  ngram_size=int(text.get("ngram_size", 3)),
                                  heads_per_ngram=int(text.get("heads_per_ngram", 8)),
                                  ple_layer_index=ids.index(layer + 1), seed=int(text.get("seed", 1234)),
                                  divisible_by=int(text.get("make_ngram_vocab_size_divisible_by", 128)), layer_id=layer)
    except (KeyError, TypeError, ValueError) as exc:
        raise SlackTierError(ErrorKind.CHECKPOINT, f"{where} lacks a PLE setting the hash needs ({exc!r})",
                             layer=layer, fix="stage with the model's own config.json") from None
    return layout, int(text.get("split_ngram_parts", 512))


class PleCheckpointSource:
    """A Qwen4Exp checkpoint's PLE tables (see the module docstring), read through memory maps (nothing loaded whole).

    `layers` None takes every decoder layer with PLE row tensors. Digest: as CheckpointSource's (sha256 of the
    files holding the tables).
    """

    kind = "checkpoint"

    def __init__(self, checkpoint: str | Path | list[str | Path], layers: list[int] | None = None,
                 config: str | Path | None = None) -> None:
        self.files = _checkpoint_files(checkpoint)
        tensors = checkpoint_tensors(self.files)
        found = ple_tensor_names(list(tensors))
        if not found:
            raise SlackTierError(ErrorKind.CHECKPOINT, f"no PLE table tensor (...layers.L.ple.ple_embedding."
                                 f"ngram_embedding.shard_I.weight) in {', '.join(self.files)}",
                                 fix="pass the Qwen4Exp checkpoint that holds the PLE tables")
        self.config_path, text = _config_for(self.files, config)
        layers = sorted(found) if layers is None else list(layers)
        self.layouts: dict[int, PleLayout] = {}
        self.names: dict[int, list[str]] = {}
        self._segments: dict[int, list[tuple[int, _TensorInfo, np.ndarray]]] = {}   # (first row, tensor, map)
        for layer in layers:
            if layer not in found:
                raise SlackTierError(ErrorKind.CHECKPOINT, f"the checkpoint has no PLE table for decoder layer "
                                     f"{layer} (it has layers {sorted(found)})", layer=layer,
                                     fix="pick --layers among the checkpoint's PLE layers")
            layout, parts = ple_layout_of(text, layer, str(self.config_path))
            self.layouts[layer] = layout
            self._segments[layer] = self._tile(layer, found[layer], tensors, layout, parts)
            self.names[layer] = [name for _, name in sorted(found[layer].items(), key=lambda kv: kv[0] or 0)]
        self.layout = StagedLayout({layer: lay.rows for layer, lay in self.layouts.items()},
                                   {layer: lay.column_bounds() for layer, lay in self.layouts.items()})
        self._files_used = sorted({s[1].file for segs in self._segments.values() for s in segs})
        self._digest: str | None = None
        self._unit = np.full((0, ROW_SCALES), UNIT_SCALE, dtype=np.uint8)

    @staticmethod
    def _tile(layer: int, shards: dict[int | None, str], tensors: dict[str, _TensorInfo], layout: PleLayout,
              parts: int) -> list[tuple[int, _TensorInfo, np.ndarray]]:
        """The layer's row tensors as (first row, tensor, memory map), checked to tile the padded table exactly as
        SGLang's loader places them."""
        padded = layout.padded_rows
        fix = "re-download or re-save the checkpoint (transformers' save_pretrained writes the shards)"
        if None in shards and len(shards) > 1:
            raise SlackTierError(ErrorKind.CHECKPOINT, f"decoder layer {layer} has both an unsharded PLE table and "
                                 f"shards", layer=layer, fix=fix)
        size = padded if None in shards else -(-padded // parts)
        want = 1 if None in shards else -(-padded // size)
        if None not in shards and sorted(shards) != list(range(want)):
            missing = sorted(set(range(want)) - set(shards))[:5]
            extra = sorted(set(shards) - set(range(want)))[:5]
            raise SlackTierError(ErrorKind.CHECKPOINT, f"decoder layer {layer}'s PLE table of {padded} padded rows "
                                 f"in {parts} parts is {want} shards of {size} rows; missing shards {missing}, "
                                 f"unexpected shards {extra}", layer=layer, fix=fix)
        out = []
        for shard, name in sorted(shards.items(), key=lambda kv: kv[0] or 0):
            info = tensors[name]
            start = 0 if shard is None else shard * size
            rows = min(size, padded - start)
            if info.dtype != "F8_E4M3":
                raise SlackTierError(ErrorKind.CHECKPOINT, f"tensor {name} in {info.file} is {info.dtype}: "
                                     "SlackTier's rows are fp8 E4M3 (a bf16 row has no exact fp8 form)",
                                     layer=layer, fix="stage an fp8 PLE checkpoint (ple_embedding_dtype = "
                                     "\"float8_e4m3fn\")")
            if info.shape != (rows, ROW_VALUES):
                raise SlackTierError(ErrorKind.CHECKPOINT, f"tensor {name} in {info.file} has shape "
                                     f"{list(info.shape)}, want [{rows}, {ROW_VALUES}] (rows {start}.."
                                     f"{start + rows - 1} of the {padded} padded rows; head rows of "
                                     f"{ROW_VALUES} values)", layer=layer,
                                     fix="check the model's config.json (ngram_vocab_size_base, ple_layer_ids, "
                                     "split_ngram_parts, ple_embed_dim = 16 x 256) against the checkpoint")
            out.append((start, info, np.memmap(info.file, dtype=np.uint8, mode="r", offset=info.offset_bytes,
                                               shape=(rows, ROW_VALUES))))
        return out

    @property
    def digest(self) -> str:
        """sha256 of the checkpoint file(s) holding the tables (as CheckpointSource's)."""
        if self._digest is None:
            self._digest = files_digest(self._files_used)
        return self._digest

    def spec(self) -> dict[str, Any]:
        """The manifest's "source" object: files, config, tensor names and identity (tables.identity)."""
        headers = {layer: {"weight": [header_entry(name, s[1]) for name, s in zip(self.names[layer], segs)]}
                   for layer, segs in self._segments.items()}
        return {"kind": self.kind, "format": FORMAT, "digest": self.digest, "files": self._files_used,
                "config": str(self.config_path),
                "tensors": {str(k): v for k, v in sorted(self.names.items())},
                "identity": source_identity(self, has_scales=False, tensors=headers,
                                            tensor_rows={k: lay.padded_rows for k, lay in self.layouts.items()})}

    def _values(self, layer: int, row_start: int, rows: int) -> np.ndarray:
        """Rows [row_start, row_start + rows) of the layer's values [rows, 256] uint8: a view within one shard,
        else a copy across shards."""
        end = row_start + rows
        parts = [(max(row_start, s), min(end, s + m.shape[0]), s, m) for s, _, m in self._segments[layer]
                 if s < end and row_start < s + m.shape[0]]
        if len(parts) == 1:
            lo, hi, s, m = parts[0]
            return m[lo - s:hi - s]
        out = np.empty((rows, ROW_VALUES), dtype=np.uint8)
        for lo, hi, s, m in parts:
            out[lo - row_start:hi - row_start] = m[lo - s:hi - s]
        return out

    def fill_pages(self, layer: int, row_start: int, rows: int, pages: np.ndarray,
                   crcs: np.ndarray | None = None) -> None:
        """Fill pages [P = ceil(rows/15), 4096] uint8 with rows [row_start, row_start + rows) (unit block scales),
        and their CRC32Cs into `crcs` [P] uint32 if given."""
        weight = self._values(layer, row_start, rows)
        if self._unit.shape[0] < rows:
            self._unit = np.full((rows, ROW_SCALES), UNIT_SCALE, dtype=np.uint8)
        scale = self._unit[:rows]
        if crcs is not None and HW_CRC32C:
            _pack_pages_crc(weight, scale, pages, crcs)
            return
        _pack_pages(weight, scale, pages)
        if crcs is not None:
            page_crcs(pages, crcs)

    def rows(self, layer: int, row_ids: np.ndarray) -> np.ndarray:
        """Rows `row_ids` [n] of `layer` -> raw [n, 264] uint8 (values read with pread, unit block scales)."""
        ids = np.asarray(row_ids, dtype=np.int64)
        uniq, where = np.unique(ids, return_inverse=True)
        if uniq.shape[0] and not (0 <= uniq[0] and uniq[-1] < self.layout.rows[layer]):
            raise SlackTierError(ErrorKind.BAD_INPUT, f"rows outside the PLE table's 0..{self.layout.rows[layer] - 1}",
                                 layer=layer, fix="ask for rows of the table")
        got = np.full((uniq.shape[0], ROW_BYTES), UNIT_SCALE, dtype=np.uint8)
        for start, info, m in self._segments[layer]:
            lo, hi = np.searchsorted(uniq, [start, start + m.shape[0]])
            if hi == lo:
                continue
            local = uniq[lo:hi] - start
            cuts = np.flatnonzero(np.diff(local) != 1) + 1
            with _opened(info.file) as fd:
                for a, b in zip([0, *cuts.tolist()], [*cuts.tolist(), local.shape[0]]):
                    got[lo + a:lo + b, :ROW_VALUES] = _pread_rows(fd, info, ROW_VALUES, int(local[a]), b - a, layer)
        return got[where.reshape(-1)]


__all__ = ["FORMAT", "PLE_ROWS", "PleCheckpointSource", "ple_layout_of", "ple_tensor_names"]
