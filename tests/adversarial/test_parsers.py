"""Content that makes a parser give up: a hermes tool call nested thousands of brackets deep, and
one whose argument is an integer of 5,000 digits (past Python's 4,300-digit conversion limit).
The coordinator replays every tool call; such a turn must be a clear 422 (`unscorable`, a strike:
the worker's own episode could not have played it either), answered at once, never a 500 or a
hang.

A real coordinator process (the `Arena`) on the tool-use environment with hermes tool calls, and
a real signed client.
"""

from __future__ import annotations

import time

import pytest
from tokenizers import Tokenizer

from benchmarks.adversarial.arena import Arena
from benchmarks.adversarial.attacks import submit, written_rollouts
from decentrl.config import ModelConfig
from decentrl.protocol import Lease, Rollout, Segment

pytestmark = pytest.mark.integration

DEPTH = 3000
DIGITS = 5000
OVERRIDES = [
    'task.env="tool_use"',
    'task.args={tool_format="hermes"}',
    "coordinator.group_size=2",
    f"coordinator.max_new_tokens={2 * DEPTH + 200}",
    "trust.verify_fraction=0.0",
]
HOSTILE = {
    "nested_brackets": '<tool_call>{"name": "lookup", "arguments": {"name": '
    + "[" * DEPTH
    + "]" * DEPTH
    + "}}"
    "</tool_call>",
    "huge_integer": '<tool_call>{"name": "lookup", "arguments": {"name": ' + "7" * DIGITS + "}}</tool_call>",
}


@pytest.fixture(scope="module")
def arena(tmp_path_factory: pytest.TempPathFactory):
    from decentrl.model.tiny import build_tiny, save_model_dir

    # room in the context for the hostile turns' token budget: the coordinator refuses a budget
    # no prompt leaves room for
    config = ModelConfig(hidden_size=64, num_heads=2, intermediate_size=128, max_positions=2 * DEPTH + 512)
    model, tokenizer = build_tiny(config)
    model_dir = save_model_dir(model, tokenizer, tmp_path_factory.mktemp("model"))
    arena = Arena(model_dir, tmp_path_factory.mktemp("run"), OVERRIDES, num_versions=1)
    yield arena
    arena.close()


def written(arena: Arena, lease: Lease, text: str) -> list[Rollout]:
    """Every slot of the lease answered with `text` as the model's turn (claimed log-probs -1)."""
    tokenizer = Tokenizer.from_file(str(arena.model_dir / "tokenizer.json"))
    ids = [*tokenizer.encode(text, add_special_tokens=False).ids, arena.trainer.info().eos_token_ids[0]]
    segment = Segment(
        source="model", token_ids=ids, logprobs=[-1.0] * len(ids), policy_versions=[0] * len(ids)
    )
    return written_rollouts(lease, lambda _task, _slot: segment)


@pytest.mark.parametrize("content", sorted(HOSTILE))
def test_content_that_breaks_a_parser_is_a_clear_422(arena: Arena, content: str) -> None:
    agent = arena.agent(content)
    try:
        rollouts = written(arena, agent.lease(1), HOSTILE[content])
        started = time.monotonic()
        status = submit(agent, rollouts)
        assert status == 422, status
        assert time.monotonic() - started < 30
        assert arena.stored(agent.worker_id) == 0
        strikes = arena.query(
            "SELECT reason FROM events WHERE kind = 'violation' AND worker_id = ?", agent.worker_id
        )
        assert strikes == [("unscorable",)]
    finally:
        agent.close()
