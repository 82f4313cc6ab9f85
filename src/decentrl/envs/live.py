"""Live sessions: one episode of an environment kept alive between turns, as an env server runs it.

An env server (`decentrl envd`) hosts every environment through this one interface. An environment
with state of its own (a browser, a shell, a game) gives a `session(problem)` that keeps it between
turns; any other `Environment` is served as it is by `ReplaySession`, which holds the messages and
calls the environment's pure `respond` and `reward` on them. Either way:

    session = open_session(env, problem)
    reply = session.step(assistant_text)      # the environment's turn, or None: the episode is over
    reward = session.reward(final_action)     # in [0, 1]; `final_action`: a last turn not performed
    session.close()
"""

from __future__ import annotations

from typing import Protocol

from decentrl.envs.base import Environment, Message, Problem


class InstanceBroken(RuntimeError):
    """Raised by an environment whose instance cannot go on (its browser died): the env server
    replaces the instance and fails every episode it held."""


class EnvSession(Protocol):
    def step(self, action: str) -> list[Message] | None:
        """Perform one assistant turn; the environment's answer, or None once the episode is over."""
        ...

    def reward(self, final_action: str | None = None) -> float:
        """The finished episode's reward in [0, 1]. `final_action` is the episode's last assistant
        turn when it was not performed (the episode ran out of turns or tokens first): a final
        answer a reward may read."""
        ...

    def close(self) -> None: ...


class ReplaySession:
    """Any `Environment` as a session: the messages so far, and the environment's own functions."""

    def __init__(self, env: Environment, problem: Problem):
        self.env = env
        self.problem = problem
        prompt = problem.prompt
        self.messages: list[Message] = (
            [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        )

    def step(self, action: str) -> list[Message] | None:
        self.messages.append({"role": "assistant", "content": action})
        reply = self.env.respond(self.problem, self.messages)
        if reply is not None:
            self.messages += reply
        return reply

    def reward(self, final_action: str | None = None) -> float:
        final = [] if final_action is None else [{"role": "assistant", "content": final_action}]
        return float(self.env.reward(self.problem, self.messages + final))

    def close(self) -> None:
        pass


def open_session(env: Environment, problem: Problem) -> EnvSession:
    opener = getattr(env, "session", None)  # optional: environments with live state of their own
    return opener(problem) if opener is not None else ReplaySession(env, problem)


def env_version(env: Environment) -> str:
    """What an episode records as its environment's version: the environment's own `version`
    (and its engine's, e.g. the browser's product string), else the decentrl release."""
    from importlib.metadata import PackageNotFoundError, version

    own = getattr(env, "version", None)
    if own is None:
        try:
            own = f"{env.name}-decentrl-{version('decentrl')}"
        except PackageNotFoundError:
            own = f"{env.name}-decentrl-unknown"
    engine = getattr(env, "engine_version", None)
    return f"{own}/{engine}" if engine else str(own)
