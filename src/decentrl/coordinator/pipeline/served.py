"""A served episode checked instead of replayed: the env server's signatures and their binding.

For a served task (`task.served`) the coordinator does not run the environment (it may have no
browser). A rollout carries the env server's signed records (`Rollout.served`): one `EnvStep` per
model turn the environment answered, and the `EnvEnd` with the reward. It is accepted only if:

- the end names the episode the coordinator granted for this rollout's lease, task and slot
  (`env_episodes`), with the seed and environment of the task, and that episode has not failed;
- every record is signed by the key of the server the episode was granted to;
- walking the rollout's segments as a replay would (`episode.replay`: the same stop rules), each
  model turn the environment answered has the next step, numbered in order, whose action hash is
  the sha256 of the text the turn's tokens decode to, and the env segment that follows is the
  step's observation rendered by the chat template, token for token;
- the end counts exactly those steps, carries a reward and no failure, and names the hash of the
  last turn when the environment did not perform it.

Anything else is the worker's doing (forged, reordered, replayed or borrowed turns, a claimed
reward): a 422 `env_signature` or `env_mismatch`, a strike, nothing stored. The reward the rubric's
`env` term takes is the signed one (`SIGNED_REWARD` on the last message).
"""

from __future__ import annotations

from collections.abc import Iterator

from decentrl.coordinator.context import Context
from decentrl.coordinator.http.errors import Reason
from decentrl.envd_wire import SIGNED_REWARD, EnvEnd, EnvStep, ServedEpisode, action_digest, signed_bytes
from decentrl.envs.base import Message, Problem
from decentrl.envs.episode import ReplayMismatch, replay
from decentrl.protocol import Rollout
from decentrl.trust.identity import signature_valid


class Refused(ValueError):
    def __init__(self, detail: str, reason: Reason):
        super().__init__(detail)
        self.reason = reason


def _signed(record: EnvStep | EnvEnd, key: str) -> bool:
    return signature_valid(key, record.signature, signed_bytes(record))


def check_binding(rollout: Rollout, served: ServedEpisode, seed: int, env: str, granted: dict | None) -> None:
    """The end belongs to the episode granted for this slot, and every record bears its server's
    signature; Refused otherwise."""
    end = served.end
    if granted is None:
        raise Refused(f"episode {end.episode_id} was never granted by this coordinator", Reason.ENV_SIGNATURE)
    bound = (granted["lease_id"], granted["task_id"], granted["slot"])
    if bound != (rollout.lease_id, rollout.task_id, rollout.slot):
        detail = f"episode {end.episode_id} was granted to lease {bound[0]} task {bound[1]} slot {bound[2]}"
        raise Refused(detail, Reason.ENV_SIGNATURE)
    if granted["state"] == "failed":
        raise Refused(
            f"episode {end.episode_id} failed ({granted['reason']}): it is never trained",
            Reason.ENV_SIGNATURE,
        )
    key = granted["server_key"]
    for record in (end, *served.steps):
        if not _signed(record, key):
            detail = f"{type(record).__name__} of episode {record.episode_id} is not signed by env server {granted['server_id']}"
            raise Refused(detail, Reason.ENV_SIGNATURE)
    signed_fields = (end.lease_id, end.task_id, end.slot, end.seed, end.env, end.server_id, end.attempt)
    expected = (*bound, seed, env, granted["server_id"], granted["attempt"])
    if signed_fields != expected:
        raise Refused(
            f"the end record of episode {end.episode_id} names another slot or task", Reason.ENV_SIGNATURE
        )
    if end.failure is not None or end.reward is None:
        raise Refused(
            f"episode {end.episode_id} ended without a reward ({end.failure})", Reason.ENV_SIGNATURE
        )


class SignedTurns:
    """Answers a replay's model turns from the signed steps, in order, checking each action's hash."""

    def __init__(self, steps: list[EnvStep], episode_id: str):
        self.steps: Iterator[EnvStep] = iter(steps)
        self.episode_id = episode_id
        self.used = 0
        self.performed_last = False

    def __call__(self, problem: Problem, messages: list[Message]) -> list[Message] | None:
        step = next(self.steps, None)
        self.used += 1
        if step is None:
            raise ReplayMismatch(f"model turn {self.used} has no signed step")
        if step.episode_id != self.episode_id or step.turn != self.used:
            raise ReplayMismatch(f"signed step {self.used} is turn {step.turn} of episode {step.episode_id}")
        if step.action_sha256 != action_digest(str(messages[-1]["content"])):
            raise ReplayMismatch(
                f"signed step {self.used} answers another action than model turn {self.used}"
            )
        self.performed_last = True
        return None if step.observation is None else [m.model_dump() for m in step.observation]


def check_served(context: Context, seed: int, rollout: Rollout, granted: dict | None) -> list[Message]:
    """The episode's messages (its last carrying the signed reward), or Refused."""
    served = rollout.served
    if served is None:
        raise Refused(
            "this run's task is served: a rollout needs its env server's signed turns", Reason.ENV_SIGNATURE
        )
    check_binding(rollout, served, seed, context.run.task.env, granted)
    answers = SignedTurns(served.steps, served.end.episode_id)
    problem = context.env.problem(seed, "train")
    try:
        episode = replay(
            context.env,
            context.chat,
            problem,
            rollout.segments,
            context.config.max_new_tokens,
            context.model.max_context,
            respond=answers,
        )
    except ReplayMismatch as exc:
        raise Refused(f"served episode: {exc}", Reason.ENV_MISMATCH) from None
    end = served.end
    if answers.used != len(served.steps) or end.steps != answers.used:
        detail = f"{len(served.steps)} signed steps and an end after {end.steps}, for {answers.used} answered turns"
        raise Refused(detail, Reason.ENV_MISMATCH)
    # The last turn was performed iff the replay asked the environment about it (advance's rules).
    last_asked = episode.stop in ("final_answer", "context")
    final = None if last_asked else action_digest(str(episode.messages[-1]["content"]))
    if end.final_action_sha256 != final:
        raise Refused("the end record names another final turn than the rollout's", Reason.ENV_MISMATCH)
    return [*episode.messages, {"role": "environment", "content": "", SIGNED_REWARD: end.reward}]
