"""Episodes on an engine (worker, evaluation) and their replay from token ids (coordinator).

An episode alternates model turns, sampled token-in/token-out on the engine (the model's tokens
are never re-tokenised), and environment turns, whose text is encoded once and appended as an
`env` segment that the trainer masks out of the loss. `advance` decides what follows a model
turn; the worker and the coordinator's `replay` both call it, so the coordinator rebuilds the
same environment tokens id for id, or rejects the rollout.

Stop conditions: a final answer (`respond` returns None), `max_turns` assistant turns, the token
budget (`max_new_tokens` model tokens over the whole episode; a turn cut without its end-of-turn
token ends the episode too), and the model's context (`SamplingParams.max_context`): a model turn
is cut where the context ends, and an environment turn after which not one model token would fit
ends the episode ("context") instead of being appended. The coordinator leases only prompts that
leave the whole budget free, so the first turn is never cut by the context.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal

from decentrl.envs.base import Environment, Message, Problem, StopReason
from decentrl.envs.chat import ChatFormat
from decentrl.envs.images import TaskImage
from decentrl.protocol import SamplingParams, Segment


class ReplayMismatch(ValueError):
    """A rollout whose environment turns are not what the environment answers."""


Respond = Callable[[Problem, list[Message]], "list[Message] | None"]
"""What answers a model turn: the environment's own `respond`, or a served episode's env server."""


@dataclass
class Episode:
    problem: Problem
    prompt_ids: list[int]
    messages: list[Message]
    segments: list[Segment] = field(default_factory=list)
    stop: StopReason | None = None

    @property
    def done(self) -> bool:
        return self.stop is not None

    @property
    def num_model_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.segments if s.source == "model")

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + [t for s in self.segments for t in s.token_ids]

    @property
    def images(self) -> tuple[TaskImage, ...]:
        """The images of the episode's image tokens, in order (the prompt's, drawn from the seed)."""
        return self.problem.images

    def finish_reason(self, eos_token_ids: tuple[int, ...]) -> Literal["stop", "length"]:
        """The wire's finish reason: "stop" when the last model token is an end-of-turn token."""
        last = [s for s in self.segments if s.source == "model"][-1].token_ids[-1]
        return "stop" if last in eos_token_ids else "length"

    @property
    def transcript(self) -> list[dict]:
        """The episode's turns after the prompt, for logs (the token ids are the truth)."""
        first = 1 if isinstance(self.problem.prompt, str) else len(self.problem.prompt)
        return self.messages[first:]


def start(
    env: Environment, chat: ChatFormat, problem: Problem, prompt_ids: list[int] | None = None
) -> Episode:
    """A new episode of `problem`; `prompt_ids` are the leased ones on a worker (never re-rendered)."""
    prompt = (
        [{"role": "user", "content": problem.prompt}] if isinstance(problem.prompt, str) else problem.prompt
    )
    if prompt_ids is None:
        prompt_ids = chat.prompt_ids(problem.prompt, env.tools or None)
    return Episode(problem, list(prompt_ids), list(prompt))


def advance(
    env: Environment,
    chat: ChatFormat,
    episode: Episode,
    model_ids: list[int],
    budget: int,
    max_context: int | None = None,
    respond: Respond | None = None,
) -> list[int] | None:
    """Record one model turn (already in `episode.segments`); return the env tokens that follow it,
    or None when the episode ends. `respond` answers the turn instead of `env.respond` (a served
    episode's env server on a worker; its signed turns on the coordinator)."""
    episode.messages.append({"role": "assistant", "content": chat.turn_text(model_ids)})
    num_turns = sum(1 for s in episode.segments if s.source == "model")
    ended_by_eos = bool(model_ids) and model_ids[-1] in chat.eos_token_ids
    if not ended_by_eos or episode.num_model_tokens >= budget:
        episode.stop = "max_tokens"
    elif num_turns >= env.max_turns:
        episode.stop = "max_turns"
    else:
        reply = (respond or env.respond)(episode.problem, episode.messages)
        if reply is None:
            episode.stop = "final_answer"
        else:
            env_ids = chat.env_ids(reply, env.tools or None, ended_with=model_ids[-1])
            if max_context is not None and len(episode.token_ids) + len(env_ids) >= max_context:
                episode.stop = "context"  # the reply would leave no room for the model's next token
                return None
            episode.messages += reply
            return env_ids
    return None


def turn_room(episode: Episode, budget: int, max_context: int | None) -> int:
    """How many tokens the episode's next model turn may take: its share of the budget, cut where
    the model's context ends."""
    left = budget - episode.num_model_tokens
    return left if max_context is None else min(left, max_context - len(episode.token_ids))


def run_episodes(
    engine,
    env: Environment,
    chat: ChatFormat,
    episodes: list[Episode],
    sampling: SamplingParams,
    seed: int,
    respond_of: Callable[[Episode], Respond] | None = None,
    threads: int = 1,
) -> list[Episode]:
    """Play every episode to the end, all active ones batched per turn. Turn 0 is exactly one
    `engine.generate(prompts, sampling, seed)` call, as for a single-turn environment. With
    `respond_of`, each episode's turns are answered by its own responder (a served episode), the
    episodes' environment turns `threads` at a time."""
    budget, max_context = sampling.max_new_tokens, sampling.max_context
    for turn in range(env.max_turns):
        for episode in episodes:
            if not episode.done and turn_room(episode, budget, max_context) < 1:
                episode.stop = "context"  # a prompt longer than the context (turns never leave none)
        active = [e for e in episodes if not e.done]
        if not active:
            break
        remaining = [turn_room(e, budget, max_context) for e in active]
        turn_sampling = sampling.model_copy(update={"max_new_tokens": max(remaining)})
        prompts = [e.token_ids for e in active]
        if any(e.images for e in active):  # a vision-language policy: its engine takes the pixels too
            images = [e.images for e in active]
            completions = engine.generate(prompts, turn_sampling, seed=seed + turn, images=images)
        else:
            completions = engine.generate(prompts, turn_sampling, seed=seed + turn)

        def answer(episode: Episode, completion, left: int) -> None:
            # A batch samples up to the largest remaining budget; each episode keeps its own share
            # (a prefix of an autoregressive sample is a valid sample with the same log-probs).
            ids = completion.token_ids[:left]
            episode.segments.append(
                Segment(
                    source="model",
                    token_ids=ids,
                    logprobs=completion.logprobs[:left],
                    policy_versions=completion.policy_versions[:left],
                )
            )
            respond = None if respond_of is None else respond_of(episode)
            env_ids = advance(env, chat, episode, ids, budget, max_context, respond)
            if env_ids:
                episode.segments.append(Segment(source="env", token_ids=env_ids))

        if threads > 1:  # each episode's turn is its own, so they may be answered at once
            with ThreadPoolExecutor(threads, thread_name_prefix="env-turns") as pool:
                list(pool.map(answer, active, completions, remaining))
        else:
            for episode, completion, left in zip(active, completions, remaining, strict=True):
                answer(episode, completion, left)
    return episodes


def replay(
    env: Environment,
    chat: ChatFormat,
    problem: Problem,
    segments: list[Segment],
    budget: int,
    max_context: int | None = None,
    respond: Respond | None = None,
) -> Episode:
    """Rebuild a submitted episode from its segments, re-running every environment turn (or asking
    `respond`: a served episode's signed turns); raise ReplayMismatch when the submitted env tokens
    or the episode's shape differ from the replay, or a model turn runs past the model's context."""
    episode = start(env, chat, problem)
    index = 0
    while index < len(segments):
        segment = segments[index]
        if segment.source != "model":
            raise ReplayMismatch(f"segments[{index}] should be a model turn, got an env segment")
        room = None if max_context is None else max_context - len(episode.token_ids)
        if room is not None and len(segment.token_ids) > room:
            raise ReplayMismatch(
                f"segments[{index}] has {len(segment.token_ids)} tokens where the model's context of "
                f"{max_context} leaves {max(room, 0)}"
            )
        episode.segments.append(segment)
        expected = advance(env, chat, episode, segment.token_ids, budget, max_context, respond)
        following = segments[index + 1] if index + 1 < len(segments) else None
        if expected is None and following is not None:
            raise ReplayMismatch(
                f"the episode ended ({episode.stop}) after segments[{index}] but more follow"
            )
        if not expected:  # the end, or an environment turn that renders to no tokens
            index += 1
            continue
        if following is None or following.source != "env" or following.token_ids != expected:
            raise ReplayMismatch(f"segments[{index + 1}] differ from the environment's replayed turn")
        episode.segments.append(following)
        index += 2
    if episode.stop is None:
        raise ReplayMismatch("the rollout ends before the episode did")
    return episode
