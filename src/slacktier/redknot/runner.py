"""Layer-by-layer DeepSeek-V4 prefill with the model's own modules: full recompute or RedKnot reuse.

The runner walks `DeepseekV4ForCausalLM`'s decoder layers itself, calling the
model's hyper-connections, norms, projections, compressor/indexer and MoE
modules; only the attention core is ours, computed per head over segments
(attention.py) so Local heads can be skipped row by row. With
`indexer_chunk_rows` set, CSA layers use indexer.csa_select (the same entries
and picks, scored a chunk of rows at a time) so 64K-row prefills fit in
memory. In full mode with one frame it equals the model's forward
(tests/test_redknot_exact.py).

Reuse mode, per reusable layer:
  z = wo_a[Global](attn_Global(all rows))                      # online
    + where(protected, wo_a[Local](attn_Local(protected rows)),  # online, replaces
            z_off)                                              # offline artifact
  out = wo_b(z)                                                 # one shared projection
Every document is its own RoPE frame (its rows' latents rotated at canonical
positions 0..L-1); queries are rotated into each frame and partials merged.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Protocol

import torch

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.redknot.attention import (
    Partial,
    apply_rope,
    grouped_projection,
    merge_partials,
    rope_tables,
    segment_partial,
    shared_keys_partial,
)
from slacktier.redknot.indexer import csa_select
from slacktier.redknot.profile import HeadPolicy, RedKnotProfile
from slacktier.redknot.protect import ProtectionPolicy, select_protected

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Segment:
    """A document (reusable, has an id) or the query/new text of a request."""

    name: str
    tokens: tuple[int, ...]
    kind: str = "document"  # "document" | "query"

    def __post_init__(self) -> None:
        if self.kind not in ("document", "query"):
            raise SlackTierError(ErrorKind.BAD_INPUT, f"segment kind {self.kind!r}", fix="use document or query")
        if not self.tokens:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"segment {self.name} is empty", fix="drop empty segments")


@dataclass
class Layout:
    """Rows of a request: tokens, true positions, segment of each row, frame offsets."""

    segments: list[Segment]
    tokens: torch.Tensor          # [S] int64
    positions: torch.Tensor       # [S] int64 true positions (0..S-1 + base)
    segment_of_row: torch.Tensor  # [S] int64
    starts: list[int]
    ends: list[int]

    @classmethod
    def of(cls, segments: list[Segment], base_position: int = 0) -> Layout:
        """Concatenate segments in order."""
        starts, ends, seg_ids, toks = [], [], [], []
        row = 0
        for i, seg in enumerate(segments):
            starts.append(row)
            row += len(seg.tokens)
            ends.append(row)
            seg_ids += [i] * len(seg.tokens)
            toks += list(seg.tokens)
        return cls(list(segments), torch.tensor(toks, dtype=torch.long),
                   torch.arange(row, dtype=torch.long) + base_position,
                   torch.tensor(seg_ids, dtype=torch.long), starts, ends)

    @property
    def rows(self) -> int:
        """Number of rows S."""
        return int(self.tokens.numel())

    def frame_offsets(self, per_segment: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(frame id of each row [S], frame offset of each frame [F]): one frame, or one per segment."""
        if not per_segment:
            return torch.zeros_like(self.segment_of_row), self.positions[:1].clone()
        return self.segment_of_row, self.positions[torch.tensor(self.starts, dtype=torch.long)]

    def query_rows(self) -> torch.Tensor:
        """Rows of query segments [q] int64."""
        rows = [torch.arange(s, e) for seg, s, e in zip(self.segments, self.starts, self.ends) if seg.kind == "query"]
        return torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long)


class LocalSource(Protocol):
    """Where a reuse run gets stored Local-head contributions from."""

    has_artifact: torch.Tensor  # [S] bool: rows covered by a valid artifact

    def layer(self, layer: int) -> torch.Tensor | None:
        """z_off [S, G*R] for `layer` (rows without an artifact: any value), or None if unusable."""


@dataclass
class InMemoryLocal:
    """A LocalSource over tensors already in memory (tests, poisoning experiments)."""

    has_artifact: torch.Tensor
    layers: dict[int, torch.Tensor]

    def layer(self, layer: int) -> torch.Tensor | None:
        """The stored z_off of `layer`."""
        return self.layers.get(layer)


@dataclass
class RunStats:
    """What one prefill did: the reuse work counters a fallback must keep at zero."""

    mode: str = "full"
    fallback_reason: str | None = None
    head_rows_total: int = 0         # sum over layers of heads * rows
    head_rows_online: int = 0        # of which computed online
    local_rows_reused: int = 0       # (layer, row) pairs served from an artifact
    artifact_layers_used: int = 0
    layers_recomputed: int = 0       # reusable layers whose artifact was unusable (counted, logged)
    relocated_frames: int = 0        # frames other than the first that queries were rotated into
    protected: dict[str, int] = field(default_factory=dict)
    protected_rows: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> rows computed online

    @property
    def reuse_work(self) -> int:
        """Artifact rows consumed plus layers that touched an artifact (0 after a fallback)."""
        return self.local_rows_reused + self.artifact_layers_used

    @property
    def head_row_saving(self) -> float:
        """Fraction of (layer, head, row) attention triples not computed online."""
        return 1.0 - self.head_rows_online / max(self.head_rows_total, 1)


@dataclass
class RunResult:
    """Final hidden state (after hc_head and norm), last-row logits, captures and stats."""

    hidden: torch.Tensor          # [S, D]
    last_logits: torch.Tensor     # [V]
    stats: RunStats
    captured: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> z_local [S, G*R]
    mean_distance: torch.Tensor | None = None  # [L, H]


@dataclass
class _LayerCtx:
    attn: torch.nn.Module
    q_res: torch.Tensor          # [S, q_lora]
    kv_canon: torch.Tensor       # [S, d] latents rotated in their frame
    frame_of_row: torch.Tensor   # [S]
    frame_offset: torch.Tensor   # [F]
    positions: torch.Tensor      # [S]
    rope_type: str
    ckv: torch.Tensor | None     # [T, d] compressed entries (true frame)
    cbias: torch.Tensor | None   # [S, T] 0 / -inf (HCA: causal visibility)
    centry_row: torch.Tensor | None  # [T] last source row of each entry (distances)
    csel: torch.Tensor | None = None       # [S, k] CSA: the indexer's picks per row
    csel_valid: torch.Tensor | None = None  # [S, k] bool


class RedKnotRunner:
    """Prefill a request through a DeepseekV4ForCausalLM in full or reuse mode."""

    def __init__(self, model, profile: RedKnotProfile, policy: HeadPolicy | None = None, *,
                 chunk_rows: int = 256, indexer_chunk_rows: int | None = None) -> None:
        """`indexer_chunk_rows`: None runs the model's own CSA compressor module (it materializes
        [S, index heads, S/4] scores); a row count runs indexer.csa_select, the same picks row-chunked
        (needed past ~24K rows on a 24 GiB machine)."""
        cfg = model.config
        if cfg.num_hidden_layers != profile.num_layers or cfg.num_attention_heads != profile.num_heads \
                or cfg.o_groups != profile.o_groups:
            raise SlackTierError(ErrorKind.BAD_INPUT,
                                 f"profile {profile.name} ({profile.num_layers} layers, {profile.num_heads} heads, "
                                 f"{profile.o_groups} groups) does not fit the model ({cfg.num_hidden_layers}, "
                                 f"{cfg.num_attention_heads}, {cfg.o_groups})", fix="use profile_for_config(config)")
        if cfg._attn_implementation not in (None, "eager"):
            log.info("model attention implementation %s; the runner uses its own per-head core",
                     cfg._attn_implementation)
        self.model = model
        self.config = cfg
        self.profile = profile
        self.policy = policy or profile.default_policy()
        self.chunk_rows = chunk_rows
        self.indexer_chunk_rows = indexer_chunk_rows
        self.heads = cfg.num_attention_heads
        self.head_dim = cfg.head_dim
        self.window = cfg.sliding_window

    # ---- public entry points -------------------------------------------------
    @torch.no_grad()
    def full(self, layout: Layout, *, capture_layers: tuple[int, ...] = (), collect_distance: bool = False
             ) -> RunResult:
        """Full recompute with true positions (one frame); optionally capture Local z per layer."""
        return self._run(layout, local=None, protection=None, dirty=None, per_segment_frames=False,
                         capture_layers=capture_layers, collect_distance=collect_distance)

    @torch.no_grad()
    def reuse(self, layout: Layout, local: LocalSource, protection: ProtectionPolicy,
              dirty: torch.Tensor | None = None) -> RunResult:
        """Reuse mode: Global heads online, Local heads from `local` except on protected rows."""
        return self._run(layout, local=local, protection=protection, dirty=dirty, per_segment_frames=True,
                         capture_layers=(), collect_distance=False)

    @torch.no_grad()
    def layer_attention(self, layer: int, x: torch.Tensor, layout: Layout, *, per_segment_frames: bool,
                        rows: torch.Tensor | None = None, heads: torch.Tensor | None = None) -> torch.Tensor:
        """Attention outputs [n, h, d] (after inverse RoPE, before wo_a) of one layer for input x [S, D]
        (the input_layernorm output); one frame = true positions, per-segment frames = relocation."""
        attn = self.model.model.layers[layer].self_attn
        frame_of_row, frame_offset = layout.frame_offsets(per_segment_frames)
        ctx = self._layer_ctx(attn, x[None], layout.positions[None], layout, frame_of_row, frame_offset)
        rows = torch.arange(layout.rows) if rows is None else rows
        heads = torch.arange(self.heads) if heads is None else heads
        return self._attend(ctx, rows, heads, False)[0]

    # ---- the layer loop --------------------------------------------------------
    def _run(self, layout: Layout, *, local: LocalSource | None, protection: ProtectionPolicy | None,
             dirty: torch.Tensor | None, per_segment_frames: bool, capture_layers: tuple[int, ...],
             collect_distance: bool) -> RunResult:
        m = self.model.model
        dtype = m.embed_tokens.weight.dtype
        S = layout.rows
        ids = layout.tokens[None]  # [1, S]
        stats = RunStats(mode="reuse" if local is not None else "full")
        frame_of_row, frame_offset = layout.frame_offsets(per_segment_frames)
        stats.relocated_frames = max(int(frame_offset.numel()) - 1, 0)
        all_rows = torch.arange(S)
        all_heads = torch.arange(self.heads)
        query_rows = layout.query_rows()
        if dirty is None:
            dirty = torch.zeros(S, dtype=torch.bool)
        doc_starts = [s for seg, s in zip(layout.segments, layout.starts) if seg.kind == "document"]
        doc_ends = [e for seg, e in zip(layout.segments, layout.ends) if seg.kind == "document"]

        embeds = m.embed_tokens(ids)  # [1, S, D]
        h = embeds.unsqueeze(2).expand(-1, -1, self.config.hc_mult, -1).contiguous()  # [1, S, hc, D]
        pos_ids = layout.positions[None]
        captured: dict[int, torch.Tensor] = {}
        distances = torch.zeros(len(m.layers), self.heads, dtype=torch.float64) if collect_distance else None

        for li, layer in enumerate(m.layers):
            post, comb, collapsed = layer.attn_hc(h)
            x = layer.input_layernorm(collapsed)  # [1, S, D]
            ctx = self._layer_ctx(layer.self_attn, x, pos_ids, layout, frame_of_row, frame_offset)
            reuse_here = local is not None and self.profile.is_reusable(li)
            glob = torch.tensor(self.policy.globals_of(li), dtype=torch.long)
            loc = torch.tensor(self.policy.locals_of(li), dtype=torch.long)
            stats.head_rows_total += self.heads * S
            if not reuse_here:
                out, dist = self._attend(ctx, all_rows, all_heads, collect_distance)
                stats.head_rows_online += self.heads * S
                w = layer.self_attn.o_a_proj.weight
                z = grouped_projection(w, out, all_heads, self.config.o_groups)
                if li in capture_layers:  # a layer with no Local head stores zeros
                    captured[li] = grouped_projection(w, out[:, loc], loc, self.config.o_groups)
                if distances is not None:
                    q = query_rows if query_rows.numel() else all_rows
                    distances[li] = dist[q].mean(dim=0).to(torch.float64)
            else:
                z = self._reuse_layer(li, ctx, layout, local, protection, dirty, query_rows, doc_starts,
                                      doc_ends, glob, loc, stats)
            attn_out = layer.self_attn.o_b_proj(z)[None]  # [1, S, D]
            h = post.to(dtype).unsqueeze(-1) * attn_out.unsqueeze(-2) + torch.matmul(
                comb.to(dtype).transpose(-1, -2), h)
            post, comb, collapsed = layer.ffn_hc(h)
            mlp_out = layer.mlp(layer.post_attention_layernorm(collapsed), input_ids=ids)
            h = post.to(dtype).unsqueeze(-1) * mlp_out.unsqueeze(-2) + torch.matmul(
                comb.to(dtype).transpose(-1, -2), h)
            del ctx

        hidden = m.norm(m.hc_head(h))[0]  # [S, D]
        logits = self.model.lm_head(hidden[-1:])[0]
        return RunResult(hidden, logits, stats, captured, distances)

    def _reuse_layer(self, li, ctx, layout, local, protection, dirty, query_rows, doc_starts, doc_ends,
                     glob, loc, stats: RunStats) -> torch.Tensor:
        S = layout.rows
        w = ctx.attn.o_a_proj.weight
        G = self.config.o_groups
        z = w.new_zeros((S, w.shape[0]))
        if not loc.numel():
            if glob.numel():
                out, _ = self._attend(ctx, torch.arange(S), glob, False)
                z = z + grouped_projection(w, out, glob, G)
                stats.head_rows_online += int(glob.numel()) * S
            return z
        stored = local.layer(li)
        indexer_entries = None
        compress_rate = 0
        if ctx.csel is not None and query_rows.numel():
            chosen = ctx.csel[query_rows][ctx.csel_valid[query_rows]]
            picks = torch.bincount(chosen, minlength=ctx.ckv.shape[0])  # [T] times each entry was picked
            order = torch.argsort(picks, descending=True, stable=True)
            indexer_entries = order[picks[order] > 0]
            compress_rate = ctx.attn.compressor.compress_rate
        if stored is None:
            log.warning("layer %d: artifact unusable, Local heads recomputed for every row", li)
            stats.layers_recomputed += 1
            prot_rows = torch.arange(S)
            counts = {"layer_recomputed": S}
        else:
            prot = select_protected(has_artifact=local.has_artifact, dirty=dirty, query_rows=query_rows,
                                    doc_starts=doc_starts, doc_ends=doc_ends, window=self.window,
                                    policy=protection, indexer_entries=indexer_entries,
                                    compress_rate=compress_rate)
            prot_rows, counts = prot.rows, prot.counts
        for k, v in counts.items():
            stats.protected[k] = stats.protected.get(k, 0) + v
        stats.protected_rows[li] = prot_rows
        if stored is not None:
            local_z = stored.to(z.dtype).clone()
            reused = S - int(prot_rows.numel())
            stats.local_rows_reused += reused
            stats.artifact_layers_used += 1
        else:
            local_z = z.new_zeros(z.shape)
        jobs = [(torch.arange(S), glob)] if glob.numel() else []
        if prot_rows.numel():
            jobs.append((prot_rows, loc))
        results = self._attend_jobs(ctx, jobs, False)
        if glob.numel():
            z = z + grouped_projection(w, results[0][0], glob, G)
            stats.head_rows_online += int(glob.numel()) * S
        if prot_rows.numel():
            local_z[prot_rows] = grouped_projection(w, results[-1][0], loc, G)  # replaces the stored value
            stats.head_rows_online += int(loc.numel()) * int(prot_rows.numel())
        return z + local_z

    # ---- attention --------------------------------------------------------------
    def _layer_ctx(self, attn, x, pos_ids, layout: Layout, frame_of_row, frame_offset) -> _LayerCtx:
        x2 = x[0]
        q_res = attn.q_a_norm(attn.q_a_proj(x2))  # [S, q_lora]
        kv = attn.kv_norm(attn.kv_proj(x2))        # [S, d]
        rel = layout.positions - frame_offset[frame_of_row]
        cos, sin = rope_tables(self.model.model.rotary_emb, attn.rope_layer_type, rel, kv.dtype)
        kv_canon = apply_rope(kv, cos, sin)
        ckv = cbias = centry = None
        if attn.compressor is not None and self.indexer_chunk_rows and \
                attn.layer_type == "compressed_sparse_attention":
            ckv, csel, csel_valid = csa_select(attn.compressor, x, q_res[None], pos_ids, self.indexer_chunk_rows)
            if not ckv.shape[0]:
                ckv = csel = csel_valid = None
            else:
                centry = (torch.arange(ckv.shape[0]) + 1) * attn.compressor.compress_rate - 1
            return _LayerCtx(attn, q_res, kv_canon, frame_of_row, frame_offset, layout.positions,
                             attn.rope_layer_type, ckv, None, centry, csel, csel_valid)
        if attn.compressor is not None:
            compressed, bias = attn.compressor(x, q_res[None], pos_ids, None, attn.layer_idx)
            ckv = compressed[0, 0]  # [T, d]
            T = ckv.shape[0]
            csel = csel_valid = None
            if T:
                cbias = bias[0, 0] if bias is not None else None  # [S, T]
                rate = attn.compressor.compress_rate
                centry = (torch.arange(T) + 1) * rate - 1
                if attn.layer_type == "compressed_sparse_attention" and cbias is not None:
                    # the indexer keeps <= index_topk entries per row (bias 0, the rest -inf): gather
                    # those instead of scoring all S/4 entries
                    k = min(attn.compressor.indexer.index_topk, T)
                    vals, csel = torch.topk(cbias, k, dim=-1)
                    csel_valid = vals == 0
                    cbias = None
            else:
                ckv = None
            return _LayerCtx(attn, q_res, kv_canon, frame_of_row, frame_offset, layout.positions,
                             attn.rope_layer_type, ckv, cbias, centry, csel, csel_valid)
        return _LayerCtx(attn, q_res, kv_canon, frame_of_row, frame_offset, layout.positions,
                         attn.rope_layer_type, ckv, cbias, centry)

    def _attend(self, ctx: _LayerCtx, rows: torch.Tensor, heads: torch.Tensor, collect: bool
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attention outputs [n, h, d] (after inverse RoPE) of `rows` for `heads`, with optional distances."""
        return self._attend_jobs(ctx, [(rows, heads)], collect)[0]

    def _attend_jobs(self, ctx: _LayerCtx, jobs: list[tuple[torch.Tensor, torch.Tensor]], collect: bool
                     ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Several (sorted rows, heads) jobs over one pass of row chunks, sharing each chunk's key gather.

        Reuse runs two jobs per layer (Global heads x every row, Local heads x
        protected rows); gathering the window keys once serves both.
        """
        attn = ctx.attn
        d = self.head_dim
        W = self.window
        S = ctx.q_res.shape[0]
        rotary = self.model.model.rotary_emb
        member, union = [], torch.zeros(S, dtype=torch.bool)
        for rows, _ in jobs:
            m = torch.zeros(S, dtype=torch.bool)
            m[rows] = True
            member.append(m)
            union |= m
        wqs = [attn.q_b_proj.weight.view(self.heads, d, -1)[h].reshape(len(h) * d, -1) for _, h in jobs]
        outs: list[list[torch.Tensor]] = [[] for _ in jobs]
        dists: list[list[torch.Tensor]] = [[] for _ in jobs]
        offs = torch.arange(W)
        all_rows = torch.nonzero(union).flatten()
        # rows left-padded with W-1 zero latents: row i's window is padded rows [i, i+W), so a
        # contiguous chunk's windows are one strided view (no gather); padding is never valid
        kv_pad = torch.cat([ctx.kv_canon.new_zeros((W - 1, d)), ctx.kv_canon])
        frame_pad = torch.cat([ctx.frame_of_row.new_zeros(W - 1), ctx.frame_of_row])
        for start in range(0, all_rows.numel(), self.chunk_rows):
            chunk_all = all_rows[start:start + self.chunk_rows]
            n_all = chunk_all.numel()
            kidx_all = chunk_all[:, None] - (W - 1) + offs[None, :]  # [n, W]: keys (i-W, i]
            valid_all = kidx_all >= 0
            first = int(chunk_all[0])
            if int(chunk_all[-1]) - first == n_all - 1:  # contiguous rows: strided views
                keys_all = kv_pad[first:first + n_all + W - 1].as_strided((n_all, W, d), (d, d, 1))
                kframe_all = frame_pad[first:first + n_all + W - 1].as_strided((n_all, W), (1, 1))
            else:
                keys_all = kv_pad[kidx_all + (W - 1)]      # [n, W, d]
                kframe_all = frame_pad[kidx_all + (W - 1)]  # [n, W]
            kidx_all = kidx_all.clamp(min=0)
            for j, (_, heads) in enumerate(jobs):
                sub = member[j][chunk_all]
                if not bool(sub.any()):
                    continue
                if bool(sub.all()):
                    chunk, kidx, valid, keys, kframe = chunk_all, kidx_all, valid_all, keys_all, kframe_all
                else:
                    chunk, kidx, valid = chunk_all[sub], kidx_all[sub], valid_all[sub]
                    keys, kframe = keys_all[sub], kframe_all[sub]
                out, md = self._attend_chunk(ctx, rotary, chunk, kidx, valid, keys, kframe, heads, wqs[j],
                                             collect)
                outs[j].append(out)
                if collect:
                    dists[j].append(md)
        result = []
        for j, (_, heads) in enumerate(jobs):
            out = torch.cat(outs[j]) if outs[j] else ctx.q_res.new_zeros((0, len(heads), d))
            result.append((out, torch.cat(dists[j]) if collect and dists[j] else None))
        return result

    def _attend_chunk(self, ctx, rotary, chunk, kidx, valid, keys, kframe, heads, wq, collect):
        """One chunk of rows: q for `heads`, one partial per RoPE frame in the window, compressed entries, merge."""
        attn = ctx.attn
        n, d = chunk.numel(), self.head_dim
        q = torch.nn.functional.linear(ctx.q_res[chunk], wq).view(n, len(heads), d)
        q = attn.q_b_norm(q)
        pos = ctx.positions[chunk]
        kdist = (chunk[:, None] - kidx) if collect else None
        parts: list[Partial] = []
        for f in torch.unique(kframe[valid]).tolist():
            rel = pos - ctx.frame_offset[f]  # the query, rotated into frame f
            cos, sin = rope_tables(rotary, ctx.rope_type, rel, q.dtype)
            p = segment_partial(apply_rope(q, cos, sin), keys, valid & (kframe == f), attn.scaling, dist=kdist)
            p.out = apply_rope(p.out, cos, -sin)  # phase restored: relative frame, comparable across frames
            parts.append(p)
        if ctx.ckv is not None:
            cos, sin = rope_tables(rotary, ctx.rope_type, pos, q.dtype)
            qc = apply_rope(q, cos, sin)
            if ctx.csel is not None:
                idx = ctx.csel[chunk]  # [n, k]
                cdist = (chunk[:, None] - ctx.centry_row[idx]) if collect else None
                p = segment_partial(qc, ctx.ckv[idx], ctx.csel_valid[chunk], attn.scaling, dist=cdist)
            else:
                bias = ctx.cbias[chunk] if ctx.cbias is not None else None
                cdist = (chunk[:, None] - ctx.centry_row[None, :]) if collect else None
                p = shared_keys_partial(qc, ctx.ckv, attn.scaling, bias, dist=cdist)
            p.out = apply_rope(p.out, cos, -sin)
            parts.append(p)
        return merge_partials(parts, attn.sinks[heads])


@torch.no_grad()
def measure_head_distances(runner: RedKnotRunner, samples: list[list[int]]) -> torch.Tensor:
    """Mean query-key distance per (layer, head) [L, H], averaged over sample documents (all rows as queries).

    Distance to a compressed entry counts from the last source row it summarizes;
    sink mass is left out. Feed the result to profile.policy_from_distances.
    """
    acc = None
    for tokens in samples:
        layout = Layout.of([Segment("sample", tuple(tokens), "query")])
        res = runner.full(layout, collect_distance=True)
        acc = res.mean_distance if acc is None else acc + res.mean_distance
    if acc is None:
        raise SlackTierError(ErrorKind.BAD_INPUT, "no sample documents", fix="pass at least one token list")
    return acc / len(samples)
