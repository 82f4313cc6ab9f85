"""How `decentrl bench pipeline` times its cells, on a machine it shares.

The engines compared in one cell (the pipeline behind each server, the whole model) take turns,
one generation each, until each has run `repeats` generations and all together `min_seconds` per
engine: a burst of load from another process then falls on all of them alike, where timing one
engine after the other would hand it to whichever ran during the burst. A cell reports the median
generation.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable

from tqdm import tqdm

from decentrl.engines.base import Completion

Generate = Callable[..., list[Completion]]
"""An engine's `generate(prompts, seed=...)`, its sampling parameters bound."""
WARM_UP_SEED = 1 << 20
MAX_ROUNDS = 50


def timed(generate: Generate, prompts: list[list[int]], seed: int) -> tuple[float, int]:
    """Seconds of one generation, and the tokens it generated."""
    started = time.perf_counter()
    completions = generate(prompts, seed=seed)
    return time.perf_counter() - started, sum(len(c.token_ids) for c in completions)


class Measure:
    def __init__(self, repeats: int, min_seconds: float, cells: int):
        self.repeats, self.min_seconds = repeats, min_seconds
        self.bar = tqdm(total=cells, desc="bench pipeline", unit="cell", file=sys.stderr, leave=False)

    def cells(
        self, engines: dict[str, Generate], prompts: list[list[int]], label: str, warm_up: bool
    ) -> dict[str, dict]:
        """Per engine: tokens/s and seconds of its median generation, and how many it ran."""
        self.bar.set_postfix_str(label)
        if warm_up:  # first-call allocations of this batch shape, a first connection
            for generate in engines.values():
                generate(prompts, seed=WARM_UP_SEED)
        seconds: dict[str, list[float]] = {name: [] for name in engines}
        tokens: dict[str, int] = {}
        while self._more(seconds):
            for name, generate in engines.items():
                elapsed, tokens[name] = timed(generate, prompts, len(seconds[name]))
                seconds[name].append(elapsed)
        self.bar.update(len(engines))
        return {
            name: {
                "tokens_per_s": round(tokens[name] / statistics.median(times), 1),
                "seconds": round(statistics.median(times), 4),
                "tokens": tokens[name],
                "generations": len(times) + warm_up,
            }
            for name, times in seconds.items()
        }

    def _more(self, seconds: dict[str, list[float]]) -> bool:
        rounds = len(next(iter(seconds.values())))
        total = sum(sum(times) for times in seconds.values())
        return rounds < self.repeats or (total < self.min_seconds * len(seconds) and rounds < MAX_ROUNDS)
