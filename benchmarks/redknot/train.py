"""Train a small DeepSeek-V4 (transformers' DeepseekV4ForCausalLM) on long-context retrieval, on one CPU thread.

    .venv/bin/python -m benchmarks.redknot.train --out models/redknot/retrieval-v4.pt

The model keeps V4's parts: hybrid sliding / CSA (with the Lightning Indexer) /
HCA layers, hyper-connections, a hash-routed MoE layer then top-k routed MoE
layers with a shared expert. The task (retrieval.py): records `@key:value`
inserted into real source text, the value asked for at the end.

Three training-only aids, none in the saved model:
- attention runs through `banded_attention` (registered as "slacktier_banded"),
  which computes the sliding window as a band [S, W] instead of the model's
  eager [S, S] mask; same arithmetic (tests compare it with eager);
- the Lightning Indexer gets no gradient from the LM loss (it only picks top-k
  indices), so, as in DeepSeek-V3.2's dense warm-up, CSA runs dense while the
  indexer is trained to match the main attention's distribution over the
  compressed entries (KL, indexer inputs detached); the last `sparse_frac` of
  the steps run with the saved top-k so the model meets the indexer's picks
  (the indexer KL then jumps: the main attention only sees the picked entries);
- attention supervision (TrainConfig.attention_weight): the first CSA layer's
  question rows are pushed to put their head-mean attention mass on the
  compressed entries that hold the asked value. Without it, and with tied
  embeddings, the answer loss sat at ln(values) for the whole budget (retrieval.py
  lists the recipes that failed).

Everything is seeded; one thread gives the same weights on the same machine.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import logging
import math
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repo root: benchmarks.* imports
from slacktier.errors import ErrorKind, SlackTierError  # noqa: E402

log = logging.getLogger(__name__)

LAYER_TYPES = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
               "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention")
DENSE_TOPK = 1 << 30


def retrieval_config(vocab: int, *, hidden: int = 128, heads: int = 8, layers: int = 6, window: int = 16,
                     csa_rate: int = 4, hca_rate: int = 32, index_topk: int = 64, experts: int = 8,
                     experts_per_tok: int = 6):
    """The trained model's shape: 6 layers (S, CSA, HCA, CSA, HCA, S), 8 heads in 2 output groups, 8 experts top-6."""
    from transformers import DeepseekV4Config

    types = list((LAYER_TYPES * ((layers + 5) // 6))[:layers])
    return DeepseekV4Config(
        vocab_size=vocab, hidden_size=hidden, moe_intermediate_size=32, num_hidden_layers=layers,
        num_attention_heads=heads, head_dim=32, q_lora_rank=64, partial_rotary_factor=0.25,
        num_experts_per_tok=experts_per_tok, n_routed_experts=experts, o_groups=2, o_lora_rank=32,
        index_n_heads=4, index_head_dim=32, index_topk=index_topk, sliding_window=window, layer_types=types,
        compress_rates={"compressed_sparse_attention": csa_rate, "heavily_compressed_attention": hca_rate},
        mlp_layer_types=["hash_moe"] + ["moe"] * (layers - 1), hc_sinkhorn_iters=10,
        max_position_embeddings=1 << 20, bos_token_id=1, eos_token_id=1, tie_word_embeddings=False,
        experts_implementation="eager", attn_implementation="eager")


# ---- attention for training ---------------------------------------------------------------------------
def banded_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """V4 attention with the sliding window as a band: query [B, H, S, d], key = value [B, 1, S + T, d].

    Row i sees keys (i-W, i] of the first S and, of the T compressed entries, those
    whose `attention_mask[..., -T:]` (the compressor's block bias) is 0; plus the sink.
    Needs the model called with attention_mask={"band": zeros [B, 1, S, 0]} so the
    block bias arrives alone. CSA layers with `_rk_capture` keep the head-summed
    probabilities over compressed entries for the indexer loss.
    """
    B, H, S, d = query.shape
    W = module.sliding_window
    T = key.shape[2] - S
    nb = -(-S // W)
    Sp = nb * W
    # rows in blocks of W: block j's rows [jW, jW+W) see keys [jW-W, jW+W), one [W, 2W] matmul per block
    k_loc = F.pad(key[:, 0, :S], (0, 0, W, Sp - S))              # [B, W + Sp, d]
    kblk = k_loc.unfold(1, 2 * W, W)                              # [B, nb, d, 2W]
    qblk = F.pad(query, (0, 0, 0, Sp - S)).view(B, H, nb, W, d)   # [B, H, nb, W, d]
    a = torch.arange(W)[:, None]
    c = torch.arange(2 * W)[None, :]
    keep = (c > a) & (c <= a + W)                                 # key row jW-W+c in (row-W, row]
    keep = keep[None] & ((torch.arange(nb)[:, None, None] * W - W + c[None]) >= 0)   # [nb, W, 2W]
    loc = torch.matmul(qblk, kblk[:, None]).mul(scaling).masked_fill(~keep, float("-inf"))
    parts = [loc.view(B, H, Sp, 2 * W)[:, :, :S]]
    if T:
        kc = key[:, :, S:]                                  # [B, 1, T, d]
        parts.append(torch.matmul(query, kc.transpose(-1, -2)) * scaling + attention_mask[..., -T:])
    parts.append(module.sinks.view(1, H, 1, 1).to(query.dtype).expand(B, H, S, 1))
    probs = torch.softmax(torch.cat(parts, dim=-1).float(), dim=-1).to(query.dtype)
    pl = F.pad(probs[..., :2 * W], (0, 0, 0, Sp - S)).view(B, H, nb, W, 2 * W)
    out = torch.matmul(pl, kblk[:, None].transpose(-1, -2)).view(B, H, Sp, d)[:, :, :S]
    if T:
        pc = probs[..., 2 * W:2 * W + T]
        out = out + torch.matmul(pc, kc)
        if getattr(module, "_rk_capture", False):
            module._rk_comp_probs = pc.detach().sum(1)      # [B, S, T]
        sup = getattr(module, "_rk_supervise", None)
        if sup is not None:                                  # (batch, row) of each answer's question row
            module._rk_sup_probs = pc[sup[0], :, sup[1]]     # [n, H, T]
    return out.transpose(1, 2).contiguous(), None


def register_banded() -> None:
    """Register banded_attention with transformers under the name "slacktier_banded"."""
    from transformers import AttentionInterface

    AttentionInterface.register("slacktier_banded", banded_attention)


def band_mask(batch: int, rows: int, dtype=torch.float32) -> dict:
    """The attention_mask argument banded_attention needs (an empty tensor mask the block bias is appended to)."""
    return {"band": torch.zeros(batch, 1, rows, 0, dtype=dtype)}


# ---- model -----------------------------------------------------------------------------------------------
@torch.no_grad()
def init_model(config, seed: int):
    """A fresh DeepseekV4ForCausalLM (float32) with a drawn hash-routing table (distinct experts per token)."""
    from transformers import DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(config)
    gen = torch.Generator().manual_seed(seed + 1)
    for name, buf in model.named_buffers():
        if name.endswith("tid2eid"):
            draws = torch.rand(buf.shape[0], config.n_routed_experts, generator=gen).argsort(-1)
            buf.copy_(draws[:, :buf.shape[1]])
    return model.float()


def save_model(path: Path, model, vocab, card: dict) -> None:
    """Weights + config + vocabulary map + model card in one torch file (atomic rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save({"format": "slacktier-redknot-retrieval-v1", "config": model.config.to_dict(),
                "state_dict": model.state_dict(), "vocab": torch.from_numpy(vocab.deepseek_ids), "card": card}, tmp)
    tmp.replace(path)


def load_model(path: Path, dtype: torch.dtype = torch.float32):
    """(model in eval mode, VocabMap, card) from a file written by save_model."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    from benchmarks.redknot.retrieval import VocabMap

    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError as exc:
        raise SlackTierError(ErrorKind.MISSING, f"no trained model at {path}",
                             fix="train one: python -m benchmarks.redknot.train") from exc
    if blob.get("format") != "slacktier-redknot-retrieval-v1":
        raise SlackTierError(ErrorKind.CHECKPOINT, f"{path} is not a retrieval model file",
                             fix="point at a file written by benchmarks/redknot/train.py")
    cfg_dict = dict(blob["config"])
    cfg = DeepseekV4Config(**{k: v for k, v in cfg_dict.items() if k not in ("transformers_version", "architectures",
                                                                              "model_type")})
    cfg._attn_implementation = "eager"
    model = DeepseekV4ForCausalLM(cfg)
    model.load_state_dict(blob["state_dict"])
    return model.to(dtype).eval(), VocabMap(blob["vocab"].numpy()), blob["card"]


def logit_digest(model, tokens: list[int], decimals: int = 3) -> str:
    """sha256 of the last row's logits rounded to `decimals` (the model's own forward, eager, one sequence)."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens]), use_cache=False, logits_to_keep=1).logits[0, -1].double()
    rounded = np.round(logits.numpy(), decimals) + 0.0   # + 0.0: no -0.0
    return hashlib.sha256(rounded.astype("<f8").tobytes()).hexdigest()


# ---- training ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Stage:
    """A curriculum stage: context tokens, records in it, questions after it, sequences per step, steps."""

    context: int
    records: int
    queries: int
    batch: int
    steps: int


@dataclass(frozen=True)
class TrainConfig:
    """What a training run does (the defaults are the shipped model's recipe)."""

    seed: int = 0
    lr: float = 3e-3
    warmup: int = 30
    indexer_weight: float = 1.0
    # attention supervision: -log of the head-mean mass the first CSA layer's question rows put on the
    # compressed entries holding the asked value. Without it the answer loss sat at ln(values) for the
    # whole budget (three recipes); this is a training aid, evaluation uses the plain forward.
    attention_weight: float = 1.0
    sparse_frac: float = 0.15     # last share of steps with the saved index_topk instead of dense CSA
    text_tokens: int = 3_000_000  # training text read from the train split
    vocab_top: int = 4000
    stages: tuple[Stage, ...] = (Stage(128, 10, 10, 16, 300), Stage(256, 12, 12, 8, 200),
                                 Stage(512, 16, 12, 4, 120), Stage(1024, 16, 12, 2, 100),
                                 Stage(2048, 24, 12, 1, 100))
    hidden: int = 128
    log_every: int = 10

    def __post_init__(self) -> None:
        if not self.stages or any(s.records < s.queries or s.steps < 0 for s in self.stages):
            raise SlackTierError(ErrorKind.BAD_INPUT, f"stages {self.stages}",
                                 fix="give stages with queries <= records and steps >= 0")

    @property
    def steps(self) -> int:
        """Total optimizer steps."""
        return sum(s.steps for s in self.stages)


def _batch(task, rng: random.Random, stage: Stage):
    """ids [B, S] (EOS padded on the left to the longest), flat rows [n] and targets [n] of every answer,
    and (batch [n], question row [n], value row [n]) for the attention supervision."""
    seqs = [task.train_sequence(rng, stage.context, stage.records, stage.queries) for _ in range(stage.batch)]
    S = max(len(t) for t, _, _ in seqs)
    ids = torch.full((stage.batch, S), 1, dtype=torch.long)
    rows, targets, bs, qrows, vrows = [], [], [], [], []
    for b, (toks, answers, sources) in enumerate(seqs):
        off = S - len(toks)
        ids[b, off:] = torch.tensor(toks)
        for p, src in zip(answers, sources):
            rows.append(b * S + off + p - 1)
            targets.append(toks[p])
            bs.append(b)
            qrows.append(off + p - 1)
            vrows.append(off + src)
    return ids, torch.tensor(rows), torch.tensor(targets), (torch.tensor(bs), torch.tensor(qrows),
                                                             torch.tensor(vrows))


def _attention_loss(attn, vrows: torch.Tensor) -> torch.Tensor:
    """-log of the head-mean attention mass the question rows put on the compressed entries holding the value.

    With compress rate m, entry w mixes rows [m*w - m, m*w + m) (the overlapping Ca/Cb halves), so the
    value at row r sits in entries r // m and r // m + 1 (row 37, m = 4 -> entries 9 and 10).
    """
    probs = attn._rk_sup_probs                                    # [n, H, T]
    attn._rk_sup_probs = None
    m = attn.compressor.compress_rate
    T = probs.shape[-1]
    e1 = (vrows // m).clamp(max=T - 1)
    e2 = (vrows // m + 1).clamp(max=T - 1)
    H = probs.shape[1]
    mass = probs.gather(2, e1[:, None, None].expand(-1, H, 1))[..., 0]                # [n, H]
    second = probs.gather(2, e2[:, None, None].expand(-1, H, 1))[..., 0]
    mass = mass + torch.where((e2 != e1)[:, None], second, torch.zeros_like(mass))
    return -torch.log(mass.mean(1) + 1e-6).mean()


def _indexer_loss(model) -> torch.Tensor:
    """KL(main attention over compressed entries || indexer softmax), summed over CSA layers, mean over rows."""
    total = torch.zeros(())
    for layer in model.model.layers:
        attn = layer.self_attn
        p = getattr(attn, "_rk_comp_probs", None)
        scores = getattr(attn, "_rk_index_scores", None)
        if p is None or scores is None:
            continue
        B, S, T = p.shape
        rate = attn.compressor.compress_rate
        visible = torch.arange(T)[None, :] < ((torch.arange(S) + 1) // rate)[:, None]   # [S, T]
        mass = p.sum(-1, keepdim=True)
        target = p / mass.clamp_min(1e-9)
        logq = torch.log_softmax(scores.float().masked_fill(~visible, -1e4), dim=-1)
        kl = (target * (torch.log(target.clamp_min(1e-9)) - logq)).sum(-1)      # [B, S]
        rows = visible.any(-1) & (mass[..., 0] > 1e-6)
        total = total + kl[rows].mean()
        attn._rk_comp_probs = attn._rk_index_scores = None
    return total


def _instrument(model) -> None:
    """Capture CSA attention over compressed entries and indexer scores; detach the indexer's inputs."""
    for layer in model.model.layers:
        attn = layer.self_attn
        if attn.layer_type != "compressed_sparse_attention":
            continue
        attn._rk_capture = True
        indexer = attn.compressor.indexer
        orig = indexer.forward

        def detached(hidden_states, q_residual, *args, _orig=orig, **kw):
            return _orig(hidden_states.detach(), q_residual.detach(), *args, **kw)

        indexer.forward = detached

        def keep_scores(_mod, _inp, out, _attn=attn):
            _attn._rk_index_scores = out

        indexer.scorer.register_forward_hook(keep_scores)


def _set_topk(model, k: int) -> None:
    for layer in model.model.layers:
        comp = layer.self_attn.compressor
        if comp is not None and hasattr(comp, "indexer"):
            comp.indexer.index_topk = k


def train(cfg: TrainConfig, out: Path, *, csv_path: Path | None = None, png_path: Path | None = None,
          eval_lengths: tuple[int, ...] = (), eval_samples: int = 0):
    """Train with `cfg`, save the model to `out`; returns (model, vocab, card)."""
    from benchmarks.redknot.retrieval import RetrievalTask, VocabMap, read_split

    t_start = time.perf_counter()
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    text, idents = read_split(False, cfg.text_tokens)
    vocab = VocabMap.build(text, cfg.vocab_top)
    task = RetrievalTask(vocab, text, idents)
    config = retrieval_config(vocab.size, hidden=cfg.hidden)
    model = init_model(config, cfg.seed)
    register_banded()
    model.config._attn_implementation = "slacktier_banded"
    for layer in model.model.layers:
        layer.self_attn.config._attn_implementation = "slacktier_banded"
    _instrument(model)
    model.train()
    saved_topk = config.index_topk
    sup_attn = None
    if cfg.attention_weight > 0:   # the first CSA layer's attention is supervised (see TrainConfig)
        sup_attn = next(l.self_attn for l in model.model.layers
                        if l.self_attn.layer_type == "compressed_sparse_attention")
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.01)
    rng = random.Random(cfg.seed)
    total = cfg.steps
    sparse_from = int(total * (1 - cfg.sparse_frac))
    rows_log: list[dict] = []
    step = 0
    log.info("params %.2f M, vocab %d, %d steps, %d keys", sum(p.numel() for p in params) / 1e6, vocab.size,
             total, len(task.keys))
    for stage in cfg.stages:
        for _ in range(stage.steps):
            _set_topk(model, saved_topk if step >= sparse_from else DENSE_TOPK)
            lr = cfg.lr * min(1.0, (step + 1) / cfg.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / total)))
            for g in opt.param_groups:
                g["lr"] = lr
            ids, rows, targets, (bs, qrows, vrows) = _batch(task, rng, stage)
            B, S = ids.shape
            if sup_attn is not None:
                sup_attn._rk_supervise = (bs, qrows)
            hidden = model.model(ids, attention_mask=band_mask(B, S), use_cache=False).last_hidden_state
            logits = model.lm_head(hidden.reshape(B * S, -1)[rows])
            loss = F.cross_entropy(logits.float(), targets)
            ix = _indexer_loss(model)
            sup = _attention_loss(sup_attn, vrows) if sup_attn is not None else torch.zeros(())
            (loss + cfg.indexer_weight * ix + cfg.attention_weight * sup).backward()
            gnorm = torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            acc = float((logits.argmax(-1) == targets).float().mean())
            loss, ix, sup = loss.detach(), ix.detach(), sup.detach()
            rows_log.append({"step": step, "context": stage.context, "loss": float(loss), "indexer_kl": float(ix),
                             "answer_acc": acc, "attention_sup": float(sup), "lr": lr, "grad_norm": float(gnorm),
                             "sparse": int(step >= sparse_from), "elapsed_s": time.perf_counter() - t_start})
            if step % cfg.log_every == 0 or step == total - 1:
                log.info("step %d ctx %d loss %.3f acc %.2f indexer-KL %.3f attn-sup %.3f %.0fs", step,
                         stage.context, float(loss), acc, float(ix), float(sup), time.perf_counter() - t_start)
                if csv_path:
                    write_curve(rows_log, csv_path, None)
            step += 1
    _set_topk(model, saved_topk)
    if sup_attn is not None:
        sup_attn._rk_supervise = None
    model.eval()
    for layer in model.model.layers:
        layer.self_attn._rk_capture = False
    model.config._attn_implementation = "eager"
    train_s = time.perf_counter() - t_start
    tail = rows_log[-50:]
    card = {"params": sum(p.numel() for p in model.parameters()), "vocab": vocab.size, "steps": total,
            "train_config": _jsonable(asdict(cfg)), "train_seconds": round(train_s, 1), "threads": 1,
            "final_loss_last50": float(np.mean([r["loss"] for r in tail])),
            "final_acc_last50": float(np.mean([r["answer_acc"] for r in tail])),
            "torch": str(torch.__version__)}
    if csv_path:
        write_curve(rows_log, csv_path, png_path)
    # fresh copy of the weights into a clean eager model (drops the training hooks and wrappers)
    save_model(out, model, vocab, card)
    model, vocab, card = load_model(out)
    card["logit_digest"] = logit_digest(model, digest_tokens(vocab))
    if eval_lengths:
        card["eval"] = evaluate(model, vocab, eval_lengths, eval_samples, seed=cfg.seed + 1000)
    save_model(out, model, vocab, card)
    return model, vocab, card


def _jsonable(x):
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def digest_tokens(vocab) -> list[int]:
    """A fixed 200-token probe (the first lines of the retrieval module's docstring) for the logit digest."""
    from benchmarks.redknot import retrieval
    from slacktier.tables.tokenizer import encode

    return vocab.to_compact(encode(retrieval.__doc__))[:200]


def write_curve(rows: list[dict], csv_path: Path, png_path: Path | None) -> None:
    """The loss curve as CSV (one row per step) and a PNG (loss, indexer KL, answer accuracy)."""
    csv_path.parent.mkdir(parents=True, exist_ok=True)
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    if png_path is None:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [int(r["step"]) for r in rows]

    def smooth(xs, k=20):
        return np.convolve(xs, np.ones(k) / k, mode="valid") if len(xs) > k else np.array(xs)

    panels = [("loss", "answer cross-entropy (nats)"), ("attention_sup", "attention supervision (-log mass)"),
              ("indexer_kl", "indexer KL (nats)"), ("answer_acc", "train answer accuracy")]
    panels = [p for p in panels if p[0] in rows[0]]
    fig, ax = plt.subplots(1, len(panels), figsize=(4.7 * len(panels), 4))
    for a, (key, label) in zip(ax, panels):
        ys = [float(r[key]) for r in rows]
        a.plot(steps, ys, alpha=0.3)
        sm = smooth(ys)
        a.plot(steps[len(steps) - len(sm):], sm)
        a.set_xlabel("step")
        a.set_ylabel(label)
        for i in range(1, len(rows)):
            if rows[i]["context"] != rows[i - 1]["context"]:
                a.axvline(steps[i], color="grey", lw=0.5)
    ax[0].axhline(math.log(64), color="red", lw=0.5, ls="--", label="ln 64: uniform over values")
    ax[0].legend()
    fig.suptitle("DeepSeek-V4 retrieval training (curriculum contexts 128->1024; grey lines: stage changes)")
    fig.tight_layout()
    png_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path, dpi=100)


# ---- evaluation -----------------------------------------------------------------------------------------
def eval_task(vocab, max_tokens: int = 600_000):
    """The held-out RetrievalTask (files never seen in training)."""
    from benchmarks.redknot.retrieval import RetrievalTask, read_split

    text, idents = read_split(True, max_tokens)
    return RetrievalTask(vocab, text, idents)


def evaluate(model, vocab, lengths: tuple[int, ...], samples: int, *, seed: int, doc_tokens: int = 1024,
             records_per_doc: int = 2) -> dict:
    """Exact-match retrieval accuracy per context length (full recompute through the RedKnot runner)."""
    from slacktier.redknot.profile import profile_for_config
    from slacktier.redknot.runner import Layout, RedKnotRunner, Segment

    task = eval_task(vocab)
    runner = RedKnotRunner(model, profile_for_config(model.config))
    out = {}
    for length in lengths:
        rng = random.Random(seed + length)
        n_docs = length // doc_tokens
        hits = 0
        copy = []   # per sample: the chance that answering with a random record's value is right
        t0 = time.perf_counter()
        for _ in range(samples):
            s = task.eval_sample(rng, n_docs, doc_tokens, records_per_doc)
            layout = Layout.of([Segment(f"d{i}", d) for i, d in enumerate(s.documents)]
                               + [Segment("q", s.query, "query")])
            hits += int(runner.full(layout).last_logits.argmax()) == s.answer
            copy.append(s.context_values.count(s.answer) / len(s.context_values))   # values repeat: drawn with replacement
        n_rec = n_docs * records_per_doc
        out[str(length)] = {"samples": samples, "exact_match": hits / samples, "hits": hits, "records": n_rec,
                            "chance_guess": 1 / 64, "chance_copy": sum(copy) / samples,
                            "p_vs_copy": tail_at_least(hits, copy),
                            "seconds": round(time.perf_counter() - t0, 1)}
        log.info("eval %d tokens: EM %.3f over %d (chance %.4f / copy %.3f, P[>= %d hits by copying] %.2g)", length,
                 hits / samples, samples, 1 / 64, sum(copy) / samples, hits, out[str(length)]["p_vs_copy"])
    return out


def tail_at_least(hits: int, probs: list[float]) -> float:
    """P[X >= hits] where X counts successes of independent trials with chances `probs` (Poisson binomial):
    how likely a baseline that is right on sample i with chance probs[i] scores this well."""
    dist = [1.0]                       # dist[k] = P[k successes so far]
    for p in probs:
        dist = [a * (1 - p) + b * p for a, b in zip(dist + [0.0], [0.0] + dist)]
    return float(sum(dist[hits:]))


def parse_stages(text: str) -> tuple[Stage, ...]:
    """Stages from "context:records:queries:batch:steps,..." (e.g. "128:10:10:16:150,2048:24:12:1:80")."""
    stages = []
    for part in text.split(","):
        fields = part.strip().split(":")
        try:
            stages.append(Stage(*(int(f) for f in fields)))
        except (TypeError, ValueError) as exc:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"stage {part.strip()!r}",
                                 fix="write each stage as context:records:queries:batch:steps") from exc
    return tuple(stages)


def main(argv: list[str] | None = None) -> int:
    """CLI: train (and evaluate) the retrieval model."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="models/redknot/retrieval-v4.pt")
    ap.add_argument("--curve", default="docs/img/redknot_train_curve", help="CSV/PNG path stem")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps-scale", type=float, default=1.0, help="multiply every stage's steps")
    ap.add_argument("--stages", default="",
                    help="curriculum as context:records:queries:batch:steps,... (default: the shipped recipe's)")
    ap.add_argument("--eval-lengths", default="4096,8192,16384")
    ap.add_argument("--eval-samples", type=int, default=40)
    ap.add_argument("--eval-only", action="store_true", help="evaluate the model at --out and add it to its card")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    lengths = tuple(int(x) for x in args.eval_lengths.split(",") if x)
    if args.eval_only:
        model, vocab, card = load_model(Path(args.out))
        card.setdefault("eval", {}).update(evaluate(model, vocab, lengths, args.eval_samples, seed=args.seed + 1000))
        save_model(Path(args.out), model, vocab, card)
        print(json.dumps(card, indent=1))
        return 0
    base = TrainConfig(seed=args.seed).stages if not args.stages else parse_stages(args.stages)
    stages = tuple(Stage(s.context, s.records, s.queries, s.batch, max(1, round(s.steps * args.steps_scale)))
                   for s in base)
    cfg = TrainConfig(seed=args.seed, stages=stages)
    _, _, card = train(cfg, Path(args.out), csv_path=Path(args.curve + ".csv"), png_path=Path(args.curve + ".png"),
                       eval_lengths=lengths, eval_samples=args.eval_samples)
    print(json.dumps(card, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
