"""Catch-up planner: the byte-cheapest route from the version a worker holds to the one it needs.

Every retained version may have a delta manifest (parent = version - 1) and/or a snapshot manifest.
A route is a snapshot s <= target followed by the deltas s+1..target, or (when the worker holds
version a < target) the deltas a+1..target alone. The planner prices every candidate by the bytes
still to download (chunks already held cost nothing) and returns the cheapest. No torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from decentrl.protocol import WeightsEntry


@dataclass(frozen=True)
class Route:
    steps: list[tuple[int, str]]
    """(version, kind) manifests to apply in order."""
    num_bytes: int
    """Payload bytes to download (an estimate: chunks shared between versions are counted twice)."""

    @property
    def description(self) -> str:
        if not self.steps:
            return "nothing to fetch"
        first, kinds = self.steps[0], {kind for _, kind in self.steps[1:]}
        start = f"snapshot v{first[0]}" if first[1] == "snapshot" else f"delta v{first[0]}"
        return f"{start} + {len(self.steps) - 1} deltas" if kinds else start


class NoRoute(LookupError):
    """No retained manifests lead from the held version to the target."""


def plan(held: int | None, target: int, index: list[WeightsEntry]) -> Route:
    """The cheapest route from `held` (None: nothing held) to `target`."""
    deltas = {e.version: e.payload_bytes for e in index if e.kind == "delta"}
    snapshots = {e.version: e.payload_bytes for e in index if e.kind == "snapshot"}
    if held == target:
        return Route([], 0)

    def chain_cost(start: int) -> int | None:
        """Bytes of the deltas start+1..target, None when one is missing."""
        total = 0
        for version in range(start + 1, target + 1):
            if version not in deltas:
                return None
            total += deltas[version]
        return total

    candidates: list[Route] = []
    if held is not None and held < target:
        cost = chain_cost(held)
        if cost is not None:
            steps = [(v, "delta") for v in range(held + 1, target + 1)]
            candidates.append(Route(steps, cost))
    for version, size in snapshots.items():
        if version > target:
            continue
        cost = chain_cost(version)
        if cost is not None:
            steps = [(version, "snapshot")] + [(v, "delta") for v in range(version + 1, target + 1)]
            candidates.append(Route(steps, size + cost))
    if not candidates:
        raise NoRoute(f"no retained snapshot or delta chain reaches version {target} from {held}")
    return min(candidates, key=lambda route: (route.num_bytes, len(route.steps)))
