"""Catch-up planner: the byte-cheapest route from the version a worker holds to the one it needs.

Every retained version may have a delta manifest (parent = version - 1), a snapshot manifest, and
patches (each against an anchor s: it turns any version a with s <= a < version into this one).
Those are the edges of a small graph over versions: a snapshot s reaches s from anywhere, delta v
goes v-1 -> v, patch (v, s) goes a -> v for every a in [s, v). A snapshot is only ever worth taking
first (it replaces the whole state), and every other edge moves forward, so the cheapest route is
one pass over the versions in increasing order (shortest path in a DAG). Costs are payload bytes
(a stage holder's: its section's); ties go to the route with fewer manifests. No torch.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field

from decentrl.protocol import WeightsEntry
from decentrl.weights.manifest import Manifest
from decentrl.weights.sections import stage_bytes


@dataclass(frozen=True)
class Route:
    steps: list[tuple[int, str]]
    """(version, kind) manifests to apply in order."""
    num_bytes: int
    """Payload bytes to download (an estimate: chunks shared between versions are counted twice)."""
    anchors: dict[int, int] = field(default_factory=dict)
    """The anchor of each patch step, by its version (a version may have a patch per anchor)."""

    def anchor(self, version: int, kind: str) -> int | None:
        """The anchor naming this step's manifest (None unless it is a patch)."""
        return self.anchors[version] if kind == "patch" else None

    @property
    def description(self) -> str:
        """E.g. 'snapshot v40 + 3 deltas', 'patch v57 (anchor v0)', 'patch v50 (anchor v0) + 7 deltas'."""
        if not self.steps:
            return "nothing to fetch"
        parts: list[str] = []
        deltas = 0
        for position, (version, kind) in enumerate(self.steps):
            if kind == "delta" and position > 0:
                deltas += 1
                continue
            if deltas:
                parts.append(f"{deltas} deltas")
                deltas = 0
            anchor = f" (anchor v{self.anchors[version]})" if kind == "patch" else ""
            parts.append(f"{kind} v{version}{anchor}")
        if deltas:
            parts.append(f"{deltas} deltas")
        return " + ".join(parts)


class NoRoute(LookupError):
    """No retained manifests lead from the held version to the target."""


def index_entry(manifest: Manifest) -> WeightsEntry:
    """How the index lists a manifest (the planner's view of it)."""
    return WeightsEntry(
        version=manifest.version,
        kind=manifest.kind,
        payload_bytes=manifest.payload_bytes,
        state_sha256=manifest.state_sha256,
        anchor=manifest.anchor,
        stage_bytes=stage_bytes(manifest),
        stage=manifest.stage,
    )


def entry_bytes(entry: WeightsEntry, stage: int | None) -> int | None:
    """What taking this manifest downloads: its payload, or `stage`'s section of it (None when the
    manifest has no such section). A stage trainer's manifest serves its own stage only."""
    if entry.stage is not None:
        return entry.payload_bytes if entry.stage == stage else None
    if stage is None:
        return entry.payload_bytes
    if entry.stage_bytes is None or stage >= len(entry.stage_bytes):
        return None
    return entry.stage_bytes[stage]


Cost = tuple[int, int]
"""(bytes, number of manifests), compared in that order."""


def plan(held: int | None, target: int, index: list[WeightsEntry], stage: int | None = None) -> Route:
    """The cheapest route from `held` (None: nothing held) to `target`, priced by the whole payload
    or (`stage`) by that stage's section."""
    if held == target:
        return Route([], 0)
    entries = [e for e in index if e.version <= target and entry_bytes(e, stage) is not None]

    def price(entry: WeightsEntry) -> int:
        size = entry_bytes(entry, stage)
        assert size is not None, "entries without one were left out"
        return size

    deltas = {e.version: e for e in entries if e.kind == "delta"}
    patches = sorted((e for e in entries if e.kind == "patch"), key=lambda e: e.version)
    patch_versions = [e.version for e in patches]
    # best[v]: the cheapest known way to hold v, as (cost, previous version or None, entry taken).
    best: dict[int, tuple[Cost, int | None, WeightsEntry | None]] = {}

    def relax(version: int, cost: Cost, previous: int | None, entry: WeightsEntry | None) -> None:
        if version not in best or cost < best[version][0]:
            best[version] = (cost, previous, entry)

    if held is not None and held < target:
        best[held] = ((0, 0), None, None)
    for entry in entries:
        if entry.kind == "snapshot":
            relax(entry.version, (price(entry), 1), None, entry)
    for version in range(min(best, default=target + 1), target):
        if version not in best:
            continue
        (size, count), _, _ = best[version]
        step = deltas.get(version + 1)
        if step is not None:
            relax(version + 1, (size + price(step), count + 1), version, step)
        for patch in patches[bisect_right(patch_versions, version) :]:  # those above `version`
            assert patch.anchor is not None, "the index lists every patch with its anchor"
            if patch.anchor <= version:
                relax(patch.version, (size + price(patch), count + 1), version, patch)
    if target not in best:
        raise NoRoute(f"no retained snapshot, delta chain or patch reaches version {target} from {held}")
    return _route(best, target)


def _route(best: dict[int, tuple[Cost, int | None, WeightsEntry | None]], target: int) -> Route:
    """Walk the cheapest edges back from `target` to where the route starts."""
    taken: list[WeightsEntry] = []
    version: int | None = target
    while version is not None:
        _, previous, entry = best[version]
        if entry is None:
            break
        taken.append(entry)
        version = previous
    taken.reverse()
    anchors = {e.version: e.anchor for e in taken if e.kind == "patch" and e.anchor is not None}
    return Route([(e.version, e.kind) for e in taken], best[target][0][0], anchors)
