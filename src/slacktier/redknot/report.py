"""What `slacktier redknot build | run | ledger` run and print: one call per sub-verb, all their output here.

- `build_artifacts(config)`: prefill each document alone and publish its artifacts; one line per document.
- `compare_prefill(config)`: one prefill with reuse and one with full recompute; a JSON summary of the two.
- `ledger(config)`: head-row ceiling and per-operator arithmetic per profile; tables or JSON.

The model, runner, store and service of a run are built here from a typed config
(`RedKnotRunConfig`), so the verb only parses flags.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from slacktier.errors import ErrorKind, SlackTierError

log = logging.getLogger(__name__)

MODELS = ("tiny", "bench")
DTYPES = ("float32", "float64")
HEAD_POLICIES = ("stride", "distance")
FULL_VOCAB = 129_280  # DeepSeek-V4's vocabulary: a smaller model sees token ids mod its vocab


@dataclass(frozen=True)
class RedKnotRunConfig:
    """A build or a reuse run: which model and weights, which documents, where artifacts live and are read from."""

    store: Path                       # artifact directory
    model: str = "bench"              # tiny: 6 layers, vocab 512; bench: 7 layers, real vocab
    seed: int = 0                     # weight seed (the digest binds it)
    dtype: str = "float32"
    docs: int = 2                     # documents of real source text
    doc_tokens: int = 2048
    tp: int = 1                       # tensor-parallel ranks the artifacts are split over
    fence: tuple[int, int] = (1, 1)   # fence layers (front, back)
    threads: int = 1                  # torch intra-op threads
    policy: str = "stride"            # Local/Global head policy: stride (every 8th Global) or distance
    budget: float = 0.2               # protected share of document rows (run only)
    source: str = "dram"              # tier of every reusable layer's artifact pages (run only)
    placement: Path | None = None     # control file placing each layer's artifact pages (overrides source)

    def __post_init__(self) -> None:
        if self.model not in MODELS or self.dtype not in DTYPES or self.policy not in HEAD_POLICIES:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"model {self.model}, dtype {self.dtype}, policy {self.policy}",
                                 fix=f"use a model of {MODELS}, a dtype of {DTYPES} and a policy of {HEAD_POLICIES}")
        if len(self.fence) != 2 or min(self.fence) < 0:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"fence {self.fence}", fix="give two counts >= 0: front,back")


@dataclass(frozen=True)
class LedgerConfig:
    """Which profiles, prefill sizes and protected shares the ledger covers, and whether it prints JSON."""

    profiles: tuple[str, ...] = ("flash", "pro")
    context: int = 262144             # document tokens of the prefill
    query: int = 64                   # query tokens
    budgets: tuple[float, ...] = (0.0, 0.1, 0.2, 0.25)
    as_json: bool = False

    def __post_init__(self) -> None:
        from slacktier.redknot.ledger import PROFILE_CONFIGS

        unknown = [p for p in self.profiles if p not in PROFILE_CONFIGS]
        if unknown:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"unknown profiles {unknown}",
                                 fix=f"use {','.join(PROFILE_CONFIGS)}")
        if self.context < 1 or self.query < 0:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"--context {self.context}, --query {self.query}",
                                 fix="give a prefill of at least one document token (--context >= 1, --query >= 0)")
        bad = [b for b in self.budgets if not 0.0 <= b <= 1.0]   # also catches nan
        if bad:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"protected shares {bad} outside [0, 1]",
                                 fix="give --budgets as fractions of the prefill's rows, e.g. 0,0.1,0.25")


def _model_config(config: RedKnotRunConfig):
    from slacktier.redknot.model import bench_config, tiny_config

    return tiny_config() if config.model == "tiny" else bench_config()


def _documents(config: RedKnotRunConfig, vocab: int):
    from slacktier.redknot.corpus import documents, question_tokens

    docs = documents(config.docs, config.doc_tokens)
    q = question_tokens()
    if vocab < FULL_VOCAB:
        docs = [(d, tuple(t % vocab for t in toks)) for d, toks in docs]
        q = tuple(t % vocab for t in q)
    return docs, q


def _service(config: RedKnotRunConfig, docs):
    import torch

    from slacktier.config import load_control
    from slacktier.redknot.artifacts import ArtifactStore
    from slacktier.redknot.model import build_model
    from slacktier.redknot.placement import artifact_placement
    from slacktier.redknot.profile import policy_from_distances, profile_for_config
    from slacktier.redknot.runner import RedKnotRunner, measure_head_distances
    from slacktier.redknot.service import RedKnotService

    cfg = _model_config(config)
    dtype = torch.float64 if config.dtype == "float64" else torch.float32
    model = build_model(cfg, seed=config.seed, dtype=dtype)
    front, back = config.fence
    profile = profile_for_config(cfg, name=f"{config.model}-{front}F{back}F", fence_front=front, fence_back=back)
    runner = RedKnotRunner(model, profile)
    if config.policy == "distance":
        samples = [list(toks[:512]) for _, toks in docs[:2]]
        runner = RedKnotRunner(model, profile, policy_from_distances(measure_head_distances(runner, samples)))
        log.info("distance policy: Global heads %s", runner.policy.global_heads)
    store = ArtifactStore(Path(config.store))
    if config.placement:
        placement = load_control(config.placement)
    else:
        placement = artifact_placement(store.root, profile.reusable, config.source)
    return RedKnotService(runner, store, tp_size=config.tp, placement=placement)


def _setup(config: RedKnotRunConfig):
    import torch

    torch.set_num_threads(config.threads)
    docs, q = _documents(config, _model_config(config).vocab_size)
    return docs, q, _service(config, docs)


def format_build(doc_id: str, certs: Sequence, seconds: float) -> str:
    """One line per built document: rows, covered layers, generation, ranks, pages, time."""
    c = certs[0]
    return (f"{doc_id}: {c.rows} rows, layers {list(c.covered_layers)}, generation {c.generation}, "
            f"{len(certs)} rank(s), {sum(sum(x.region_pages) for x in certs)} pages, {seconds:.2f} s")


def build_artifacts(config: RedKnotRunConfig) -> dict[str, list]:
    """Prefill each document alone at position 0, publish its artifacts, print a line each; certificates by doc."""
    docs, _, svc = _setup(config)
    out = {}
    try:
        for doc_id, toks in docs:
            t0 = time.perf_counter()
            out[doc_id] = svc.build(doc_id, toks)
            print(format_build(doc_id, out[doc_id], time.perf_counter() - t0))
    finally:
        svc.close()
    return out


def prefill_comparison(reuse, full, rows: int, reuse_s: float, full_s: float, counters: dict) -> dict:
    """The JSON summary of a reuse prefill (a PrefillReport) against full recompute (a RunResult)."""
    import torch

    p = torch.log_softmax(full.last_logits.double(), -1)
    r = torch.log_softmax(reuse.result.last_logits.double(), -1)
    kl = float((p.exp() * (p - r)).sum())
    rel = float((reuse.result.hidden[-1] - full.hidden[-1]).norm() / full.hidden[-1].norm())
    st = reuse.result.stats
    return {"mode": st.mode, "fallback_reason": st.fallback_reason, "rows": rows,
            "reuse_s": round(reuse_s, 3), "full_s": round(full_s, 3),
            "head_row_saving": round(st.head_row_saving, 4), "local_rows_reused": st.local_rows_reused,
            "protected": st.protected, "pages_read": reuse.reads.pages,
            "last_hidden_rel_err": rel, "next_token_kl": kl,
            "same_argmax": bool(full.last_logits.argmax() == reuse.result.last_logits.argmax()),
            "counters": dict(counters)}


def compare_prefill(config: RedKnotRunConfig) -> dict:
    """Prefill documents + question with reuse and with full recompute; print and return the comparison."""
    from slacktier.redknot.protect import ProtectionPolicy
    from slacktier.redknot.runner import Layout, Segment

    docs, q, svc = _setup(config)
    t0 = time.perf_counter()
    try:
        rep = svc.prefill(docs, q, ProtectionPolicy(config.budget))
    finally:
        svc.close()
    t_reuse = time.perf_counter() - t0
    layout = Layout.of([Segment(d, t) for d, t in docs] + [Segment("query", q, "query")])
    t0 = time.perf_counter()
    full = svc.runner.full(layout)
    t_full = time.perf_counter() - t0
    summary = prefill_comparison(rep, full, layout.rows, t_reuse, t_full, svc.counters)
    print(json.dumps(summary, indent=1))
    return summary


def profile_ledger(name: str, context: int, query: int, budgets: Sequence[float]) -> tuple[dict, str]:
    """One profile's ledger: its JSON entry and its text (a header line, then a table per budget)."""
    from slacktier.redknot.ledger import (PROFILE_CONFIGS, ModelDims, format_ledger, head_row_ceiling,
                                          logical_head_row_saving, operator_ledger)

    profile, make = PROFILE_CONFIGS[name]
    dims = ModelDims.of(make())
    ceiling = head_row_ceiling(profile)
    entry = {"fences": profile.fence_layout, "local_global": f"{profile.num_heads - profile.num_heads // 8}/"
             f"{profile.num_heads // 8}", "head_row_ceiling": ceiling, "budgets": {}}
    text = [f"{name}: {profile.fence_layout}, {entry['local_global']} Local/Global heads, "
            f"logical head-row ceiling {100 * ceiling:.2f}%"]
    for b in budgets:
        rows = operator_ledger(dims, profile, None, doc_rows=context, query_rows=query, budget=b)
        hr = logical_head_row_saving(profile, None, doc_rows=context, query_rows=query, budget=b)
        entry["budgets"][b] = {"logical_head_row_saving": hr, **{r.name: r.saving for r in rows}}
        text.append(format_ledger(f"{name}, {context} doc + {query} query tokens, budget {b:.0%}: "
                                  f"logical head-row saving {100 * hr:.2f}%", rows))
    return entry, "\n".join(text)


def ledger(config: LedgerConfig) -> dict:
    """Print every profile's ledger (tables, or one JSON document) and return the JSON entries by profile."""
    out = {}
    for name in config.profiles:
        out[name], text = profile_ledger(name, config.context, config.query, config.budgets)
        if not config.as_json:
            print(text)
    if config.as_json:
        print(json.dumps(out, indent=1))
    return out
