"""Programs that sleep until the sandbox kills them, sent in a worker's own leases: they cost its own
scoring budget, its own room for open groups and its turn in the scoring pool, not the honest
worker's rate. The code environment (hidden tests in the sandbox), a real coordinator process and
real signed clients; the attacker ignores 429s and submits again at once."""

from __future__ import annotations

import threading
import time

import pytest
from tokenizers import Tokenizer

from adversarial.processes import confident_arena
from benchmarks.adversarial.arena import Agent, Arena
from benchmarks.adversarial.attacks import submit, written_rollouts
from benchmarks.adversarial.outsiders import honest_rate
from decentrl.protocol import Lease, Rollout, Segment, TaskSpec

pytestmark = pytest.mark.integration

WALL_SECONDS = 3.0
MIN_RATE_KEPT = 0.7
OVERRIDES = [
    'task.env="code"',
    f"task.args={{sandbox={{cpu_seconds=2, wall_seconds={WALL_SECONDS}}}}}",
    "coordinator.group_size=2",
    "coordinator.max_new_tokens=48",
    "coordinator.max_pending_groups=24",
    "trust.verify_fraction=0.0",
]
SLEEP = "import time\ntime.sleep({})"


@pytest.fixture(scope="module")
def arena(tmp_path_factory: pytest.TempPathFactory):
    with confident_arena(tmp_path_factory, OVERRIDES, num_versions=1) as arena:
        yield arena


def sleeping(arena: Arena, tokenizer: Tokenizer, lease: Lease) -> list[Rollout]:
    """Every slot of `lease` answered by a program that sleeps past the sandbox's wall limit (a
    different duration per slot, so that the slots do not repeat each other). Written without the
    model: the attacker's sampling would run in this process and take the CPU the honest worker's
    measured rate needs, which on a real network is the attacker's own machine's."""
    eos = arena.trainer.info().eos_token_ids[0]

    def segment(_task: TaskSpec, slot: int) -> Segment:
        ids = [
            *tokenizer.encode(SLEEP.format(int(WALL_SECONDS) * 10 + slot), add_special_tokens=False).ids,
            eos,
        ]
        return Segment(
            source="model",
            token_ids=ids,
            logprobs=[-1.0] * len(ids),
            policy_versions=[arena.latest] * len(ids),
        )

    return written_rollouts(lease, segment)


@pytest.mark.slow  # CI time: `make test-all` runs it
def test_sleeping_programs_cost_their_sender_not_the_honest_worker(arena: Arena) -> None:
    honest, hog = arena.agent("honest"), arena.agent("sleeper")
    hog.client.retry_rate_limited = False
    tokenizer = Tokenizer.from_file(str(arena.model_dir / "tokenizer.json"))
    stop, statuses = threading.Event(), []

    def attack(agent: Agent) -> None:
        while not stop.is_set():
            try:
                lease = agent.lease(64)
                statuses.append(submit(agent, sleeping(arena, tokenizer, lease)))
            except Exception:  # noqa: BLE001 - refused: the attacker tries again
                statuses.append(0)
                time.sleep(0.1)

    try:
        honest_rate(honest, 1.0)  # warm up
        baseline = honest_rate(honest, 6.0)
        thread = threading.Thread(target=attack, args=(hog,), daemon=True)
        thread.start()
        time.sleep(4 * WALL_SECONDS)  # its programs fill the pool and its groups wait for rewards
        attacked = honest_rate(honest, 6.0)
        stop.set()
        thread.join(timeout=60)
        pending = arena.query("SELECT COUNT(*) FROM reward_pending WHERE worker_id = ?", hog.worker_id)[0][0]
    finally:
        stop.set()
        honest.close()
        hog.close()
    print(f"honest rate kept under sleeping programs: {attacked / baseline:.2f}; sleeper pending {pending}")
    print(f"sleeper's submissions: {sorted(set(statuses))}, {statuses.count(200)} accepted")
    assert attacked >= MIN_RATE_KEPT * baseline, (attacked, baseline, statuses)
    # unscored groups count as held: the sleeper never has more queued than its lease cap allows
    assert pending <= arena.config.trust.lease_groups_floor * arena.config.coordinator.group_size, pending
