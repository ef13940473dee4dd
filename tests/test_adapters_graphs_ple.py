"""vLLM's PLE backend under vLLM's breakable CUDA graphs, rehearsed on this CPU (tests/test_adapters_graphs.py
says how: the engine's own capture class with recorded segments, the step engine trapped while one captures).

vLLM's own Qwen4ExpNGramEmbedding (its CPU hash) builds the plug-in's ServedPLEEmbedding; a prefill of two
requests is captured through the patched Qwen4ExpModel.forward hook: both layers' `start_prefetch` and
forward (`finalize_prefetch`), scaled by vLLM's own `dequantize`. Its output buffers are then emptied and the
capture replayed: the breaks alone (begin_step, both gathers, end_step, in that order) must refill them with
vLLM's resident table's rows, bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from ple_common import LAYERS, assert_same_rows, ple_control
from slacktier.adapters import vllm as plug
from slacktier.adapters import vllm_ple as ple
from test_adapters_graphs import _vllm_capture, trapped
from test_adapters_vllm_ple import _load, _ngram, _steps, vl, world, worker  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_vllm_ple_breaks_replay_the_step(vl, world, worker, monkeypatch, tmp_path):
    bcg = pytest.importorskip("vllm.compilation.breakable_cudagraph")
    monkeypatch.setattr(bcg, "weak_ref_tensor", lambda t: t)   # vLLM's compiled op; the tensor itself on a CPU
    for module, cls_name, method in plug.PATCHED + ple.PATCHED:   # registering patches them: undone after
        cls = getattr(__import__(module, fromlist=[cls_name]), cls_name)
        monkeypatch.setattr(cls, method, cls.__dict__[method])
    monkeypatch.setenv(plug.CONTROL_ENV, "unused.toml")
    plug.register()
    monkeypatch.delenv(plug.CONTROL_ENV)
    stock = {layer: _load(_ngram(vl, layer), world.tables[layer]) for layer in LAYERS}
    monkeypatch.setenv(plug.CONTROL_ENV, str(ple_control(tmp_path / "tp1.toml", world.manifest)))
    served = {layer: _load(_ngram(vl, layer), world.tables[layer]) for layer in LAYERS}
    ids, qsl, context = _steps(world)[0]
    want = {layer: stock[layer].ngram_embedding.dequantize(stock[layer](None, ids, qsl, context), torch.bfloat16)
            for layer in LAYERS}

    def body() -> dict[int, torch.Tensor]:
        for layer in LAYERS:
            served[layer].start_prefetch(ids, qsl, context)
        return {layer: served[layer](None, ids, qsl, context) for layer in LAYERS}

    model_forward = ple._model_forward   # what vLLM's patched Qwen4ExpModel.forward runs
    capture = _vllm_capture(bcg)
    with trapped(lambda: capture._capturing, monkeypatch) as calls:
        with capture:
            outs = model_forward(body)
        assert calls == ["begin_step", "gather 1", "gather 3", "end_step"]
        assert capture.num_eager_breaks == 5   # two prefetches, two finalizes, the end
        for out in outs.values():
            out.zero_()   # negative control: only the replay's breaks can refill them
        calls.clear()
        capture.replay()
        assert calls == ["begin_step", "gather 1", "gather 3", "end_step"]
    for layer in LAYERS:
        got = served[layer].ngram_embedding.dequantize(outs[layer], torch.bfloat16)
        assert_same_rows(got, want[layer])
    assert not plug.current().engine.in_step
