"""Episodes of a served task: the environment's turns come from env servers, signed.

For each slot the worker resets an episode on an env server (the coordinator grants it), then plays
it as any multi-turn episode (`envs/episode.py`: one batched generation per turn), except that each
model turn the environment must answer is sent to the server (`POST /envd/step`, the turn's text
as its tokens decode) and the answer is the server's signed `EnvStep`. An episode that ends
without the server ending it (turns, tokens or context ran out) is closed with `POST /envd/end`.
The signed records go into the rollout (`Rollout.served`); the coordinator checks them.

An environment failure (a signed failure, or a server that does not answer) ends the episode
(`env_failed`): it is played again from the start, on any live server, up to `task.max_env_retries`
times; a slot whose retries are spent is left out of the submission (its lease gives it back to
the coordinator, which leases it again). No failed episode is ever submitted.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx

from decentrl.client import CoordinatorClient
from decentrl.envd_wire import (
    EndRequest,
    EnvEnd,
    EnvServerInfo,
    EnvStep,
    ResetAnswer,
    ResetRequest,
    ServedEpisode,
    StepAnswer,
    StepRequest,
)
from decentrl.envs.base import Environment, Message, Problem
from decentrl.envs.chat import ChatFormat
from decentrl.envs.episode import Episode, run_episodes
from decentrl.protocol import SamplingParams
from decentrl.trust.identity import Signer

log = logging.getLogger(__name__)

SERVERS_TTL_SECONDS = 10.0
SERVERS_WAIT_SECONDS = 60.0
FULL_RETRIES = 60
FULL_WAIT_SECONDS = 1.0
REQUEST_SECONDS = 60.0
RETRY_SEED_STRIDE = 7919


class EnvServerDown(Exception):
    """An env server that did not answer (`status` None), or refused: the episode is failed on the
    worker's side."""

    def __init__(self, detail: str, status: int | None = None):
        super().__init__(detail)
        self.status = status


@dataclass
class Remote:
    """One served episode as the worker plays it."""

    server: EnvServerInfo | None
    """None: no server answered the reset (the episode is played again elsewhere)."""
    episode_id: str
    steps: list[EnvStep] = field(default_factory=list)
    end: EnvEnd | None = None
    failed: str | None = None

    def record(self) -> ServedEpisode:
        assert self.end is not None and self.failed is None
        return ServedEpisode(steps=self.steps, end=self.end)


class EnvFleet:
    """The run's env servers, seen from one worker."""

    def __init__(
        self,
        coordinator: CoordinatorClient,
        signer: Signer,
        retries: int,
        threads: int = 16,
        stop: threading.Event | None = None,
    ):
        self.coordinator = coordinator
        self.stop = stop or threading.Event()
        """The worker is stopping: no episode is opened or retried (the lease's slots go back)."""
        self.signer = signer
        self.retries = retries
        self.threads = threads
        self._servers: list[EnvServerInfo] = []
        self._listed = float("-inf")
        self._turn = itertools.count()
        self._clients: dict[str, httpx.Client] = {}
        self._lock = threading.Lock()
        self.failures = 0

    def servers(self, refresh: bool = False) -> list[EnvServerInfo]:
        with self._lock:
            if refresh or time.monotonic() - self._listed > SERVERS_TTL_SECONDS or not self._servers:
                self._servers = self.coordinator.env_servers()
                self._listed = time.monotonic()
            return list(self._servers)

    def _post(self, server: EnvServerInfo | None, path: str, body) -> bytes:
        assert server is not None, "an episode without a server has failed at its reset"
        with self._lock:
            client = self._clients.get(server.url)
            if client is None:
                client = self._clients[server.url] = httpx.Client(
                    base_url=server.url, timeout=REQUEST_SECONDS, auth=self.signer
                )
        try:
            response = client.post(
                path, content=body.model_dump_json(), headers={"Content-Type": "application/json"}
            )
        except httpx.HTTPError as exc:
            raise EnvServerDown(f"{server.server_id}: {type(exc).__name__}: {exc}") from None
        if response.status_code != 200:
            detail = f"{server.server_id}: HTTP {response.status_code} {response.text[:300]}"
            raise EnvServerDown(detail, response.status_code)
        return response.content

    # ---------------------------------------------------------------- one episode

    def reset(self, lease_id: str, task_id: str, slot: int) -> Remote:
        servers, deadline = self.servers(), time.monotonic() + SERVERS_WAIT_SECONDS
        while not servers and time.monotonic() < deadline and not self.stop.is_set():  # servers starting
            time.sleep(0.5)
            servers = self.servers(refresh=True)
        if not servers:
            raise EnvServerDown(f"no env server is live for this run after {SERVERS_WAIT_SECONDS:.0f} s")
        server = servers[next(self._turn) % len(servers)]
        answer = ResetAnswer.model_validate_json(
            self._post(server, "/envd/reset", ResetRequest(lease_id=lease_id, task_id=task_id, slot=slot))
        )
        remote = Remote(server, answer.episode_id)
        if answer.failed is not None:
            remote.failed, remote.end = f"reset: {answer.failed.failure}", answer.failed
        return remote

    def responder(self, remote: Remote):  # noqa: ANN201 - an episode.Respond
        def respond(problem: Problem, messages: list[Message]) -> list[Message] | None:
            if remote.failed is not None:
                return None
            request = StepRequest(
                episode_id=remote.episode_id, turn=len(remote.steps) + 1, action=str(messages[-1]["content"])
            )
            try:
                answer = StepAnswer.model_validate_json(self._post(remote.server, "/envd/step", request))
            except EnvServerDown as exc:
                remote.failed = str(exc)
                return None
            if answer.end is not None and answer.end.failure is not None:
                remote.failed = f"step {request.turn}: {answer.end.failure}"
                remote.end = answer.end  # the signed failure (never submitted)
                return None
            remote.steps.append(answer.step)
            remote.end = answer.end
            if answer.step.observation is None:
                return None
            return [m.model_dump() for m in answer.step.observation]

        return respond

    def finish(self, remote: Remote, episode: Episode) -> None:
        """Close an episode the environment did not end itself, with its last turn when that turn
        was not performed (the episode ran out of turns or tokens before the server saw it)."""
        if remote.failed is not None or remote.end is not None:
            return
        performed = episode.stop in ("final_answer", "context")
        final = None if performed else str(episode.messages[-1]["content"])
        try:
            end = EnvEnd.model_validate_json(
                self._post(
                    remote.server, "/envd/end", EndRequest(episode_id=remote.episode_id, final_action=final)
                )
            )
        except EnvServerDown as exc:
            remote.failed = str(exc)
            return
        remote.end = end
        if end.failure is not None:
            remote.failed = f"end: {end.failure}"

    # ---------------------------------------------------------------- a lease's episodes

    def _open(self, lease_id: str, task_id: str, slot: int) -> Remote | None:
        """A reset: the episode; a failed one to play again when no server answered; None when
        the reset was refused (no episode granted: the slot goes back with its lease)."""
        for _ in range(FULL_RETRIES):
            if self.stop.is_set():  # the lease will not be submitted: open nothing more
                return None
            try:
                return self.reset(lease_id, task_id, slot)
            except EnvServerDown as exc:
                if exc.status == 503:  # the server is full: no attempt was granted, ask again
                    time.sleep(FULL_WAIT_SECONDS)
                    continue
                log.warning("reset of %s slot %d failed: %s", task_id, slot, exc)
                if exc.status is not None and exc.status < 500:
                    return None
                self.servers(refresh=True)  # a server down: the retry goes to another one
                return Remote(None, "", failed=str(exc))
        return Remote(
            None, "", failed=f"every env server stayed full for {FULL_RETRIES * FULL_WAIT_SECONDS:.0f} s"
        )

    def play(
        self,
        engine,
        env: Environment,
        chat: ChatFormat,
        started: list[tuple[str, str, int, Episode]],
        sampling: SamplingParams,
        seed: int,
        fresh,
    ) -> dict[int, tuple[Episode, ServedEpisode]]:
        """Play `started` = [(lease_id, task_id, slot, episode)] to the end; the finished ones by
        their index in `started`. `fresh(index)` makes a new episode for a retry."""
        done: dict[int, tuple[Episode, ServedEpisode]] = {}
        pending = list(range(len(started)))
        for attempt in range(1 + self.retries):
            if not pending or (attempt > 0 and self.stop.is_set()):
                break
            episodes = {i: (started[i][3] if attempt == 0 else fresh(i)) for i in pending}
            with ThreadPoolExecutor(self.threads, thread_name_prefix="env-resets") as pool:
                opened = dict(
                    zip(pending, pool.map(lambda i: self._open(*started[i][:3]), pending), strict=True)
                )
            remotes = {i: remote for i, remote in opened.items() if remote is not None}
            playable = [i for i in pending if i in remotes and remotes[i].failed is None]
            by_episode = {id(episodes[i]): remotes[i] for i in playable}
            run_episodes(
                engine,
                env,
                chat,
                [episodes[i] for i in playable],
                sampling,
                seed + RETRY_SEED_STRIDE * attempt,
                respond_of=lambda episode, by_episode=by_episode: self.responder(by_episode[id(episode)]),
                threads=self.threads,
            )
            for i in playable:
                self.finish(remotes[i], episodes[i])
            failed = []
            for i in pending:
                remote = remotes.get(i)
                if remote is not None and remote.failed is None and remote.end is not None:
                    done[i] = (episodes[i], remote.record())
                    continue
                episodes[i].stop = "env_failed"
                self.failures += 1
                if remote is None:  # refused at reset (no retry granted, lease gone): give it back
                    continue
                log.warning("episode %s failed (%s): %s", remote.episode_id, started[i][1], remote.failed)
                failed.append(i)
            pending = failed
        return done
