"""Verification of a staged table: every page's CRC32C, the target headers, and N random rows per region
against the source (the checkpoint, or the synthetic generator rerun). Context packing's packed regions
(tables.packing) are checked the same way: every page's CRC32C, and sampled packed pages' rows against the
source rows of the ids the page names (and the page's context ordinal against its place).

Every mismatch names its layer, rank and page (and row, for a row check), so an
operator can find the bad region. Reads are O_DIRECT, so the page cache cannot
hide what is on the medium.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from slacktier.errors import ErrorKind, SlackTierError
from slacktier.tables.layout import PAGE_BYTES, ROW_BYTES, offset_in_page, page_of_row
from slacktier.tables.manifest import Manifest, header_mismatch, read_target_header
from slacktier.tables.odirect import DirectFile, aligned_array
from slacktier.tables.packing import page_slot_ids
from slacktier.tables.pagecrc import page_crcs
from slacktier.tables.page_writer import DEFAULT_CHUNK_BYTES
from slacktier.tables.row_source import RowSource
from slacktier.tables.stage import source_from_manifest


@dataclass(frozen=True)
class Mismatch:
    """One problem found: kind is "checksum", "row", "read", "header" or "packed" (a packed page naming another
    context); page is the page inside the region (or packed region)."""

    kind: str
    layer: int | None
    rank: int | None
    page: int | None
    row: int | None = None      # global row id, for row checks
    detail: str = ""

    def line(self) -> str:
        where = ", ".join(f"{k} {v}" for k, v in (("layer", self.layer), ("rank", self.rank), ("page", self.page),
                                                  ("row", self.row)) if v is not None)
        return f"{self.kind} mismatch: {where}" + (f": {self.detail}" if self.detail else "")


@dataclass
class VerifyReport:
    """What `verify_table` checked and what it found."""

    manifest_path: str
    pages_checked: int = 0
    rows_checked: int = 0
    regions: int = 0
    seconds: float = 0.0
    mismatches: list[Mismatch] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def lines(self, limit: int = 50) -> list[str]:
        """A short human report: the summary and up to `limit` mismatches."""
        status = "OK" if self.ok else f"FAILED: {len(self.mismatches)} mismatch(es)"
        out = [f"verify {self.manifest_path}: {status}; {self.regions} regions, {self.pages_checked} page "
               f"checksums, {self.rows_checked} rows against the source, {self.seconds:.1f} s"]
        out += [m.line() for m in self.mismatches[:limit]]
        if len(self.mismatches) > limit:
            out.append(f"... and {len(self.mismatches) - limit} more")
        return out


def verify_table(manifest: Manifest | str | Path, rows_per_region: int = 200, *, seed: int = 0,
                 checkpoint: str | Path | list[str | Path] | None = None, check_pages: bool = True,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, buffered: bool = False, progress: bool = True) -> VerifyReport:
    """Check a staged table; the report lists every mismatch (never raises for a bad page).

    `rows_per_region` random rows per (layer, rank) region, always including the
    region's first and last row, are compared byte for byte with the source;
    `seed` picks them; `checkpoint` overrides the checkpoint path the manifest
    recorded. Missing files or a bad manifest raise SlackTierError.
    """
    t0 = time.perf_counter()
    m = manifest if isinstance(manifest, Manifest) else Manifest.load(manifest)
    report = VerifyReport(manifest_path=m.path, regions=len(m.regions) + len(m.packed_regions()))
    for p in m.targets:
        if not Path(p).exists():
            raise SlackTierError(ErrorKind.MISSING, f"target {p} of manifest {m.path} does not exist",
                                 fix="restage the table")
    files = [DirectFile(p, buffered=buffered) for p in m.targets]
    try:
        _check_headers(m, report)
        if check_pages:
            _check_pages(m, files, chunk_bytes, progress, report)
        if rows_per_region > 0:
            source = source_from_manifest(m, checkpoint)
            _check_rows(m, files, source, rows_per_region, seed, progress, report)
            _check_packed(m, files, source, rows_per_region, seed, report)
    finally:
        for f in files:
            f.close()
    report.seconds = time.perf_counter() - t0
    return report


def _check_headers(m: Manifest, report: VerifyReport) -> None:
    # A truncated target is left to the page and row passes, which name the first region page that is gone.
    for i, path in enumerate(m.targets):
        header, _ = read_target_header(path)
        problem = header_mismatch(path, header, i, m.identity)
        if problem is not None:
            report.mismatches.append(Mismatch("header", None, None, None, detail=problem[0]))


def _check_pages(m: Manifest, files: list[DirectFile], chunk_bytes: int, progress: bool,
                 report: VerifyReport) -> None:
    crcs = m.checksums()
    buf = aligned_array(chunk_bytes)
    per_chunk = chunk_bytes // PAGE_BYTES
    got = np.empty(per_chunk, dtype=np.uint32)
    bar = tqdm(total=m.total_pages * PAGE_BYTES, unit="B", unit_scale=True, desc="verify pages", disable=not progress)
    try:
        for r in m.regions + list(m.packed_regions()):
            for page0 in range(0, r.pages, per_chunk):
                n = min(per_chunk, r.pages - page0)
                pages = buf[:n * PAGE_BYTES].reshape(n, PAGE_BYTES)
                try:
                    files[r.device].pread_into(pages, r.offset_bytes + page0 * PAGE_BYTES)
                except SlackTierError as exc:
                    if exc.kind != ErrorKind.IO:
                        raise
                    n = _readable_prefix(files[r.device], pages, r.offset_bytes + page0 * PAGE_BYTES)
                    pages = pages[:n]
                    report.mismatches.append(Mismatch("read", r.layer, r.rank, page0 + n, detail=(
                        f"pages {page0 + n}..{r.pages - 1} of the region could not be read: {exc.message}")))
                    failed = True
                else:
                    failed = False
                page_crcs(pages, got[:n])
                want = crcs[r.crc_first_page + page0:r.crc_first_page + page0 + n]
                for bad in np.flatnonzero(got[:n] != want):
                    report.mismatches.append(Mismatch("checksum", r.layer, r.rank, int(page0 + bad), detail=(
                        f"crc32c {int(got[bad]):#010x}, manifest {int(want[bad]):#010x}")))
                report.pages_checked += n
                bar.update(n * PAGE_BYTES)
                if failed:
                    break
    finally:
        bar.close()


def _check_packed(m: Manifest, files: list[DirectFile], source: RowSource, rows_per_region: int, seed: int,
                  report: VerifyReport) -> None:
    """Sampled packed pages (the first, the last, and random ones: about `rows_per_region` rows per packed
    region): each must name its own context ordinal and hold the source's rows of the ids it names."""
    if m.packing is None:
        return
    rng = np.random.default_rng(seed + 1)
    ppc = m.packing.pages_per_context
    page = aligned_array(PAGE_BYTES)
    for r in m.packed_regions():
        n = max(1, rows_per_region // max(1, len(m.packing.rank_columns[0])))
        picks = np.unique(np.concatenate([[0, r.pages - 1], rng.integers(0, r.pages, size=n)]))
        for p in picks.tolist():
            try:
                files[r.device].pread_into(page, r.offset_bytes + p * PAGE_BYTES)
            except SlackTierError as exc:
                if exc.kind != ErrorKind.IO:
                    raise
                report.mismatches.append(Mismatch("read", r.layer, r.rank, p, detail=f"packed region: {exc.message}"))
                continue
            named = page_slot_ids(page)
            if named is None or named[0] != p // ppc or not named[1]:
                report.mismatches.append(Mismatch("packed", r.layer, r.rank, p, detail=(
                    f"the packed page names {'nothing' if named is None else f'context {named[0]}'}, its place is "
                    f"context {p // ppc}")))
                continue
            ids = np.array(named[1], dtype=np.int64)
            want = source.rows(r.layer, ids)
            for s, (g, expect) in enumerate(zip(ids.tolist(), want)):
                if not np.array_equal(page[s * ROW_BYTES:(s + 1) * ROW_BYTES], expect):
                    report.mismatches.append(Mismatch("row", r.layer, r.rank, p, row=g,
                                                      detail=f"packed region, row slot {s}"))
                report.rows_checked += 1


def _readable_prefix(f: DirectFile, pages: np.ndarray, offset: int) -> int:
    """After a failed chunk read: read page by page, return how many leading pages could be read."""
    for i in range(pages.shape[0]):
        try:
            f.pread_into(pages[i], offset + i * PAGE_BYTES)
        except SlackTierError:
            return i
    return pages.shape[0]


def _check_rows(m: Manifest, files: list[DirectFile], source: RowSource, rows_per_region: int, seed: int,
                progress: bool, report: VerifyReport) -> None:
    rng = np.random.default_rng(seed)
    page = aligned_array(PAGE_BYTES)
    # pieces: contiguous global rows each (the region itself under columns; one per column span otherwise);
    # base: the piece's first page in its region, so a mismatch names the region's page
    pieces = [(p, (p.offset_bytes - region.offset_bytes) // PAGE_BYTES) for region in m.regions
              for p in m.pieces(region)]
    for r, base in tqdm(pieces, desc="verify rows", unit="region", disable=not progress):
        if r.rows == 0:
            continue
        picks = np.unique(np.concatenate([[0, r.rows - 1],
                                          rng.integers(0, r.rows, size=max(0, rows_per_region - 2))]))
        want = source.rows(r.layer, r.row_start + picks)  # [n, 264]
        current = -1
        for local, expect in zip(picks.tolist(), want):
            p = page_of_row(local)
            if p != current:
                try:
                    files[r.device].pread_into(page, r.offset_bytes + p * PAGE_BYTES)
                except SlackTierError as exc:
                    if exc.kind != ErrorKind.IO:
                        raise
                    report.mismatches.append(Mismatch("read", r.layer, r.rank, base + p, row=r.row_start + local,
                                                      detail=exc.message))
                    current = -1
                    continue
                current = p
            at = offset_in_page(local)
            got = page[at:at + ROW_BYTES]
            if not np.array_equal(got, expect):
                diff = np.flatnonzero(got != expect)
                report.mismatches.append(Mismatch("row", r.layer, r.rank, base + p, row=r.row_start + local, detail=(
                    f"{diff.size} of {ROW_BYTES} bytes differ, first at byte {int(diff[0])} of the row")))
            report.rows_checked += 1
