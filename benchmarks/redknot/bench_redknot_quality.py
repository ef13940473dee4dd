"""RedKnot-MLA quality on the trained retrieval DeepSeek-V4: reuse vs full recompute on held-out documents.

The model is `models/redknot/retrieval-v4.pt` (python -m benchmarks.redknot.train): a tiny
CPU-trained DeepseekV4ForCausalLM. Each sample is `n` held-out real-text documents
of 1024 tokens with two `@key:value` records each, then the question `@key:`;
the answer is the value token. Per sample, one full recompute and, through
RedKnotService (artifact store, certificates, DRAM page source), reuse at every
protection budget with every 8th head Global; plus the controls:
- zero artifacts: the same protected rows, every stored Local contribution 0;
- stale: each document's artifact built from a different held-out document;
  unforged the certificate check refuses it (full recompute), forged (its
  tokens digest rewritten to the request's) reuse serves the stale rows.
Per-layer hidden-state deviation: relative L2 of the hyper-connection streams
at the question's last row after each decoder layer (forward pre-hooks on the
next layer's attn_hc / the model's hc_head; the runner itself is not changed).

    .venv/bin/python benchmarks/bench_redknot_quality.py --lengths 4096 --samples 30 --append
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repo root: benchmarks.* imports

ROOT = Path(__file__).resolve().parents[2]


def _kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    p = torch.log_softmax(p_logits.double(), -1)
    q = torch.log_softmax(q_logits.double(), -1)
    return float((p.exp() * (p - q)).sum())


class LayerTrace:
    """Hyper-connection streams of the last row (the question's) after every decoder layer, via pre-hooks."""

    def __init__(self, model) -> None:
        self.states: list[torch.Tensor] = []
        m = model.model
        targets = [layer.attn_hc for layer in m.layers[1:]] + [m.hc_head]
        self.handles = [t.register_forward_pre_hook(self._hook) for t in targets]

    def _hook(self, _mod, args) -> None:
        self.states.append(args[0][0, -1].detach().clone())   # [hc, D]

    def take(self) -> list[torch.Tensor]:
        """States captured since the last take (one per layer)."""
        out, self.states = self.states, []
        return out


def _deviation(a: list[torch.Tensor], b: list[torch.Tensor]) -> list[float]:
    return [float((x - y).norm() / y.norm()) for x, y in zip(a, b)]


def _forge(store, doc_id: str, tokens) -> None:
    """Rewrite a published certificate's tokens digest to `tokens` (the forgery the control needs)."""
    from slacktier.redknot.artifacts import Certificate, tokens_digest

    path = store.doc_dir(doc_id) / "rank0.cert.json"
    cert = Certificate.from_json(path.read_text())
    path.write_text(dataclasses.replace(cert, tokens_digest=tokens_digest(tokens)).to_json())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT / "models" / "redknot" / "retrieval-v4.pt"))
    ap.add_argument("--lengths", default="4096")
    ap.add_argument("--samples", type=int, default=30)
    ap.add_argument("--doc-tokens", type=int, default=1024)
    ap.add_argument("--budgets", default="0,0.1,0.2,0.25")
    ap.add_argument("--control-budget", type=float, default=0.2)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--store", default=str(ROOT / "runs" / "redknot_quality" / "store"))
    ap.add_argument("--json", default=str(ROOT / "runs" / "redknot_quality.json"))
    ap.add_argument("--policies", default="every8",
                    help="comma list of head policies: every8 (every 8th head Global), distance (per layer, the "
                         "heads with the longest mean attention distance on training-split samples are Global)")
    ap.add_argument("--calib-samples", type=int, default=4, help="training-split samples the distances come from")
    ap.add_argument("--fence-front", type=int, default=1,
                    help="fence layers at the front (1: layer 0 always online, the default; 0: layer 0's Local "
                         "heads are reused too, so the record's key-value binding lives in stored rows)")
    ap.add_argument("--append", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)

    import shutil

    from slacktier.redknot.artifacts import ArtifactStore
    from slacktier.redknot.profile import profile_for_config
    from slacktier.redknot.protect import ProtectionPolicy
    from slacktier.redknot.runner import InMemoryLocal, Layout, RedKnotRunner, Segment
    from slacktier.redknot.service import RedKnotService
    from benchmarks.redknot.train import eval_task, load_model

    model, vocab, card = load_model(Path(args.model))
    cfg = model.config
    profile = profile_for_config(cfg, name=f"retrieval-{args.fence_front}F1F", fence_front=args.fence_front)
    runner = RedKnotRunner(model, profile, chunk_rows=256)
    budgets = [float(b) for b in args.budgets.split(",")]
    task = eval_task(vocab)
    trace = LayerTrace(model)
    policies = [p for p in args.policies.split(",") if p]
    extra_runners: dict[str, RedKnotRunner] = {}
    policy_lines: list[str] = []
    if "distance" in policies:
        from slacktier.redknot.profile import policy_from_distances
        from benchmarks.redknot.retrieval import RetrievalTask, read_split
        from slacktier.redknot.runner import measure_head_distances

        text, idents = read_split(False, 300_000)       # training split: never the evaluated documents
        calib = RetrievalTask(vocab, text, idents)
        crng = random.Random(args.seed - 1)
        n_cal = max(1, min(4, int(args.lengths.split(",")[0]) // args.doc_tokens))
        samples = []
        for _ in range(args.calib_samples):
            c = calib.eval_sample(crng, n_cal, args.doc_tokens, 2)
            samples.append([t for d in c.documents for t in d] + list(c.query))
        dist = measure_head_distances(runner, samples)     # [L, H] mean query-key distance, rows
        pol = policy_from_distances(dist, 1 / 8)
        extra_runners["distance"] = RedKnotRunner(model, profile, pol, chunk_rows=256)
        trace.take()
        policy_lines = [f"Distance-picked Global heads (mean query-key distance in rows over {len(samples)} "
                        f"training-split samples of {n_cal} x {args.doc_tokens} tokens; every-8th policy: head 0):",
                        "", "| layer | mean distance per head (rows) | Global head |", "|---|---|---|"]
        for l in range(cfg.num_hidden_layers):
            tag = "" if profile.is_reusable(l) else " (fence: all online)"
            policy_lines.append(f"| {l}{tag} | {' '.join(f'{x:.0f}' for x in dist[l].tolist())} "
                                f"| {', '.join(str(h) for h in pol.globals_of(l))} |")
        policy_lines.append("")
        print("\n".join(policy_lines))
    results: dict[str, dict[str, list]] = {}
    t_start = time.perf_counter()

    def record(length: int, name: str, logits, full_logits, answer: int, states, full_states, extra=None) -> None:
        r = results.setdefault(f"{length}|{name}", {"em": [], "kl": [], "top1": [], "dev": [], "extra": [],
                                                     "p": []})
        r["em"].append(int(logits.argmax()) == answer)
        r["p"].append(float(torch.softmax(logits.double(), -1)[answer]))
        r["kl"].append(_kl(full_logits, logits))
        r["top1"].append(int(logits.argmax()) == int(full_logits.argmax()))
        r["dev"].append(_deviation(states, full_states))
        if extra is not None:
            r["extra"].append(extra)

    for length in [int(x) for x in args.lengths.split(",")]:
        n_docs = length // args.doc_tokens
        rng = random.Random(args.seed + length)
        for i in range(args.samples):
            s = task.eval_sample(rng, n_docs, args.doc_tokens, 2)
            other = task.eval_sample(rng, n_docs, args.doc_tokens, 2)   # the stale documents
            docs = [(f"s{i}-d{j}", d) for j, d in enumerate(s.documents)]
            layout = Layout.of([Segment(d, t) for d, t in docs] + [Segment("q", s.query, "query")])
            root = Path(args.store) / f"{length}-{i}"
            shutil.rmtree(root, ignore_errors=True)
            svc = RedKnotService(runner, ArtifactStore(root))
            full = runner.full(layout)
            full_states = trace.take()
            record(length, "full", full.last_logits, full.last_logits, s.answer, full_states, full_states)
            for doc_id, toks in docs:
                svc.build(doc_id, toks)
            trace.take()
            for b in budgets:
                rep = svc.prefill(docs, s.query, ProtectionPolicy(b))
                assert rep.fallback_reason is None, rep.fallback_reason
                record(length, f"reuse@{b:g}", rep.result.last_logits, full.last_logits, s.answer, trace.take(),
                       full_states, {"head_row_saving": rep.result.stats.head_row_saving})
            for pname, prunner in extra_runners.items():   # the same budgets under another head policy
                proot = Path(args.store) / f"{length}-{i}-{pname}"
                shutil.rmtree(proot, ignore_errors=True)
                psvc = RedKnotService(prunner, ArtifactStore(proot))
                for doc_id, toks in docs:
                    psvc.build(doc_id, toks)
                trace.take()
                for b in budgets:
                    rep = psvc.prefill(docs, s.query, ProtectionPolicy(b))
                    assert rep.fallback_reason is None, rep.fallback_reason
                    record(length, f"reuse@{b:g} [{pname}]", rep.result.last_logits, full.last_logits, s.answer,
                           trace.take(), full_states, {"head_row_saving": rep.result.stats.head_row_saving})
                psvc.close()
                shutil.rmtree(proot, ignore_errors=True)
            # control: zero artifacts, same protected rows
            has = torch.zeros(layout.rows, dtype=torch.bool)
            has[:layout.starts[-1]] = True
            zero = InMemoryLocal(has, {l: torch.zeros(layout.rows, cfg.o_groups * cfg.o_lora_rank)
                                       for l in profile.reusable})
            ctrl = runner.reuse(layout, zero, ProtectionPolicy(args.control_budget))
            record(length, f"control: zero artifacts @{args.control_budget:g}", ctrl.last_logits, full.last_logits,
                   s.answer, trace.take(), full_states)
            # control: stale artifacts (built from other documents under the same ids)
            stale_root = Path(args.store) / f"{length}-{i}-stale"
            shutil.rmtree(stale_root, ignore_errors=True)
            stale = RedKnotService(runner, ArtifactStore(stale_root))
            for (doc_id, _), other_doc in zip(docs, other.documents):
                stale.build(doc_id, other_doc)
            trace.take()
            rep = stale.prefill(docs, s.query, ProtectionPolicy(args.control_budget))
            record(length, f"control: stale, certificate checked @{args.control_budget:g}", rep.result.last_logits,
                   full.last_logits, s.answer, trace.take(), full_states,
                   {"fallback": rep.fallback_reason.value if rep.fallback_reason else None})
            for doc_id, toks in docs:
                _forge(stale.store, doc_id, toks)
            rep = stale.prefill(docs, s.query, ProtectionPolicy(args.control_budget))
            record(length, f"control: stale, certificate forged @{args.control_budget:g}", rep.result.last_logits,
                   full.last_logits, s.answer, trace.take(), full_states,
                   {"fallback": rep.fallback_reason.value if rep.fallback_reason else None})
            svc.close()
            stale.close()
            shutil.rmtree(root, ignore_errors=True)
            shutil.rmtree(stale_root, ignore_errors=True)
            em = {k.split("|")[1]: sum(v["em"]) for k, v in results.items() if k.startswith(f"{length}|")}
            print(f"{length} sample {i + 1}/{args.samples} ({time.perf_counter() - t_start:.0f} s): EM so far {em}",
                  flush=True)

    n_layers = cfg.num_hidden_layers
    lines = ["| context | config | samples | exact match | p(answer) mean "
             "| next-token KL vs full (mean / median, nats) "
             "| top-1 agreement | head-rows skipped | fallback | " + " | ".join(f"dev L{l}" for l in range(n_layers))
             + " |", "|---|---|---|---|---|---|---|---|---|" + "---|" * n_layers]
    summary = {}
    for key, r in results.items():
        length, name = key.split("|")
        n = len(r["em"])
        dev = [statistics.mean(d[l] for d in r["dev"]) for l in range(n_layers)]
        saving = [e["head_row_saving"] for e in r["extra"] if "head_row_saving" in e]
        fb = [e["fallback"] for e in r["extra"] if "fallback" in e]
        fb_s = "-" if not fb else (f"{sum(x is not None for x in fb)}/{n} ({fb[0]})" if fb[0] else f"0/{n}")
        summary[key] = {"samples": n, "em": sum(r["em"]) / n, "p_answer": statistics.mean(r["p"]),
                        "kl_mean": statistics.mean(r["kl"]),
                        "kl_median": statistics.median(r["kl"]), "top1": sum(r["top1"]) / n, "dev": dev,
                        "head_row_saving": statistics.mean(saving) if saving else None, "fallback": fb_s}
        s = summary[key]
        hr = f"{100 * s['head_row_saving']:.1f}%" if saving else "-"
        lines.append(f"| {length} | {name} | {n} | {s['em']:.3f} ({sum(r['em'])}/{n}) | {s['p_answer']:.3f} | "
                     f"{s['kl_mean']:.2e} / "
                     f"{s['kl_median']:.2e} | {s['top1']:.3f} | {hr} | {fb_s} | "
                     + " | ".join(f"{d:.1e}" for d in dev) + " |")
    print("\n".join(lines))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(summary, indent=1))
    if args.append:
        from benchmarks.redknot.bench_redknot_prefill import append_to_section

        cmd = " ".join([".venv/bin/python benchmarks/bench_redknot_quality.py", *sys.argv[1:]])
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        block = [f"### Reuse quality on a trained model, {stamp}", "",
                 f"Command: `{cmd}` ({(time.perf_counter() - t_start) / 60:.0f} min; machine {platform.machine()}, "
                 f"{os.cpu_count()} cores shared with other agents, torch {torch.__version__}, one thread, float32).",
                 "", f"Model: a **tiny CPU-trained** DeepseekV4ForCausalLM ({card['params'] / 1e6:.2f} M parameters, "
                 f"profile {profile.fence_layout}, {cfg.num_attention_heads} heads / {cfg.o_groups} groups, every 8th "
                 "head Global = 7 Local + 1 Global per layer); see the model card above. Held-out documents "
                 f"(files never trained on), {args.doc_tokens} tokens each, two records per document, one "
                 "question. dev Ll = relative L2 deviation from full recompute of the question row's "
                 "hyper-connection streams after layer l (mean over samples). Rows without a bracket use every "
                 "8th head Global; `[distance]` rows use the distance-picked Global heads below.", "",
                 *policy_lines, *lines, ""]
        append_to_section(ROOT / "docs" / "bench-log" / "redknot.md", block)
        print("appended to its docs/bench-log/ file")
    return 0


if __name__ == "__main__":
    sys.exit(main())
