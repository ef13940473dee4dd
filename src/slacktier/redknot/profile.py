"""RedKnot-MLA profiles (layer fences, head counts) and Local/Global head policies.

A profile fixes which layers are *fence* layers (always fully recomputed) and
which are *reusable*; a head policy says, per layer, which logical attention
heads are Global (computed online for every row) and which are Local (served
from the offline artifact except on protected rows). The packed latent KV
stream is never split: heads are logical execution roles, not cache heads.

Worked example (Flash): 43 layers, fences 3 + 3, so layers 3..39 (37 layers)
are reusable; 64 heads with every 8th Global (heads 0, 8, ..., 56) leaves
56 Local heads per layer, 7 Local + 1 Global in each of the 8 output groups.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from slacktier.errors import ErrorKind, SlackTierError


@dataclass(frozen=True)
class RedKnotProfile:
    """Layer fences and head geometry of one deployment profile."""

    name: str
    num_layers: int
    fence_front: int
    fence_back: int
    num_heads: int
    o_groups: int
    global_head_stride: int = 8
    reusable: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        if self.num_layers <= 0 or self.fence_front < 0 or self.fence_back < 0:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"profile {self.name}: bad layer counts",
                                 fix="give num_layers > 0 and non-negative fences")
        if self.fence_front + self.fence_back >= self.num_layers:
            raise SlackTierError(ErrorKind.BAD_INPUT,
                                 f"profile {self.name}: fences {self.fence_front}+{self.fence_back} leave no "
                                 f"reusable layer of {self.num_layers}", fix="use smaller fences")
        if self.num_heads % self.o_groups:
            raise SlackTierError(ErrorKind.BAD_INPUT,
                                 f"profile {self.name}: {self.num_heads} heads do not split into "
                                 f"{self.o_groups} output groups", fix="o_groups must divide num_heads")
        if self.global_head_stride < 1:
            raise SlackTierError(ErrorKind.BAD_INPUT, "global_head_stride must be >= 1",
                                 fix="use 8 (every 8th head Global) unless measured otherwise")
        object.__setattr__(self, "reusable", tuple(range(self.fence_front, self.num_layers - self.fence_back)))

    @property
    def fence_layout(self) -> str:
        """'3F-37R-3F' style summary."""
        return f"{self.fence_front}F-{len(self.reusable)}R-{self.fence_back}F"

    def is_reusable(self, layer: int) -> bool:
        """True if `layer` may use offline Local-head artifacts."""
        return self.fence_front <= layer < self.num_layers - self.fence_back

    def to_dict(self) -> dict:
        """JSON-ready fields (what the certificate binds)."""
        return {"name": self.name, "num_layers": self.num_layers, "fence_front": self.fence_front,
                "fence_back": self.fence_back, "num_heads": self.num_heads, "o_groups": self.o_groups,
                "global_head_stride": self.global_head_stride}

    def digest(self) -> str:
        """sha256 of the profile's defining fields."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()

    def default_policy(self) -> HeadPolicy:
        """Every `global_head_stride`-th head Global (0, 8, 16, ...) in every layer."""
        return HeadPolicy.every_nth(self.num_layers, self.num_heads, self.global_head_stride)


# The paper's two DeepSeek-V4 profiles (Flash = the transformers config defaults).
FLASH = RedKnotProfile("flash", num_layers=43, fence_front=3, fence_back=3, num_heads=64, o_groups=8)
PRO = RedKnotProfile("pro", num_layers=61, fence_front=3, fence_back=3, num_heads=128, o_groups=16)
PROFILES: dict[str, RedKnotProfile] = {"flash": FLASH, "pro": PRO}


def profile_for_config(config, *, name: str = "custom", fence_front: int = 1, fence_back: int = 1,
                       global_head_stride: int = 8) -> RedKnotProfile:
    """A profile matching a DeepseekV4Config (tiny test/bench models use 1 + 1 fences)."""
    return RedKnotProfile(name, num_layers=config.num_hidden_layers, fence_front=fence_front,
                          fence_back=fence_back, num_heads=config.num_attention_heads,
                          o_groups=config.o_groups, global_head_stride=global_head_stride)


@dataclass(frozen=True)
class HeadPolicy:
    """Per layer, the Global heads (sorted); every other head is Local."""

    num_heads: int
    global_heads: tuple[tuple[int, ...], ...]  # [num_layers][k]
    source: str = "stride"

    def __post_init__(self) -> None:
        for layer, heads in enumerate(self.global_heads):
            if list(heads) != sorted(set(heads)) or any(h < 0 or h >= self.num_heads for h in heads):
                raise SlackTierError(ErrorKind.BAD_INPUT, f"bad Global head list {heads}", layer=layer,
                                     fix=f"give sorted, distinct heads in [0, {self.num_heads})")

    @classmethod
    def every_nth(cls, num_layers: int, num_heads: int, stride: int) -> HeadPolicy:
        """Heads h with h % stride == 0 are Global (RedKnot's default, 56/8 on Flash)."""
        heads = tuple(h for h in range(num_heads) if h % stride == 0)
        return cls(num_heads, tuple(heads for _ in range(num_layers)), source=f"stride-{stride}")

    @classmethod
    def all_global(cls, num_layers: int, num_heads: int) -> HeadPolicy:
        """Every head Global: reuse degenerates to full recompute (an exactness check)."""
        heads = tuple(range(num_heads))
        return cls(num_heads, tuple(heads for _ in range(num_layers)), source="all-global")

    def globals_of(self, layer: int) -> tuple[int, ...]:
        """Global heads of `layer`."""
        return self.global_heads[layer]

    def locals_of(self, layer: int) -> tuple[int, ...]:
        """Local heads of `layer`."""
        g = set(self.global_heads[layer])
        return tuple(h for h in range(self.num_heads) if h not in g)

    def local_count(self, layers) -> int:
        """Sum of Local heads over `layers`."""
        return sum(len(self.locals_of(layer)) for layer in layers)

    def to_dict(self) -> dict:
        """JSON-ready form."""
        return {"num_heads": self.num_heads, "global_heads": [list(h) for h in self.global_heads],
                "source": self.source}

    @classmethod
    def from_dict(cls, data: dict) -> HeadPolicy:
        """Inverse of to_dict."""
        return cls(int(data["num_heads"]), tuple(tuple(int(h) for h in hs) for hs in data["global_heads"]),
                   source=str(data.get("source", "file")))

    def digest(self) -> str:
        """sha256 of the Global head sets (the source label is not part of it)."""
        body = json.dumps({"num_heads": self.num_heads, "global_heads": [list(h) for h in self.global_heads]})
        return hashlib.sha256(body.encode()).hexdigest()


def policy_from_distances(mean_distance, global_fraction: float = 1 / 8) -> HeadPolicy:
    """Global = the heads with the longest mean attention distance, per layer.

    `mean_distance` is [num_layers, num_heads] (rows, from measure_head_distances);
    in each layer the round(global_fraction * heads) (at least 1) farthest-looking
    heads become Global, since a head that reads far back is the one whose output
    changes most when a document moves into a new context.
    """
    import torch

    dist = torch.as_tensor(mean_distance, dtype=torch.float64)
    layers, heads = dist.shape
    k = max(1, round(global_fraction * heads))
    chosen = []
    for layer in range(layers):
        top = torch.topk(dist[layer], k).indices.tolist()
        chosen.append(tuple(sorted(int(h) for h in top)))
    return HeadPolicy(heads, tuple(chosen), source=f"distance-top{k}")
