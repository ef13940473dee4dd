"""Replay traces: B sessions served side by side, one Step record per forward pass.

Each assistant turn k of a session is replayed the way a radix-cached server
sees it: the prompt (the original history up to `<｜Assistant｜></think>`) is
sent, the part not already cached is prefilled, then N tokens are decoded
teacher-forced from the original reply (decode step j feeds reply[j]; a reply
shorter than N decodes all of it, EOS included). What the server cached after
the turn is the prompt plus those N tokens, so turn k+1 prefills the rest of the
original reply, the next user turn and the assistant header.

Scheduling (SGLang's default, prefill first, no mixed batches): at each
iteration all pending prefills run, packed into prefill steps of at most
`prefill_chunk_tokens`, then one decode step takes one token from every
session that is decoding. A finished session frees its slot for the next one
in the queue. With `pause_steps_mean` > 0 a session waits a geometric number of
decode steps (tool time) before its next turn's prefill; with
`start_spread_steps` > 0 the first B sessions start at uniform random delays
instead of all at step 0 (a node that is already serving, not one that just
booted). An iteration where every session waits emits no step.

Step record (also the input the serving loop replays):

    Step(index, kind "prefill" | "decode",
         session_ids [T] int32  (index into the session list, one per token),
         tokens      [T] int64  raw token ids,
         positions   [T] int64  position of each token in its session,
         ids         [T, L, C] int64 row ids per table layer (the hasher's),
         is_decode   [T] bool)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.workloads.hashing import LookupHasher, history_before
from slacktier.workloads.sessions import TokenSession


@dataclass(frozen=True)
class ReplayConfig:
    """How sessions are interleaved."""

    batch: int = 64                    # sessions served at once (8..256 in the paper)
    decode_tokens: int = 128           # N tokens regenerated per assistant turn
    prefill_chunk_tokens: int = 8192   # largest prefill step
    pause_steps_mean: float = 0.0      # mean decode steps a session waits between turns (0: none)
    start_spread_steps: int = 0        # the first `batch` sessions start after uniform [0, spread) decode steps
    seed: int = 0                      # draws pauses and start delays

    def __post_init__(self) -> None:
        if (self.batch < 1 or self.decode_tokens < 1 or self.prefill_chunk_tokens < 1 or self.pause_steps_mean < 0
                or self.start_spread_steps < 0):
            raise SlackTierError(ErrorKind.BAD_INPUT, f"bad replay config {self}",
                                 fix="batch, decode_tokens and prefill_chunk_tokens >= 1, pause_steps_mean >= 0, "
                                     "start_spread_steps >= 0")


@dataclass
class Step:
    """One forward pass of the replayed server (see the module docstring for shapes)."""

    index: int
    kind: str
    session_ids: np.ndarray  # [T] int32
    tokens: np.ndarray       # [T] int64
    positions: np.ndarray    # [T] int64
    ids: np.ndarray          # [T, L, C] int64
    is_decode: np.ndarray    # [T] bool

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])


@dataclass
class _Slot:
    session: int
    reply: int = 0          # next assistant turn to replay
    cached: int = 0         # tokens of the session already in the server's cache
    decoded: int = 0        # decode steps done in the current turn
    n_decode: int = 0       # decode steps of the current turn
    pause: int = 0          # decode steps left to wait
    phase: str = "prefill"  # prefill | decode | pause


@dataclass
class _Piece:
    session: int
    start: int
    end: int


def replay_steps(sessions: Sequence[TokenSession], hasher: LookupHasher, config: ReplayConfig = ReplayConfig(),
                 ) -> Iterator[Step]:
    """Yield the Step records of replaying `sessions` (queue order) `config.batch` at a time."""
    usable = [i for i, s in enumerate(sessions) if s.num_replies > 0]
    if len(usable) != len(sessions):
        raise SlackTierError(ErrorKind.BAD_INPUT, f"{len(sessions) - len(usable)} sessions have no assistant turn",
                             fix="drop sessions without replies before replaying")
    rng = np.random.default_rng(config.seed)
    width = hasher.spec.history_width
    # Every session's tokens end to end, so a decode step gathers its B tokens and their histories in one
    # indexing each (per-slot slicing was most of a B=128 step's host time outside begin_step).
    base = np.zeros(len(sessions) + 1, dtype=np.int64)
    np.cumsum([len(s.tokens) for s in sessions], out=base[1:])
    flat = np.concatenate([np.asarray(s.tokens, dtype=np.int64) for s in sessions]) if sessions else \
        np.zeros(0, dtype=np.int64)
    back = np.arange(-width, 0, dtype=np.int64)   # offsets of the history window, oldest first
    queue = list(range(len(sessions)))[::-1]
    slots: list[_Slot] = []
    index = 0

    def start_turn(slot: _Slot) -> None:
        s = sessions[slot.session]
        slot.decoded = 0
        slot.n_decode = int(min(config.decode_tokens, s.reply_end[slot.reply] - s.reply_start[slot.reply]))
        slot.phase = "decode"

    first = True
    while queue or slots:
        while queue and len(slots) < config.batch:
            slot = _Slot(queue.pop())
            if first and config.start_spread_steps > 0:
                slot.pause = int(rng.integers(config.start_spread_steps))
                slot.phase = "pause" if slot.pause > 0 else "prefill"
            slots.append(slot)
        first = False
        # prefills, packed into chunks
        pieces: list[_Piece] = []
        for slot in slots:
            if slot.phase != "prefill":
                continue
            s = sessions[slot.session]
            end = int(s.reply_start[slot.reply])
            pieces.append(_Piece(slot.session, slot.cached, end))
            slot.cached = end
            start_turn(slot)
        for chunk in _pack(pieces, config.prefill_chunk_tokens):
            yield _prefill_step(index, chunk, sessions, hasher, width)
            index += 1
        # one decode step over every decoding session
        decoding = [slot for slot in slots if slot.phase == "decode"]
        if decoding:
            sid = np.array([sl.session for sl in decoding], dtype=np.int32)
            pos = np.array([sessions[sl.session].reply_start[sl.reply] + sl.decoded for sl in decoding],
                           dtype=np.int64)
            start = base[sid]
            tok = flat[start + pos]
            at = pos[:, None] + back                   # [B, width] positions before each token, -1 before 0
            hist = np.where(at >= 0, flat[start[:, None] + np.maximum(at, 0)], -1)   # = history_before per slot
            ids = hasher.decode(tok, hist)
            yield Step(index, "decode", sid, tok, pos, ids, np.ones(len(sid), dtype=bool))
            index += 1
        # advance every slot by one decode step
        keep: list[_Slot] = []
        for slot in slots:
            if slot.phase == "decode":
                slot.decoded += 1
                if slot.decoded == slot.n_decode:
                    s = sessions[slot.session]
                    slot.cached = int(s.reply_start[slot.reply]) + slot.n_decode
                    slot.reply += 1
                    if slot.reply == s.num_replies:
                        continue  # session done, slot freed
                    slot.pause = int(rng.geometric(1.0 / (1.0 + config.pause_steps_mean))) - 1 \
                        if config.pause_steps_mean > 0 else 0
                    slot.phase = "pause" if slot.pause > 0 else "prefill"
            elif slot.phase == "pause":
                slot.pause -= 1
                if slot.pause <= 0:
                    slot.phase = "prefill"
            keep.append(slot)
        slots = keep


def _pack(pieces: list[_Piece], chunk: int) -> Iterator[list[_Piece]]:
    cur: list[_Piece] = []
    room = chunk
    for p in pieces:
        start = p.start
        while start < p.end:
            take = min(room, p.end - start)
            cur.append(_Piece(p.session, start, start + take))
            start += take
            room -= take
            if room == 0:
                yield cur
                cur, room = [], chunk
    if cur:
        yield cur


def _prefill_step(index: int, chunk: list[_Piece], sessions: Sequence[TokenSession], hasher: LookupHasher,
                  width: int) -> Step:
    sids, toks, poss, idss = [], [], [], []
    for p in chunk:
        s = sessions[p.session]
        tok = s.tokens[p.start:p.end].astype(np.int64)
        idss.append(hasher.prefill(tok, history_before(s.tokens, p.start, width)))
        toks.append(tok)
        poss.append(np.arange(p.start, p.end, dtype=np.int64))
        sids.append(np.full(p.end - p.start, p.session, dtype=np.int32))
    tokens = np.concatenate(toks)
    return Step(index, "prefill", np.concatenate(sids), tokens, np.concatenate(poss), np.concatenate(idss),
                np.zeros(len(tokens), dtype=bool))


@dataclass
class LookupTrace:
    """Every lookup of a replay, flattened: per layer, rows in step order, token-major then column.

    Lookup i of a layer is token i // C, column i % C.
    """

    workload: str
    batch: int
    layer_ids: tuple[int, ...]
    table_rows: tuple[int, ...]
    n_columns: int
    heads_per_order: int
    min_order: int
    rows: np.ndarray           # [L, T * C] int64
    token_step: np.ndarray     # [T] int32, non-decreasing
    token_decode: np.ndarray   # [T] bool
    token_session: np.ndarray  # [T] int32
    column_bounds: tuple[tuple[int, ...], ...] = field(default=())

    @property
    def num_tokens(self) -> int:
        return int(self.token_step.shape[0])

    @property
    def num_lookups(self) -> int:
        return int(self.rows.shape[1])

    def layer_rows(self, layer_id: int) -> np.ndarray:
        """Rows [T * C] of model layer `layer_id`."""
        if layer_id not in self.layer_ids:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"layer {layer_id} not in trace layers {self.layer_ids}",
                                 fix=f"pick among {self.layer_ids}")
        return self.rows[self.layer_ids.index(layer_id)]

    def lookup_decode(self) -> np.ndarray:
        """[T * C] bool: lookup i belongs to a decode token."""
        return np.repeat(self.token_decode, self.n_columns)


def collect_trace(steps: Iterator[Step], hasher: LookupHasher, workload: str, batch: int,
                  progress: bool = False) -> LookupTrace:
    """Flatten Step records into a LookupTrace."""
    ids, step_of, dec, sess = [], [], [], []
    it = steps
    if progress:
        from tqdm import tqdm
        it = tqdm(steps, desc=f"replay {workload}", unit="step")
    for st in it:
        ids.append(st.ids)
        step_of.append(np.full(st.num_tokens, st.index, dtype=np.int32))
        dec.append(st.is_decode)
        sess.append(st.session_ids)
    spec = hasher.spec
    if not ids:
        raise SlackTierError(ErrorKind.BAD_INPUT, "the replay produced no steps", fix="pass sessions with replies")
    all_ids = np.concatenate(ids)  # [T, L, C]
    rows = np.ascontiguousarray(all_ids.transpose(1, 0, 2).reshape(spec.n_layers, -1))
    return LookupTrace(workload, batch, spec.layer_ids, spec.table_rows, spec.n_columns, spec.heads_per_order,
                       spec.min_order, rows, np.concatenate(step_of), np.concatenate(dec), np.concatenate(sess),
                       spec.column_bounds)


def session_rows(sessions: Sequence[TokenSession], hasher: LookupHasher) -> np.ndarray:
    """All rows [L, sum T * C] of hashing each session's whole token stream once (fitting static hot sets)."""
    parts = [hasher.prefill(s.tokens.astype(np.int64)) for s in sessions]
    all_ids = np.concatenate(parts)
    return np.ascontiguousarray(all_ids.transpose(1, 0, 2).reshape(hasher.spec.n_layers, -1))
