"""Episodes on the env server: reset, step and end, each answer signed with the server's key.

A reset asks the coordinator for the episode first (`POST /v1/envd/episodes`): the coordinator
grants it only for an open slot of the worker's own lease that has no episode yet, or whose earlier
episodes all failed (fewer than `task.max_env_retries` retries): a worker cannot play one slot
twice and keep the better episode. The grant names the seed; the server opens a session on an
instance of its pool. Each step performs one model turn and signs an `EnvStep` (episode, turn
index, hash of the action text, the environment's answer); the end signs an `EnvEnd` with the
reward read from the session. A failure of the instance (crash, timeout, memory) or of the
environment (error) is signed as an `EnvEnd` with that failure and no reward, and reported to the
coordinator before the worker hears of it, so that its retry is granted.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from decentrl.envd.supervisor import Instance, InstanceFailed, Pool
from decentrl.envd_wire import (
    EndRequest,
    EnvEnd,
    EnvFailure,
    EnvLeaseInfo,
    EnvMessage,
    EnvStep,
    EpisodeFailed,
    EpisodeGrant,
    ResetAnswer,
    ResetRequest,
    StepAnswer,
    StepRequest,
    action_digest,
    signed_bytes,
)

log = logging.getLogger(__name__)

IDLE_EPISODE_SECONDS = 600.0
"""An episode no request touched for this long is closed (its worker is gone)."""
LEASE_GRACE_SECONDS = 5.0
"""An episode is closed this long after its lease's deadline (no rollout of it can be accepted)."""


class Refused(Exception):
    """A request the server will not serve: the HTTP status and why."""

    def __init__(self, status: int, detail: str):
        super().__init__(detail)
        self.status = status
        self.detail = detail


@dataclass
class Episode:
    end: EnvEnd
    """The record the episode will end with (unsigned until it ends)."""
    lease: EnvLeaseInfo
    instance: Instance | None
    session: str
    touched: float = field(default_factory=time.monotonic)
    ended: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


class Episodes:
    def __init__(self, pool: Pool, key: Ed25519PrivateKey, server_id: str, coordinator) -> None:
        self.pool = pool
        self.key = key
        self.server_id = server_id
        self.coordinator = coordinator
        """The coordinator's client (trainer token): `envd_claim`, `envd_failed`."""
        self.episodes: dict[str, Episode] = {}
        self.counters: Counter[str] = Counter()
        self._lock = threading.Lock()

    def sign(self, record: EnvStep | EnvEnd) -> None:
        record.signature = self.key.sign(signed_bytes(record)).hex()

    def episode(self, episode_id: str) -> Episode:
        with self._lock:
            found = self.episodes.get(episode_id)
        if found is None:
            raise Refused(404, f"no open episode {episode_id!r} on this server")
        found.touched = time.monotonic()
        return found

    # ---------------------------------------------------------------- reset

    def reset(self, request: ResetRequest, lease: EnvLeaseInfo) -> tuple[ResetAnswer, Episode]:
        session = secrets.token_hex(8)
        try:  # room first: a full server answers 503 before the coordinator grants an attempt
            instance = self.pool.place(session)
        except InstanceFailed as failed:
            raise Refused(503, f"no room for an episode here now ({failed.detail}); retry shortly") from None
        try:
            grant: EpisodeGrant = self.coordinator.envd_claim(
                self.server_id, request.lease_id, request.task_id, request.slot, self.pool.version
            )
        except BaseException:
            self.pool.release(instance, session)
            raise
        end = EnvEnd(
            episode_id=grant.episode_id,
            server_id=self.server_id,
            lease_id=request.lease_id,
            task_id=request.task_id,
            slot=request.slot,
            env=grant.env,
            env_version=self.pool.version,
            seed=grant.seed,
            attempt=grant.attempt,
            steps=0,
        )
        episode = Episode(end, lease, instance, session)
        with self._lock:
            self.episodes[grant.episode_id] = episode
        self.counters["resets"] += 1
        failed_end = None
        try:
            instance.call({"op": "open", "session": session, "seed": grant.seed})
        except InstanceFailed as failed:
            failed_end = self.fail(episode, failed)
        answer = ResetAnswer(
            episode_id=grant.episode_id,
            attempt=grant.attempt,
            env_version=self.pool.version,
            failed=failed_end,
        )
        return answer, episode

    # ---------------------------------------------------------------- step and end

    def step(self, episode: Episode, request: StepRequest) -> StepAnswer:
        with episode.lock:
            if episode.ended:
                raise Refused(409, f"episode {request.episode_id} has ended; its end record is final")
            if request.turn != episode.end.steps + 1:
                raise Refused(409, f"episode {request.episode_id} expects turn {episode.end.steps + 1}")
            step = EnvStep(
                episode_id=request.episode_id, turn=request.turn, action_sha256=action_digest(request.action)
            )
            try:
                reply = self._call(episode, {"op": "step", "action": request.action})["reply"]
            except InstanceFailed as failed:
                self.sign(step)
                return StepAnswer(step=step, end=self.fail(episode, failed))
            episode.end.steps += 1
            self.counters["steps"] += 1
            if reply is not None:
                step.observation = [EnvMessage(role=str(m["role"]), content=str(m["content"])) for m in reply]
            self.sign(step)
            end = self._finish(episode, None) if reply is None else None
            return StepAnswer(step=step, end=end)

    def end(self, episode: Episode, request: EndRequest) -> EnvEnd:
        """Close the episode with its reward (idempotent: the same record again once it ended)."""
        with episode.lock:
            if episode.ended:
                return episode.end
            return self._finish(episode, request.final_action)

    def _finish(self, episode: Episode, final_action: str | None) -> EnvEnd:
        try:
            answer = self._call(episode, {"op": "reward", "final_action": final_action})
        except InstanceFailed as failed:
            return self.fail(episode, failed)
        episode.end.final_action_sha256 = None if final_action is None else action_digest(final_action)
        episode.end.reward = float(answer["reward"])
        self.sign(episode.end)
        self._close(episode)
        self.counters["episodes"] += 1
        return episode.end

    def _call(self, episode: Episode, request: dict) -> dict:
        assert episode.instance is not None, "an episode without an instance has failed already"
        return episode.instance.call({**request, "session": episode.session})

    # ---------------------------------------------------------------- failures

    def fail(self, episode: Episode, failed: InstanceFailed) -> EnvEnd:
        """End `episode` with `failed`: signed, counted, reported to the coordinator (so that its
        retry is granted) before the worker hears of it."""
        log.warning("episode %s failed: %s", episode.end.episode_id, failed)
        episode.end.failure = failed.failure
        episode.end.reward = None
        self.sign(episode.end)
        self.counters[f"failed_{failed.failure.value}"] += 1
        report = EpisodeFailed(
            server_id=self.server_id,
            episode_id=episode.end.episode_id,
            failure=failed.failure,
            detail=failed.detail[:200],
        )
        try:
            self.coordinator.envd_failed(report)
        except Exception as exc:  # the episode is failed all the same: its retry may be refused
            log.warning("could not report the failure of episode %s: %s", episode.end.episode_id, exc)
        self._close(episode)
        return episode.end

    def _close(self, episode: Episode) -> None:
        episode.ended = True
        instance = episode.instance
        if instance is not None and instance.alive():
            try:
                instance.call({"op": "close", "session": episode.session})
            except InstanceFailed as failed:  # the next episode placed on it will see it replaced
                log.warning("closing episode %s: %s", episode.end.episode_id, failed)
        if instance is not None:
            self.pool.release(instance, episode.session)

    def sweep(self) -> None:
        """Close the episodes no worker can use any more: past their lease's deadline (their
        session is freed for others; a worker that lost the answer to its reset leaves one behind),
        or untouched for `IDLE_EPISODE_SECONDS`; those not ended are failed (`lost`)."""
        now, cutoff = time.time(), time.monotonic() - IDLE_EPISODE_SECONDS
        with self._lock:
            stale = [
                e
                for e in self.episodes.values()
                if e.touched < cutoff or e.lease.deadline_unix < now - LEASE_GRACE_SECONDS
            ]
            for episode in stale:
                del self.episodes[episode.end.episode_id]
        for episode in stale:
            with episode.lock:
                if not episode.ended:
                    self.fail(
                        episode, InstanceFailed(EnvFailure.LOST, "its lease ended, or no request came for it")
                    )

    def open_count(self) -> int:
        with self._lock:
            return sum(1 for e in self.episodes.values() if not e.ended)
