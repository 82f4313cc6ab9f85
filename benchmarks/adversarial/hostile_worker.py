"""`python -m benchmarks.adversarial.hostile_worker CONFIG_JSON`: the real worker process, except that every
rollout it plays claims halved log-probs (a forged-log-prob attacker). Used by the adversarial
benchmark's learning run with a quarter of the workers hostile; never part of a real deployment.
"""

from __future__ import annotations

import sys

from decentrl.config import WorkerConfig
from decentrl.envs.player import Player
from decentrl.protocol import Rollout
from decentrl.worker import main_worker


class ForgingPlayer(Player):
    """Plays honestly, then claims half of every sampled token's log-prob."""

    def play(self, engine, lease, seed: int) -> list[Rollout]:
        rollouts = super().play(engine, lease, seed)
        for rollout in rollouts:
            for segment in rollout.segments:
                if segment.logprobs:
                    segment.logprobs = [value / 2 for value in segment.logprobs]
        return rollouts


if __name__ == "__main__":
    sys.exit(main_worker(WorkerConfig.model_validate_json(sys.argv[1]), ForgingPlayer))
