"""The plug-ins under the engines' breakable CUDA graphs, rehearsed on this CPU.

A breakable graph is captured once: the Python of the forward runs, its kernels
are recorded as graph segments, and the calls marked as eager breaks (SGLang's
`eager_on_graph`, vLLM's `eager_break_during_capture`) end a segment, run, and
are recorded to run again between the segments at every replay. A replay runs
no Python of the forward but those breaks.

Here each engine's own capture class is used with its segments replaced by
recorders (a CPU has no CUDA graph): the engines' own break decorators end and
begin the segments and record the breaks, and a replay runs the recorded
breaks the way the engines' replays do, segment, break, segment. While a
segment is "capturing", the step engine's entry points are trapped: a call
from captured code fails the test. A replay after the graph's input buffer is
given new ids (what the captured hasher kernel would write) must serve the new
step's rows, bit for bit the stock path's, and run begin_step, each layer's
gather and end_step once each, in that order, from the breaks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from engines import import_sglang, import_vllm
from slacktier.adapters import sglang as plug
from slacktier.engine.step import StepEngine
from test_adapters_sglang import (LAYERS, _assert_same_rows, _batch, _control, _served, _stock, sg,  # noqa: F401
                                  tp, world)

# ---- the step engine's entry points, trapped while a segment captures ------------------------------------


@contextmanager
def trapped(capturing: Callable[[], bool], monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """StepEngine.begin_step, gather and end_step log their calls and raise when `capturing()` is true."""
    calls: list[str] = []
    for name in ("begin_step", "gather", "end_step"):
        real = getattr(StepEngine, name)

        def trap(self: StepEngine, *args: Any, _real: Callable = real, _name: str = name, **kwargs: Any) -> Any:
            if capturing():
                raise AssertionError(f"StepEngine.{_name} called from captured code")
            calls.append(_name if _name != "gather" else f"gather {args[0]}")
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(StepEngine, name, trap)
    yield calls


# ---- SGLang -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bcg() -> Any:
    return import_sglang("sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph.breakable_cuda_graph")


def _sglang_capture(bcg: Any) -> Any:
    """SGLang's BreakableCUDAGraphCapture with recorded segments in place of CUDA graphs."""

    class Segment:
        def replay(self) -> None:
            """A replayed segment runs its kernels, never Python: nothing here."""

    class CpuCapture(bcg.BreakableCUDAGraphCapture):
        capturing = False

        def __enter__(self) -> CpuCapture:
            self._capture_token = bcg._current_capture_var.set(self)
            self._begin_new_segment()
            return self

        def __exit__(self, *exc: object) -> bool:
            try:
                self._end_current_segment()
            finally:
                bcg._current_capture_var.reset(self._capture_token)
            return False

        def _begin_new_segment(self) -> None:
            self.capturing = True

        def _end_current_segment(self) -> None:
            self.capturing = False
            self.cuda_graph._segments.append(Segment())

    return CpuCapture(bcg.BreakableCUDAGraph())


def _replay(graph: Any, after_break: Callable[[int], None] = lambda i: None) -> None:
    """BreakableCUDAGraph.replay's order (segment i, then break i), without its CUDA stream."""
    for i, seg in enumerate(graph._segments):
        seg.replay()
        if i < len(graph._break_fns):
            graph._break_fns[i]()
            after_break(i)


class _Model:
    """DeepseekV4Model's body as the graph runner calls it: SGLang's hasher, then each layer's lookup; the hash
    ids stay in `hash_ids`, the buffer the captured hasher kernel would write at each replay."""

    def __init__(self, hasher: Any, embeds: dict[int, Any]) -> None:
        self.hasher, self.embeds = hasher, embeds
        self.hash_ids: torch.Tensor | None = None

    def _forward_impl(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: Any, *rest: Any) -> list:
        self.hash_ids = self.hasher(input_ids, batch)   # [T, 2, 24]
        return [self.embeds[layer](self.hash_ids[:, i]) for i, layer in enumerate(LAYERS)]


def _ids(sg: Any, world: Any, tokens: np.ndarray) -> torch.Tensor:
    return world.hasher(torch.from_numpy(tokens), _batch(sg, len(tokens)))


def test_sglang_breaks_sit_around_the_captured_code_and_replay_the_step(sg, world, tp, bcg, monkeypatch, tmp_path):
    n = 64
    first, second = world.tokens[:n], world.tokens[n:2 * n]
    with tp(1, 0):
        stock = {layer: _stock(sg, world, layer) for layer in LAYERS}
        ids_second = _ids(sg, world, second)   # SGLang's hasher, before the plug-in is on (its hook begins steps)
        want_second = [stock[layer](ids_second[:, i]) for i, layer in enumerate(LAYERS)]
        want_first = [stock[layer](_ids(sg, world, first)[:, i]) for i, layer in enumerate(LAYERS)]
        monkeypatch.setenv(plug.CONTROL_ENV, str(_control(tmp_path / "tp1.toml", world.manifests["tp1"])))
        model = _Model(world.hasher, {layer: _served(sg, world, layer) for layer in LAYERS})
        capture = _sglang_capture(bcg)
        with trapped(lambda: capture.capturing, monkeypatch) as calls:
            with capture:
                outs = sg.model.DeepseekV4Model.forward(model, torch.from_numpy(first), torch.arange(n),
                                                        _batch(sg, n), None)
            # capture ran one real step, all of it in breaks: begin, the two layers' gathers, end
            assert calls == ["begin_step", "gather 1", "gather 14", "end_step"]
            graph = capture.cuda_graph
            assert len(graph._break_fns) == 4 and len(graph._segments) == 5
            for got, want in zip(outs, want_first):
                _assert_same_rows(got, want)
            calls.clear()
            model.hash_ids.copy_(ids_second)   # the captured hasher kernel's write
            seen: list[list[str]] = []
            _replay(graph, lambda i: seen.append(list(calls)))
        assert seen == [["begin_step"], ["begin_step", "gather 1"], ["begin_step", "gather 1", "gather 14"],
                        ["begin_step", "gather 1", "gather 14", "end_step"]]
        for got, want, old in zip(outs, want_second, want_first):   # the captured buffers hold the new step's rows
            _assert_same_rows(got, want)
            assert not torch.equal(got.view(torch.int16), old.view(torch.int16))   # negative control: rows moved
        binding = plug.current()
        assert binding is not None and not binding.engine.in_step
        assert sum(c.lookups for c in binding.engine.totals.values()) == 2 * 2 * n * 24


def test_sglang_host_work_in_captured_code_is_caught(sg, world, tp, bcg, monkeypatch, tmp_path):
    """Negative control of the trap: begin_step called from a segment (not as a break) fails the test."""
    with tp(1, 0):
        ids = _ids(sg, world, world.tokens[:8])
        monkeypatch.setenv(plug.CONTROL_ENV, str(_control(tmp_path / "tp1.toml", world.manifests["tp1"])))
        _served(sg, world, 1)
        capture = _sglang_capture(bcg)
        with trapped(lambda: capture.capturing, monkeypatch), capture:
            with pytest.raises(AssertionError, match="begin_step called from captured code"):
                plug.current().begin(ids)


def test_sglang_replay_whose_gather_raises_ends_the_step(sg, world, tp, bcg, monkeypatch, tmp_path):
    """A replay stops at a break that raises; the step it began is ended there, so the next replay serves."""
    n = 32
    tokens = world.tokens[:n]
    with tp(1, 0):
        stock = {layer: _stock(sg, world, layer) for layer in LAYERS}
        ids = _ids(sg, world, tokens)
        want = [stock[layer](ids[:, i]) for i, layer in enumerate(LAYERS)]
        monkeypatch.setenv(plug.CONTROL_ENV, str(_control(tmp_path / "tp1.toml", world.manifests["tp1"])))
        model = _Model(world.hasher, {layer: _served(sg, world, layer) for layer in LAYERS})
        capture = _sglang_capture(bcg)
        with capture:
            outs = sg.model.DeepseekV4Model.forward(model, torch.from_numpy(tokens), torch.arange(n),
                                                    _batch(sg, n), None)
        real = StepEngine.gather

        def failing(self: StepEngine, layer: int) -> torch.Tensor:
            raise RuntimeError("a read failed")

        monkeypatch.setattr(StepEngine, "gather", failing)
        with pytest.raises(RuntimeError, match="a read failed"):
            _replay(capture.cuda_graph)
        assert not plug.current().engine.in_step
        monkeypatch.setattr(StepEngine, "gather", real)
        _replay(capture.cuda_graph)
        for got, w in zip(outs, want):
            _assert_same_rows(got, w)


# ---- vLLM ---------------------------------------------------------------------------------------------------


@pytest.fixture
def vllm_worker(monkeypatch: pytest.MonkeyPatch) -> Iterator[SimpleNamespace]:
    """vLLM's Engram module and breakable capture, one TP-1 worker's config stated through vLLM's own getters,
    breakable graphs on (PIECEWISE), the plug-in registered."""
    from slacktier.adapters import vllm as vplug

    engram = import_vllm(vplug.ENGRAM_MODULE)
    vbcg = import_vllm("vllm.compilation.breakable_cudagraph")
    config, engram_config = import_vllm("vllm.config"), import_vllm("vllm.config.engram")
    distributed = import_vllm("vllm.distributed")
    monkeypatch.setattr(distributed, "get_tensor_model_parallel_rank", lambda: 0)
    cfg = SimpleNamespace(parallel_config=config.ParallelConfig(tensor_parallel_size=1),
                          engram_config=engram_config.EngramConfig(), additional_config={}, speculative_config=None,
                          model_config=SimpleNamespace(enforce_eager=False),
                          compilation_config=SimpleNamespace(cudagraph_mode=config.CUDAGraphMode.PIECEWISE))
    monkeypatch.setattr(config, "get_current_vllm_config", lambda: cfg)
    monkeypatch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", "1")
    # vLLM keeps a break's tensor arguments as weak references (a compiled op of its CUDA build, absent here);
    # on a CPU, with no graph pool to reclaim, the tensor itself stands in.
    monkeypatch.setattr(vbcg, "weak_ref_tensor", lambda t: t)
    from slacktier.adapters import vllm_ple

    for module, cls_name, method in vplug.PATCHED + vllm_ple.PATCHED:   # registering patches them: undone after
        cls = getattr(import_vllm(module), cls_name)
        monkeypatch.setattr(cls, method, cls.__dict__[method])
    yield SimpleNamespace(engram=engram, bcg=vbcg, plug=vplug)
    vplug.close()


def _vllm_capture(vbcg: Any) -> Any:
    """vLLM's BreakableCUDAGraphCapture with recorded segments in place of CUDA graphs."""

    class CpuCapture(vbcg.BreakableCUDAGraphCapture):
        def _begin_segment(self) -> None:
            self._capturing = True

        def _end_segment(self) -> None:
            if self._capturing:
                self.segments.append(lambda: None)   # a replayed segment runs kernels, never Python
                self._num_graphs += 1
                self._capturing = False

    return CpuCapture()


def test_vllm_breaks_sit_around_the_captured_code_and_replay_the_step(vllm_worker, monkeypatch, tmp_path):
    from slacktier.config import ControlFile, EngineConfig, TableConfig, write_control
    from slacktier.tables.engram_hash import EngramLayout
    from slacktier.tables.stage import stage_synthetic

    v = vllm_worker
    layout = EngramLayout.scaled(200)
    m = stage_synthetic([tmp_path / "t.bin"], layout, 1, 9, progress=False)
    tables = tuple(TableConfig(layer=layer, manifest=m.path, cache_share=0.5, order=i)
                   for i, layer in enumerate(layout.layer_ids))
    control = write_control(ControlFile(engine=EngineConfig(cache_rows=500, check=True), tables=tables),
                            tmp_path / "rank{tp_rank}.toml".format(tp_rank=0))
    monkeypatch.setenv(v.plug.CONTROL_ENV, str(tmp_path / "rank{tp_rank}.toml"))
    v.plug.register()
    vlayout = SimpleNamespace(layer_ids=list(layout.layer_ids), head_dim=256,
                              num_embeddings=[layout.layer_rows(layer) for layer in layout.layer_ids],
                              primes=[[list(np.diff(layout.layer_column_bounds(layer)))[o * 8:(o + 1) * 8]
                                       for o in range(3)] for layer in layout.layer_ids])
    n = 16
    layers = [SimpleNamespace(embed_tokens=v.engram.Engram._create_embedding(SimpleNamespace(), vlayout, i),
                              staged_rows=torch.empty(64, 24, 256, dtype=torch.bfloat16))
              for i in range(len(layout.layer_ids))]
    assert all(isinstance(e.embed_tokens, v.plug.ServedTable) for e in layers) and control.exists()
    rng = np.random.default_rng(3)

    def ids_of() -> torch.Tensor:   # [n, 2, 24] row ids inside each column of each layer
        return torch.from_numpy(np.stack([np.asarray(layout.layer_column_bounds(layer)[:-1]) + rng.integers(
            0, np.diff(layout.layer_column_bounds(layer)), size=(n, 24)) for layer in layout.layer_ids], axis=1))

    hashes = ids_of()   # the graph's input buffer

    def body() -> list[torch.Tensor]:   # DeepseekV4Model.forward's Engram part: prepare every layer, then embed
        for i, e in enumerate(layers):
            v.engram.Engram.prepare_embeddings(e, hashes[:, i])
        return [v.engram.Engram._ready_rows(e, n) for e in layers]

    forward = v.engram.Engram.prepare_embeddings   # patched: any method of the table's class runs our hooks
    assert getattr(forward, "__slacktier__", False)
    model_forward = v.plug._model_forward
    eager = [r.clone() for r in model_forward(body)]   # no capture: the hooks run inline
    capture = _vllm_capture(v.bcg)
    with trapped(lambda: capture._capturing, monkeypatch) as calls:
        with capture:
            outs = model_forward(body)
        assert calls == ["begin_step", "gather 1", "gather 14", "end_step"]
        assert (capture.num_eager_breaks, capture.num_graphs) == (5, 6)   # collect 1, 14; rows 1, 14; end
        for got, want in zip(outs, eager):
            assert torch.equal(got.view(torch.int16), want.view(torch.int16))
        calls.clear()
        new = ids_of()
        hashes.copy_(new)   # what the captured hash kernel would write
        want_new = [r.clone() for r in model_forward(lambda: body())]   # eager, on the same ids
        calls.clear()
        capture.replay()
        assert calls == ["begin_step", "gather 1", "gather 14", "end_step"]
    for got, want, old in zip(outs, want_new, eager):
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
        assert not torch.equal(got.view(torch.int16), old.view(torch.int16))   # negative control: rows moved
    engine = v.plug.current().engine
    assert not engine.in_step and sum(c.mismatches for c in engine.totals.values()) == 0
    assert sum(c.checked_rows for c in engine.totals.values()) > 0


# ---- what is served and what stays refused ------------------------------------------------------------------


def test_graph_scope_serves_breakable_graphs_and_names_what_stays_refused(vllm_worker):
    from engines import SGLANG_VERSION, VLLM_VERSION
    from slacktier.adapters import vllm_binding
    from slacktier.errors import ErrorKind, SlackTierError

    v = vllm_worker
    s = vllm_binding.read_serving(import_vllm("vllm.config").get_current_vllm_config())
    assert (s.enforce_eager, s.breakable, s.cudagraph_mode) == (False, True, "PIECEWISE")   # from vLLM's config
    v.plug.check_scope(s, 24)
    base = dict(version=VLLM_VERSION, tp_size=4, tp_rank=3, enforce_eager=False)
    refused = [(dict(breakable=False, cudagraph_mode="PIECEWISE"), "without VLLM_USE_BREAKABLE_CUDAGRAPH"),
               (dict(breakable=True, cudagraph_mode="FULL_AND_PIECEWISE"), "full CUDA graphs"),
               (dict(breakable=True, cudagraph_mode="FULL_DECODE_ONLY"), "full CUDA graphs")]
    for change, words in refused:
        with pytest.raises(SlackTierError, match=words) as err:
            v.plug.check_scope(v.plug.VllmServing(**base, **change), 24)
        assert err.value.kind is ErrorKind.UNSUPPORTED and "cudagraph_mode=PIECEWISE" in err.value.fix
    v.plug.check_scope(v.plug.VllmServing(**base | dict(tp_size=1, tp_rank=0), breakable=True,
                                          cudagraph_mode="PIECEWISE"), 16, "PLE")   # PLE's calls are breaks too
    sbase = dict(version=SGLANG_VERSION, tp_size=2, tp_rank=0)
    plug.check_scope(plug.SglangServing(**sbase, decode_graph="breakable", prefill_graph="breakable"), 24)
    with pytest.raises(SlackTierError, match="once, at capture") as err:
        plug.check_scope(plug.SglangServing(**sbase, decode_graph="full"), 24)
    assert "--cuda-graph-backend-decode breakable" in err.value.fix
    with pytest.raises(SlackTierError, match="begin_step needs N\\+1's hash ids on the host") as err:
        plug.check_scope(plug.SglangServing(**sbase, overlap_schedule=True, decode_graph="breakable"), 24)
    assert err.value.fix.startswith("--disable-overlap-schedule")
