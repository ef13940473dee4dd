"""RedKnot-MLA: offline Local-head artifacts and online reuse on DeepSeek-V4 attention.

profile.py   profiles (Flash 3F-37R-3F 56/8, Pro 3F-55R-3F 112/16), Local/Global head policies
attention.py per-head attention core: float64 RoPE tables, segment partials, LSE merge, sliced wo_a
runner.py    layer loop over transformers' DeepseekV4ForCausalLM: full recompute or reuse
protect.py   protected rows (query, new, dirty, boundary, indexer top-k, recent tail; budget)
artifacts.py page format, certificates, atomic publication, validation and fallback reasons
service.py   build artifacts / serve prefills; artifact pages read through the engine's per-layer reads
placement.py where each reusable layer's artifact pages are read from: a control file, one table per layer
ledger.py    head-row ceiling and per-operator arithmetic
model.py     tiny and bench DeepseekV4 configs, seeded models, weights digest
corpus.py    real-text documents (installed source files, DeepSeek-V4 tokenizer)

The evidence's experiments live beside their benchmarks in benchmarks/redknot/, not in the package: the retrieval
task (retrieval.py), the trainer of the small model it is measured on (train.py) and adaptive sparse MoE
(sparse_moe.py).
"""

from slacktier.redknot.artifacts import ArtifactStore, Certificate, FallbackReason, TPGeometry
from slacktier.redknot.ledger import head_row_ceiling, operator_ledger
from slacktier.redknot.placement import artifact_placement
from slacktier.redknot.profile import FLASH, PRO, HeadPolicy, RedKnotProfile, profile_for_config
from slacktier.redknot.protect import ProtectionPolicy

# The runner and the service run transformers' DeepseekV4 (the `models` extra): imported on first use, so the
# artifact store, placement and ledger import on the core install and the rest refuses in one line naming it.
_LAZY = {"Layout": "runner", "RedKnotRunner": "runner", "Segment": "runner", "RedKnotService": "service"}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)


__all__ = ["ArtifactStore", "Certificate", "FallbackReason", "TPGeometry", "head_row_ceiling", "operator_ledger",
           "FLASH", "PRO", "HeadPolicy", "RedKnotProfile", "profile_for_config", "ProtectionPolicy", "Layout",
           "RedKnotRunner", "Segment", "RedKnotService", "artifact_placement"]
