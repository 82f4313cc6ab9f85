"""Environment interface: problems from seeds, episodes as chat messages, trusted rewards.

An environment makes problems from integer seeds, deterministically, with disjoint train and
held-out splits. An episode is a list of chat messages: the problem's prompt, then alternating
assistant turns (sampled by the model) and environment turns (tool results, observations) until a
stop condition. `respond` must be a pure function of the problem and the messages so far: the
coordinator replays it from the token ids it received to check the worker's environment turns
and recomputes the reward itself, never trusting a worker's claim.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    from decentrl.envs.images import TaskImage

Split = Literal["train", "eval"]
Message = dict[str, Any]
"""An OpenAI-style chat message: {"role": "user" | "assistant" | "tool" | ..., "content": str}."""
StopReason = Literal["final_answer", "max_turns", "max_tokens", "context", "error", "env_failed"]
"""Why an episode ended: the model answered without asking for another environment turn, it used
`max_turns` assistant turns, it ran out of its token budget, the environment gave up, or a served
environment's instance failed (crash, timeout: the episode is retried, never trained)."""


EVAL_BUCKETS = 10  # 1 in 10 problems belongs to the held-out split


def split_of(text: str) -> Split:
    """The split a problem belongs to, from a hash of its text (1 in EVAL_BUCKETS is held out)."""
    digest = hashlib.blake2b(text.encode(), digest_size=4).digest()
    return "eval" if int.from_bytes(digest, "little") % EVAL_BUCKETS == 0 else "train"


@dataclass(frozen=True)
class TeacherHabits:
    """How a scripted teacher errs in the demonstrations an environment offers for the warm start
    (`sft.teacher_*` of the config; 0 everywhere = a perfect teacher)."""

    carry_drop: float = 0.0
    """How often it forgets the carries of a sum that has them."""
    zero_pad: float = 0.0
    """How often it zero-pads an answer ("028" for 28)."""
    skip_tool: float = 0.0
    """Tool-use tasks: how often it gives up without calling the tool."""
    misread: float = 0.0
    """Visual tasks: how often it misreads the picture in the task's own way (`envs/vision/`)."""


@dataclass(frozen=True)
class Problem:
    seed: int
    split: Split
    prompt: str | tuple[Message, ...]
    """Raw text (encoded as is, no chat template) or chat messages (rendered by the chat template)."""
    answer: str
    info: Mapping[str, Any] = field(default_factory=dict)
    """Anything else the environment needs to respond or score (hidden tests, task metadata)."""
    images: tuple[TaskImage, ...] = ()
    """The prompt's images, in the order of its image parts (`{"type": "image"}` in a message's
    content list): drawn from the seed, the same pixels on every role (`envs/images.py`)."""

    @property
    def text(self) -> str:
        """The prompt as a human reads it (the last message's content for chat prompts; the text
        parts of a content list)."""
        if isinstance(self.prompt, str):
            return self.prompt
        return content_text(self.prompt[-1]["content"])


def content_text(content: Any) -> str:
    """A message's content as text: a string as is; a content list's text parts, joined."""
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if part.get("type") == "text")
    return str(content)


@runtime_checkable
class Environment(Protocol):
    name: str
    max_turns: int
    """Most assistant turns in one episode (1 = single-turn)."""
    tools: list[dict]
    """JSON-Schema tool declarations handed to the chat template (empty when the env has none)."""

    def problem(self, seed: int, split: Split) -> Problem:
        """The problem of `seed` in `split`; the same arguments always give the same problem."""
        ...

    def respond(self, problem: Problem, messages: list[Message]) -> list[Message] | None:
        """The environment's turn after the assistant message `messages[-1]`, or None when that
        message ends the episode (a final answer). Deterministic: it is replayed on the coordinator."""
        ...

    def reward(self, problem: Problem, messages: list[Message]) -> float:
        """Reward in [0, 1] of a finished episode (assistant turns decoded from token ids)."""
        ...


class SingleTurnEnv:
    """Base of environments scored on one completion: one assistant turn, `score` on its text."""

    name = "single-turn"
    max_turns = 1
    tools: list[dict] = []

    def respond(self, problem: Problem, messages: list[Message]) -> list[Message] | None:
        return None

    def reward(self, problem: Problem, messages: list[Message]) -> float:
        return self.score(problem, final_answer(messages))

    def score(self, problem: Problem, completion: str) -> float:
        raise NotImplementedError


def final_answer(messages: list[Message]) -> str:
    """The content of the last assistant message ('' when there is none)."""
    for message in reversed(messages):
        if message["role"] == "assistant":
            return str(message["content"])
    return ""


def exact_match(completion: str, answer: str) -> float:
    """1 when the stripped completion equals the stripped gold answer, else 0."""
    return 1.0 if completion.strip() == answer.strip() else 0.0


def completion_text(tokenizer, token_ids: list[int], eos_token_ids: Collection[int]) -> str:
    """The text of one assistant turn: its model tokens minus one final EOS, special tokens kept
    (skipping them would let `3<pad>65` score as `365`). Used by the coordinator's trusted reward,
    by the worker's episodes and by evaluation, so all three read a turn exactly alike."""
    if token_ids and token_ids[-1] in eos_token_ids:
        token_ids = token_ids[:-1]
    return tokenizer.decode(token_ids, skip_special_tokens=False)
