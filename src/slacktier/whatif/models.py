"""An emulated device's model: the planner's read-time model (plan.readmodel, ms) and the facts emulation adds.

A device model is `plan.readmodel.DeviceReadModel` (a, b, c, c_behind, in ms)
as measured on a device shared by `ranks_in_fit` TP ranks, plus the queue
depth its terms hold at. The emulated device (whatif.fluid) serves a page in
b / ranks_in_fit of its time and charges c_behind / ranks_in_fit per page of
a later-window layer arriving behind an earlier one; c is not an input there,
since a later layer waits for the earlier layers' pages by the queue order
itself. The prediction beside a what-if's measured stall (whatif.report) uses
all four terms, scaled to the ranks that share the device (`scaled`).

Built in: `nvme-paper` and `rdma-paper` (the paper's figures, plan.constants);
`this-disk` is written from a read fit (`this_disk_model`); any other model
is a TOML file with a [device] table (`load_device_model`):

    [device]
    name = "my-nvme"
    intercept_ms = 0.30      # a
    page_ms = 0.002          # b, with ranks_in_fit ranks reading at once
    behind_page_ms = 0.00025 # c_behind
    ahead_page_ms = 0.002    # c (optional; default b: the queue reads an earlier layer's pages first)
    queue_depth = 128
    ranks_in_fit = 1         # optional, default 1
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass
from pathlib import Path

from slacktier.errors import ErrorKind, SlackTierError, read_text
from slacktier.plan.constants import (PAPER_NVME_AHEAD_PAGE_MS, PAPER_NVME_BEHIND_PAGE_MS, PAPER_NVME_INTERCEPT_MS,
                                      PAPER_NVME_PAGE_MS, PAPER_NVME_QUEUE_DEPTH, PAPER_NVME_RANKS, PAPER_RDMA_MS,
                                      PAPER_RDMA_PAGES, PAPER_RDMA_QUEUE_DEPTH)
from slacktier.plan.readmodel import TERMS, DeviceReadModel

#: the [device] keys a model file must give; `ahead_page_ms`, `ranks_in_fit`, `name` and `origin` are optional
REQUIRED_KEYS = ("intercept_ms", "page_ms", "behind_page_ms", "queue_depth")
OPTIONAL_KEYS = ("name", "ahead_page_ms", "ranks_in_fit", "origin")
#: keys of the older per-page-in-us form, refused with the key to write instead
_US_KEYS = {"page_us": "page_ms", "behind_page_us": "behind_page_ms"}


@dataclass(frozen=True)
class DeviceModel:
    """A device's read-time terms (`read`, ms, with `ranks_in_fit` ranks sharing it), its queue depth and origin."""

    name: str
    read: DeviceReadModel
    queue_depth: int          # the depth the terms hold at (recorded; emulation does not model another depth)
    ranks_in_fit: int = 1     # ranks that shared the device when the terms were measured
    origin: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.read, DeviceReadModel):
            raise SlackTierError(ErrorKind.BAD_INPUT, f"device model {self.name}: read = {self.read!r}",
                                 fix="give the terms as a plan.readmodel.DeviceReadModel")
        for key in ("queue_depth", "ranks_in_fit"):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= 4096:
                raise SlackTierError(ErrorKind.BAD_INPUT, f"device model {self.name}: {key} = {v!r}",
                                     fix=f"give {key} as an integer in 1..4096")

    def page_share_ms(self) -> float:
        """Device time one page takes, in ms: b / ranks_in_fit (k ranks reading P pages each take k * this * P)."""
        return self.read.page_ms / self.ranks_in_fit

    def behind_share_ms(self) -> float:
        """Device time a later-window page arriving behind earlier work steals, in ms: c_behind / ranks_in_fit."""
        return self.read.behind_page_ms / self.ranks_in_fit

    def scaled(self, sharing: int) -> DeviceReadModel:
        """The read-time model of this device with `sharing` ranks reading it at once (the per-page terms scale
        with sharing / ranks_in_fit; a stays). Worked example: nvme-paper (fit with 4) read by 1 rank -> b =
        3.05 us / 4 = 0.7625 us."""
        k = sharing / self.ranks_in_fit
        r = self.read
        return DeviceReadModel(r.intercept_ms, k * r.page_ms, k * r.ahead_page_ms, k * r.behind_page_ms)

    def describe(self) -> str:
        """One line: the terms and their origin."""
        r = self.read
        return (f"{self.name}: a = {r.intercept_ms:.3f} ms, b = {1e3 * r.page_ms:.3f} us/page, c = "
                f"{1e3 * r.ahead_page_ms:.3f} us/page, c_behind = {1e3 * r.behind_page_ms:.3f} us/page at queue "
                f"depth {self.queue_depth}, terms of a device shared by {self.ranks_in_fit} rank(s) ({self.origin})")


#: the paper's NVMe fit (section 4.1), one disk shared by four TP ranks
NVME_PAPER = DeviceModel(
    "nvme-paper", DeviceReadModel(PAPER_NVME_INTERCEPT_MS, PAPER_NVME_PAGE_MS, PAPER_NVME_AHEAD_PAGE_MS,
                                  PAPER_NVME_BEHIND_PAGE_MS), PAPER_NVME_QUEUE_DEPTH, PAPER_NVME_RANKS,
    "paper section 4.1: T1 = 0.30 ms + 3.05 us P1 + 0.37 us P14, one NVMe shared by four ranks")


def _rdma_paper() -> DeviceModel:
    """The paper's RDMA reads as a line through its two ends: b = 0.04 ms / 140 pages, a = 0.21 ms - 600 b; one
    NIC per rank, no contention term (c_behind 0), c = b."""
    (p0, p1), (t0, t1) = PAPER_RDMA_PAGES, PAPER_RDMA_MS
    b = (t1 - t0) / (p1 - p0)
    return DeviceModel("rdma-paper", DeviceReadModel(t0 - p0 * b, b, b, 0.0), PAPER_RDMA_QUEUE_DEPTH, 1,
                       "paper section 6.8: 600-740 pages per rank and layer in 0.21-0.25 ms, one 400 Gb/s NIC per "
                       "rank, 4 threads x 2 queue pairs")


RDMA_PAPER = _rdma_paper()
BUILTIN_MODELS = {"nvme-paper": NVME_PAPER, "rdma-paper": RDMA_PAPER}


def model_from_dict(doc: dict, where: str) -> DeviceModel:
    """A DeviceModel from a `[device]` table; refuses a missing, unknown or bad key by name."""
    dev = doc.get("device")
    if not isinstance(dev, dict):
        raise SlackTierError(ErrorKind.BAD_INPUT, f"device model {where}: no [device] table",
                             fix="write [device] with " + ", ".join(REQUIRED_KEYS))
    for old, new in _US_KEYS.items():
        if old in dev:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"device model {where}: {old} = {dev[old]!r} is in us",
                                 fix=f"write {new} in ms ({old} / 1000), as plan.readmodel and tiers files do")
    unknown = sorted(set(dev) - {*REQUIRED_KEYS, *OPTIONAL_KEYS})
    if unknown:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"device model {where}: unknown key {unknown[0]}",
                             fix="use " + ", ".join(REQUIRED_KEYS + OPTIONAL_KEYS))
    for key in REQUIRED_KEYS:
        if key not in dev:
            raise SlackTierError(ErrorKind.BAD_INPUT, f"device model {where}: {key} is missing",
                                 fix=f"give {key} in [device]")
    name = str(dev.get("name", Path(where).stem))
    terms = {k: dev.get(k, dev["page_ms"]) for k in TERMS}
    try:
        read = DeviceReadModel(**terms)
    except SlackTierError as exc:
        bad = next(k for k in TERMS if f"term {k} = " in exc.message)
        raise SlackTierError(ErrorKind.BAD_INPUT, f"device model {name}: {bad} = {terms[bad]!r}",
                             fix=f"give {bad} in ms as a finite number >= 0") from None
    return DeviceModel(name, read, dev["queue_depth"], dev.get("ranks_in_fit", 1), str(dev.get("origin", where)))


def device_model_toml(m: DeviceModel) -> str:
    """`m` as a TOML file's text, a [device] table that `load_device_model` reads back equal."""
    # strings as JSON writes them: a TOML basic string with the same escapes; floats by repr, which reads back equal
    r = m.read
    return (f"[device]\nname = {json.dumps(m.name)}\nintercept_ms = {r.intercept_ms!r}\npage_ms = {r.page_ms!r}\n"
            f"ahead_page_ms = {r.ahead_page_ms!r}\nbehind_page_ms = {r.behind_page_ms!r}\n"
            f"queue_depth = {m.queue_depth}\nranks_in_fit = {m.ranks_in_fit}\norigin = {json.dumps(m.origin)}\n")


def load_device_model(spec: str) -> DeviceModel:
    """A built-in model by name (`nvme-paper`, `rdma-paper`) or a TOML file with a [device] table (`this-disk`
    is written as one from a read fit: `this_disk_model`)."""
    if spec in BUILTIN_MODELS:
        return BUILTIN_MODELS[spec]
    p = Path(spec)
    if not p.is_file():
        raise SlackTierError(ErrorKind.MISSING, f"device model {spec!r} is neither built in nor a file",
                             fix=f"use one of {', '.join(BUILTIN_MODELS)} or a TOML file with a [device] table")
    text = read_text(p, "device model", "TOML", "write a [device] table (slacktier.whatif.models)")
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"device model {spec} is not TOML: {exc}",
                             fix="write a [device] table") from exc
    return model_from_dict(doc, spec)


def this_disk_model(tiers_file: str | Path, tier: str = "disk", queue_depth: int = 128) -> DeviceModel:
    """`this-disk`: the read fit of `tier` in a tiers file from `slacktier probe --read-fit` (one rank), all four
    terms as fitted."""
    from slacktier.plan.tiers import load_tiers

    specs = {t.name: t for t in load_tiers(tiers_file)}
    if tier not in specs:
        raise SlackTierError(ErrorKind.MISSING, f"tiers file {tiers_file} has no tier {tier!r}",
                             fix="fit it first: slacktier probe --read-fit MANIFEST --read-tiers disk")
    fit = specs[tier].fit
    origin = f"read fit in {tiers_file}" + (f", measured {fit.measured}" if fit is not None and fit.measured else "")
    return DeviceModel("this-disk", specs[tier].read, queue_depth, 1, origin)
