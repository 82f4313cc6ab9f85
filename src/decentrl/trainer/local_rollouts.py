"""Colocated rollouts: the trainer samples groups itself, with the weights it has just trained.

With `trainer.local_groups > 0` the trainer forks a sampler process (`trainer-sampler` in `ps`)
as it starts, before it loads anything. The sampler leases up to that many groups at a time from
the coordinator (`POST /v1/trainer/leases`, the trainer's token), samples them on an engine of its
own, and submits them (`POST /v1/trainer/rollouts`), while the trainer trains. The coordinator
treats them as any worker's rollouts from there on: bound to their lease, replayed, rewarded by
its rubric, grouped, batched and counted in the staleness statistics
(`coordinator/http/trainer_rollouts.py`), so advantages, the batch contract and durability do not
change (a 2xx means committed; a round lost in a crash is an expired lease whose slots are leased
again). What the mode saves is what a trusted sampler beside the trainer does not need: no weight
download, no signature checks, no sampled verification, and one lease and one submission per
round instead of a worker's traffic.

Weights move through shared memory, not HTTP: each trained version's publication state (the
tensors the outbox publishes, in the inference dtype) is copied into one shared file mapping
(`SharedState`, an anonymous memory file whose descriptor the sampler gets over the pipe: a
crash leaves no file behind), and the sampler copies it into its engine before
its next round, under a lock both processes take. Everything else goes over a pipe: the trainer
says which version the mapping holds and which versions are published, the sampler reports each
round (or its failure, raised in the trainer by `check`).

A round is submitted only once the version it was sampled from is published: a rollout never
reaches the coordinator before the version it claims (the coordinator refuses those), and a round
sampled from a version that a crash loses before its publication never leaves the sampler (its
lease expires, its slots are leased again). The sampler exits when the trainer closes it, and
when the trainer dies (its end of the pipe closes; on Linux it is also killed with its parent).

The pace is one round per version: two rounds from the first version, then one more each time a
version is trained, none from `trainer.num_steps` on (nothing sampled from it would be trained).
So round k+1 is sampled (from version k) while version k+1 trains on round k, sampled from
version k-1: a colocated trainer alone trains its own rollouts one version after they were
sampled, and sampling overlaps training instead of adding to it. In a process of its own it does
not take turns with the trainer's threads for the GIL. With the batch it trains, the next one
fetched and the last one until its ack, the round ahead needs `max_pending_groups >= 3 x
groups_per_step + local_groups` (`config/checks.py`).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import mmap
import multiprocessing
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import reduction
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any, Protocol, cast

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from decentrl.client import CoordinatorClient, RequestRejected
from decentrl.engines.hf import HFEngine
from decentrl.envs.chat import ChatFormat
from decentrl.envs.player import Player, lease_seed
from decentrl.model import lora
from decentrl.protocol import Lease, LeaseRequest, RolloutSubmission, ServerInfo, SubmissionResult

log = logging.getLogger(__name__)

ALIGN = 64
"""Byte alignment of each tensor in the shared mapping."""
POLL_S = 0.5
CLOSE_WAIT_S = 60.0
"""How long `close` waits for the sampler to finish its round before it kills it."""
PR_SET_NAME, PR_SET_PDEATHSIG = 15, 1


@dataclass
class RoundStats:
    """What the local rounds did since the last `take_metrics`."""

    rollouts: int = 0
    seconds: float = 0.0
    """Spent sampling (in the sampler)."""
    no_room: int = 0
    """Rounds that found no room under `max_pending_groups` (workers filled it)."""
    refused: int = 0

    def add(self, other: RoundStats) -> None:
        self.rollouts += other.rollouts
        self.seconds += other.seconds
        self.no_room += other.no_room
        self.refused += other.refused


@dataclass(frozen=True)
class Slot:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


class SharedState:
    """A state dict's tensors in one shared memory mapping with no name anywhere: an anonymous
    memory file (`memfd_create`; elsewhere a temporary file unlinked as soon as it is open),
    written by the trainer and read by the sampler (both under the lock they share). The sampler
    gets the file's descriptor over the pipe, so a trainer or sampler killed at any moment leaves
    nothing behind: the memory goes with the last process that maps it."""

    def __init__(self, fd: int, slots: list[Slot]) -> None:
        self.fd, self.slots = fd, slots
        size = max(1, max((slot.offset + slot.nbytes for slot in slots), default=0))
        self.mapping = mmap.mmap(fd, size)  # shared: the other process's writes are seen here
        self.bytes = torch.frombuffer(self.mapping, dtype=torch.uint8)
        self.tensors = {
            slot.name: self.bytes[slot.offset : slot.offset + slot.nbytes]
            .view(getattr(torch, slot.dtype))
            .view(slot.shape)
            for slot in slots
        }

    @classmethod
    def create(cls, state: dict[str, torch.Tensor]) -> SharedState:
        """A mapping laid out for `state`."""
        slots, offset = [], 0
        for name, tensor in state.items():
            nbytes = tensor.numel() * tensor.element_size()
            slots.append(
                Slot(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), offset, nbytes)
            )
            offset += -(-nbytes // ALIGN) * ALIGN
        fd = anonymous_file()
        os.ftruncate(fd, max(1, offset))
        return cls(fd, slots)

    def write(self, state: dict[str, torch.Tensor]) -> None:
        if state.keys() != self.tensors.keys():
            raise ValueError("a version's publication state changed its tensors: the sampler cannot take it")
        for name, tensor in state.items():
            self.tensors[name].copy_(tensor)

    def read(self) -> dict[str, torch.Tensor]:
        return {name: tensor.clone() for name, tensor in self.tensors.items()}

    def send(self, conn: Connection) -> None:
        """Give the other end of `conn` this mapping (its layout, then its descriptor)."""
        conn.send(("mapping", self.slots))
        reduction.send_handle(conn, self.fd, os.getpid())

    @classmethod
    def receive(cls, conn: Connection, slots: list[Slot]) -> SharedState:
        """The mapping whose layout `slots` came over `conn` (`send`): its descriptor follows."""
        return cls(reduction.recv_handle(conn), slots)

    def close(self) -> None:
        """Unmap (its tensors must not be used after) and close the descriptor."""
        self.tensors.clear()
        del self.bytes
        with contextlib.suppress(BufferError):  # a tensor still viewing it: unmapped at exit
            self.mapping.close()
        os.close(self.fd)


def anonymous_file() -> int:
    """A descriptor of a new memory file that no name leads to (memory, not disk, where it can)."""
    if hasattr(os, "memfd_create"):
        return os.memfd_create("decentrl-sampler", os.MFD_CLOEXEC)
    shm = Path("/dev/shm")
    folder = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    fd, path = tempfile.mkstemp(prefix="decentrl-sampler-", dir=folder)
    os.unlink(path)
    return fd


@dataclass(frozen=True)
class SamplerSpec:
    """What the sampler needs to start on its own (it asks the coordinator for the rest)."""

    groups: int
    model_dir: Path
    coordinator_url: str
    token: str | None
    device: str
    dtype: str
    num_threads: int


class SamplerClient(Protocol):
    def info(self) -> ServerInfo: ...
    def local_lease(self, request: LeaseRequest) -> Lease | None: ...
    def submit_local_rollouts(self, submission: RolloutSubmission) -> SubmissionResult | None: ...
    def close(self) -> None: ...


class Sampler:
    """The sampler's loop (in the sampler process; in a thread in unit tests): wait until the pace
    allows a round, take the newest version from the mapping, lease, sample, wait until that
    version is published, submit, report."""

    def __init__(
        self, spec: SamplerSpec, conn: Connection, lock: Any, client: SamplerClient, info: ServerInfo
    ) -> None:
        self.spec, self.conn, self.lock, self.client = spec, conn, lock, client
        dtype = getattr(torch, spec.dtype)
        # The architecture only: the first version (complete) replaces every weight.
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(spec.model_dir), dtype=dtype)
        self.engine = HFEngine(
            cast(PreTrainedModel, model), info.eos_token_ids, info.pad_token_id, device=spec.device
        )
        # Merged adapters (W0 + B @ A) run one product per layer instead of three; only a float32
        # engine keeps a small update that way: bf16 would round most of it back to W0, so there
        # the adapters are served unmerged, as a bf16 worker's engine does (model/adapters.py).
        self.merge = dtype == torch.float32
        self.player = Player(ChatFormat.from_model_dir(spec.model_dir, info.eos_token_ids), info.env_args)
        self.shared: SharedState | None = None
        self.mapped_version = -1
        """The version the mapping holds."""
        self.offers = 0
        self.rounds = 0
        self.published_version = -1
        self.closing = False

    def pump(self, timeout: float) -> None:
        """Take the trainer's messages, waiting up to `timeout` for the first."""
        try:
            while self.conn.poll(timeout):
                timeout = 0.0
                self.handle(self.conn.recv())
        except (EOFError, OSError):  # the trainer is gone
            self.closing = True

    def handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == "mapping":
            self.shared = SharedState.receive(self.conn, message[1])
        elif kind == "version":
            self.mapped_version = message[1]
            self.offers += 1
        elif kind == "published":
            self.published_version = max(self.published_version, message[1])
        elif kind == "close":
            self.closing = True

    def run(self) -> None:
        while not self.closing:
            if self.offers == 0 or self.rounds > self.offers:
                self.pump(POLL_S)
                continue
            self.rounds += 1
            self.apply()
            self.report(self.play_round())

    def apply(self) -> None:
        """The mapping's version into the engine, if it is newer."""
        with self.lock:  # the trainer writes a version and says so under it: both are seen, or neither
            self.pump(0.0)
            if self.shared is None or self.mapped_version <= self.engine.policy_version:
                return
            version, state = self.mapped_version, self.shared.read()
        first = self.engine.policy_version < 0
        if self.merge:
            # Under LoRA only the adapted layers change: after the first load only they are merged
            # and copied (full-parameter training changes, and copies, every tensor).
            adapters = [name for name in state if name.endswith(lora.ADAPTER_SUFFIXES)]
            state = lora.merge(state, None if first or not adapters else adapters)
        if first:
            self.engine.load_weights(state, version)
        else:
            self.engine.update_weights(state, version)

    def play_round(self) -> RoundStats:
        """Lease up to `groups` groups at the engine's version, sample them, and send them once
        that version is published. No room (workers filled it) skips the round; a refused
        submission (its lease expired, say) is logged and counted: its slots are leased again; a
        round whose version is never published (the trainer closes first) is dropped: its lease
        expires."""
        stats = RoundStats()
        version = self.engine.policy_version
        if not self.wait_published(0):  # a lease names a version the coordinator holds
            return stats
        held = min(self.published_version, version)  # the coordinator checks it against what it holds
        lease = self.client.local_lease(
            LeaseRequest(policy_version=max(held, 0), max_groups=self.spec.groups)
        )
        if lease is None:
            stats.no_room += 1
            return stats
        started = time.perf_counter()
        rollouts = self.player.play(self.engine, lease, seed=lease_seed(lease.lease_id))
        stats.seconds, stats.rollouts = time.perf_counter() - started, len(rollouts)
        if not self.wait_published(version):
            return stats
        try:
            self.client.submit_local_rollouts(RolloutSubmission(rollouts=rollouts))
        except RequestRejected as exc:
            log.warning("the coordinator refused a local round (its slots are leased again): %s", exc)
            stats.refused += 1
        return stats

    def wait_published(self, version: int) -> bool:
        """Wait until `version` is published: True, or False once the trainer closes first."""
        while self.published_version < version and not self.closing:
            self.pump(POLL_S)
        return self.published_version >= version

    def report(self, stats: RoundStats) -> None:
        try:
            self.conn.send(("round", stats))
        except OSError:  # the trainer is gone
            self.closing = True


def serve(spec: SamplerSpec, conn: Connection, lock: Any, client: SamplerClient) -> None:
    """Run the sampler until the trainer closes it; a failure goes to the trainer, then up."""
    sampler = None
    try:
        sampler = Sampler(spec, conn, lock, client, client.info())
        sampler.run()
    except BaseException:
        log.exception("the trainer's sampler failed")
        with contextlib.suppress(OSError):
            conn.send(("error", traceback.format_exc(limit=8)))
        raise
    finally:
        client.close()
        if sampler is not None and sampler.shared is not None:
            sampler.shared.close()


def sampler_process(spec: SamplerSpec, conn: Connection, lock: Any) -> None:
    """The sampler process's entry (forked by `LocalRollouts`)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None)
        libc.prctl(PR_SET_NAME, ctypes.c_char_p(b"trainer-sampler"), 0, 0, 0)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # never outlive the trainer
    # The trainer decides when the sampler stops (Ctrl-C reaches the whole process group).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    torch.set_num_threads(spec.num_threads)
    serve(spec, conn, lock, CoordinatorClient(spec.coordinator_url, spec.token))


def start_context() -> Any:
    """Fork where there is fork (the sampler needs nothing the trainer loaded); spawn elsewhere,
    which imports the modules again (seconds)."""
    return multiprocessing.get_context(
        "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    )


def fork_sampler(spec: SamplerSpec, conn: Connection, lock: Any) -> BaseProcess:
    """Fork the sampler (before the trainer has loaded anything or started a thread of its own:
    the child needs none of it)."""
    context = start_context()
    process = context.Process(
        target=sampler_process, args=(spec, conn, lock), name="trainer-sampler", daemon=True
    )
    gc.freeze()  # the trainer's imports: never walked by the sampler's collections (launch/fork.py)
    process.start()
    return process


class SamplerHandle(Protocol):
    @property
    def exitcode(self) -> int | None: ...

    def is_alive(self) -> bool: ...
    def join(self, timeout: float | None = None) -> None: ...
    def kill(self) -> None: ...


class LocalRollouts:
    """The trainer's side: offers each trained version, says which are published, collects the
    rounds' statistics and raises the sampler's failure."""

    def __init__(
        self,
        spec: SamplerSpec,
        until_version: int,
        start: Callable[[SamplerSpec, Connection, Any], SamplerHandle] = fork_sampler,
    ) -> None:
        self.until_version = until_version
        """No round is sampled from this version or a later one."""
        context = start_context()
        self.conn, child = context.Pipe()
        self.lock = context.Lock()
        self.process = start(spec, child, self.lock)
        self.send_lock = threading.Lock()
        self.shared: SharedState | None = None
        self.stats = RoundStats()
        self.error: str | None = None
        self.closing = False

    def _send(self, message: tuple) -> None:
        with self.send_lock, contextlib.suppress(OSError):  # the sampler is gone: `check` says so
            self.conn.send(message)

    def offer(self, version: int, state: dict[str, torch.Tensor]) -> None:
        """`version` is trained and `state` is what will be published (the full tensors in the
        inference dtype): the next round samples from it."""
        if version >= self.until_version:
            return
        if self.shared is None:
            self.shared = SharedState.create(state)
            with self.send_lock, contextlib.suppress(OSError):  # gone: `check` says so
                self.shared.send(self.conn)
        with self.lock:  # the sampler reads the mapping and its version under the same lock
            self.shared.write(state)
            self._send(("version", version))

    def published(self, version: int) -> None:
        """`version` is published (called by the outbox's publishing thread)."""
        self._send(("published", version))

    def _drain(self) -> None:
        try:
            while self.conn.poll(0):
                kind, value = self.conn.recv()
                if kind == "round":
                    self.stats.add(value)
                elif kind == "error":
                    self.error = value
        except (EOFError, OSError):
            pass

    def check(self) -> None:
        """Raise the sampler's failure, or its exit, if either happened."""
        self._drain()
        if self.error is not None:
            raise RuntimeError(f"the trainer's sampler failed:\n{self.error}")
        if not self.closing and not self.process.is_alive():
            raise RuntimeError(f"the trainer's sampler exited (status {self.process.exitcode})")

    def take_metrics(self) -> dict[str, float]:
        """The rounds reported since the last call, as step metrics."""
        self._drain()
        stats, self.stats = self.stats, RoundStats()
        return {
            "local_rollouts": float(stats.rollouts),
            "local_sample_seconds": stats.seconds,
            "local_rounds_without_room": float(stats.no_room),
            "local_rounds_refused": float(stats.refused),
        }

    def kill(self) -> None:
        """Stop the sampler now (the trainer failed to start)."""
        self.closing = True
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.conn.close()

    def close(self) -> None:
        """Let the sampler finish its round (committed or refused; dropped if its version was
        never published), then stop it."""
        self.closing = True
        self._send(("close",))
        try:
            self.process.join(CLOSE_WAIT_S)
            if self.process.is_alive():
                log.warning("the trainer's sampler did not stop within %.0f s: killed", CLOSE_WAIT_S)
                self.process.kill()
                self.process.join()
            self._drain()
        finally:
            self.conn.close()
            if self.shared is not None:
                self.shared.close()
