"""Tiers by name: a tier registers its page-source class and its typed options here, once, in its own module.

    register_tier("disk", DiskSource, DiskOptions)   # at the bottom of store/disk.py

registers the class for `open_source("disk", ...)` and the options struct for
`[table.disk]` in control files (`slacktier.config.register_tier_options`).
Every registered class has the same constructor shape:

    Cls(regions: Sequence[Region], options: TheirOptions | None = None, *,
        page_crc32c: Sequence[np.ndarray] | None = None, identity: TableIdentity | None = None)

with CRC32C verification of every read page on exactly when `page_crc32c`
(one uint32 array per region, in region order) is given (the DRAM tier checks
its pages once, at load). A tier with `stored_crc32c` (store/base.py) also takes
`verify_pages: bool = True`: it is given the checksums whatever
`verify_reads` says, and `verify_pages` says whether the page bytes are checked
as well. With an `identity` (`Manifest.identity`), a
check at open that the medium holds that table (`Cls.verify_identity`, which
`verify_identity` below runs again on a source kept across a reload).
A registered class overrides `verify_identity` and says `verify_by_default`
(store/base.py). A tier outside the
package (a plug-in, the tests' own tier) registers the same way from its own
module; importing `slacktier.store` registers the three built-in tiers.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from slacktier.config import Options, register_tier_options
from slacktier.errors import ErrorKind, SlackTierError
from slacktier.store.base import PageSource
from slacktier.tables.manifest import TableIdentity
from slacktier.tables.regions import Region


@dataclass(frozen=True)
class Tier:
    """One registered tier: its name, its page-source class and its options struct."""

    name: str
    source_cls: type[PageSource]
    options_cls: type[Options]


_TIERS: dict[str, Tier] = {}


def register_tier(name: str, source_cls: type[PageSource], options_cls: type[Options]) -> Tier:
    """Register tier `name` (also as `[table.<name>]` options); registering the same pair again is a no-op."""
    if not (isinstance(source_cls, type) and issubclass(source_cls, PageSource)) or inspect.isabstract(source_cls):
        raise SlackTierError(ErrorKind.BAD_INPUT, f"tier {name!r}: {source_cls!r} is not a concrete PageSource",
                             fix="register a PageSource subclass that implements submit, wait and close "
                                 "(or QueuedSource's _read)")
    if source_cls.verify_identity.__func__ is PageSource.verify_identity.__func__:  # type: ignore[attr-defined]
        raise SlackTierError(ErrorKind.BAD_INPUT, f"tier {name!r}: {source_cls.__name__} does not implement "
                             "verify_identity", fix="add the classmethod verify_identity(regions, options, identity) "
                             "that refuses a medium holding another table")
    if not isinstance(source_cls.verify_by_default, bool):
        raise SlackTierError(ErrorKind.BAD_INPUT, f"tier {name!r}: verify_by_default is "
                             f"{source_cls.verify_by_default!r}", fix="declare verify_by_default: bool on the class")
    known = _TIERS.get(name)
    if known is not None and known.source_cls is not source_cls:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"tier {name!r} is already registered with "
                             f"{known.source_cls.__name__}", fix="give the new tier another name")
    register_tier_options(name, options_cls)  # refuses a name taken with other options
    tier = Tier(name, source_cls, options_cls)
    _TIERS[name] = tier
    return tier


def get_tier(name: str) -> Tier:
    """The tier registered as `name`; raises BAD_INPUT naming the registered tiers."""
    try:
        return _TIERS[name]
    except KeyError:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"unknown page source kind {name!r}",
                             fix=f"choose one of {', '.join(tiers())}, or import the module that registers "
                                 "it") from None


def tiers() -> tuple[str, ...]:
    """Names of the registered tiers, in registration order (the built-ins first)."""
    return tuple(_TIERS)


def _typed(tier: Tier, options: Options | None) -> None:
    if options is not None and type(options) is not tier.options_cls:
        raise SlackTierError(ErrorKind.BAD_INPUT, f"tier {tier.name!r} takes {tier.options_cls.__name__}, got "
                             f"{type(options).__name__}", fix=f"pass {tier.options_cls.__name__} or None")


def open_source(name: str, regions: Sequence[Region], options: Options | None = None, *,
                page_crc32c: Sequence[np.ndarray] | None = None,
                identity: TableIdentity | None = None, verify_pages: bool = True) -> PageSource:
    """A page source of tier `name` over `regions`: CRC32C-checked with `page_crc32c` (each read page when
    `verify_pages`; a `stored_crc32c` tier compares its stored CRC32Cs with them either way), identity-checked at
    open with `identity`."""
    tier = get_tier(name)
    _typed(tier, options)
    if not tier.source_cls.stored_crc32c:
        return tier.source_cls(regions, options, page_crc32c=page_crc32c if verify_pages else None,
                               identity=identity)  # type: ignore[call-arg]
    return tier.source_cls(regions, options, page_crc32c=page_crc32c,  # type: ignore[call-arg]
                           identity=identity, verify_pages=verify_pages)


def verify_identity(name: str, regions: Sequence[Region], options: Options | None,
                    identity: TableIdentity) -> None:
    """Check, without opening a source, that tier `name`'s medium still holds table `identity` (TARGET or MISSING)."""
    tier = get_tier(name)
    _typed(tier, options)
    tier.source_cls.verify_identity(tuple(regions), options, identity)
