"""A colocated trainer's sampler (trainer/local_rollouts.py) takes each trained version's
publication state through shared memory: every tensor under full-parameter training, the adapted
layers merged (W0 + B @ A) under LoRA. It keeps one round ahead of training (two rounds from the
first version, one more per version trained, none from `until_version` on), sends a round only
once the version it was sampled from is published, drops it when that never happens, and its
failure is raised in the trainer. Here the sampler runs in a thread of the test (the trainer forks
it as a process: tests/integration/test_colocated.py)."""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from decentrl.config import LoraConfig, ModelConfig
from decentrl.envs.chat import ChatFormat
from decentrl.model import lora
from decentrl.model.special import read_eos_token_ids, read_pad_token_id
from decentrl.model.tiny import build_tiny, save_model_dir
from decentrl.protocol import Lease, LeaseRequest, RolloutSubmission, SamplingParams, ServerInfo, TaskSpec
from decentrl.trainer.local_rollouts import LocalRollouts, Sampler, SamplerSpec, SharedState, serve
from decentrl.weights.codec import published_state


class Client:
    """Grants every lease (16 tasks of the arithmetic env, two slots each: with `room`) and
    records what would go to the coordinator."""

    def __init__(self, info: ServerInfo, chat: ChatFormat | None = None, room: bool = False) -> None:
        self.server_info, self.chat, self.room = info, chat, room
        self.leases: list[LeaseRequest] = []
        self.submitted: list[tuple[float, RolloutSubmission]] = []

    def submit_local_rollouts(self, submission: RolloutSubmission) -> None:
        self.submitted.append((time.monotonic(), submission))

    def info(self) -> ServerInfo:
        return self.server_info

    def local_lease(self, request: LeaseRequest) -> Lease | None:
        self.leases.append(request)
        if not self.room or self.chat is None:
            return None
        index = len(self.leases)
        tasks = [
            TaskSpec(
                task_id=f"t{index}-{task}",
                group_id=f"g{index}-{task}",
                env="arithmetic",
                slots=[0, 1],
                prompt_token_ids=self.chat.prompt_ids(f"What is {task} + {index}?"),
                seed=task,
            )
            for task in range(16)
        ]
        sampling = SamplingParams(temperature=1.0, max_new_tokens=4)
        return Lease(lease_id=f"l{index}", deadline_unix=time.time() + 60, sampling=sampling, tasks=tasks)

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_model_dir(*build_tiny(ModelConfig()), tmp_path_factory.mktemp("model"))


def chat_format(model_dir: Path) -> ChatFormat:
    return ChatFormat.from_model_dir(model_dir, read_eos_token_ids(model_dir))


def server_info(model_dir: Path) -> ServerInfo:
    return ServerInfo(
        run_id="r", vocab_size=99, eos_token_ids=read_eos_token_ids(model_dir),
        pad_token_id=read_pad_token_id(model_dir), group_size=2, max_staleness=1,
        sampling=SamplingParams(temperature=1.0, max_new_tokens=4), latest_version=0, model_files=[],
        trainer_public_key=None, env_args={}, logprob_tolerances={}, sections={},
    )  # fmt: skip


def spec(model_dir: Path) -> SamplerSpec:
    return SamplerSpec(16, model_dir, "http://unused", "t", device="cpu", dtype="float32", num_threads=1)


class Thread:
    """The sampler in a thread of the test, where the trainer forks a process."""

    def __init__(self, target: Any) -> None:
        self.exitcode: int | None = None
        self.thread = threading.Thread(target=self._run, args=(target,), daemon=True)
        self.thread.start()

    def _run(self, target: Any) -> None:
        try:
            target()
            self.exitcode = 0
        except BaseException:
            self.exitcode = 1

    def is_alive(self) -> bool:
        return self.thread.is_alive()

    def join(self, timeout: float | None = None) -> None:
        self.thread.join(timeout)

    def kill(self) -> None:
        raise AssertionError("the sampler thread did not stop")


def local_rollouts(model_dir: Path, client: Client, until_version: int = 100) -> LocalRollouts:
    def start(spec: SamplerSpec, conn: Connection, lock: Any) -> Thread:
        return Thread(lambda: serve(spec, conn, lock, client))

    return LocalRollouts(spec(model_dir), until_version, start=start)


def sampler(model_dir: Path) -> tuple[Sampler, Connection]:
    """A sampler fed by hand through a pipe, as the trainer feeds it."""
    info = server_info(model_dir)
    trainer, child = multiprocessing.Pipe()
    return Sampler(spec(model_dir), child, threading.Lock(), Client(info), info), trainer


def offer(made: Sampler, trainer: Connection, version: int, state: dict[str, torch.Tensor]) -> None:
    """What the trainer does with a trained version (`LocalRollouts.offer`), then the sampler's
    copy of it into its engine before a round."""
    shared = SharedState.create(state)
    shared.write(state)
    shared.send(trainer)
    trainer.send(("version", version))
    made.apply()
    shared.close()


def engine_state(made: Sampler) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in made.engine.model.state_dict().items()}


def test_full_parameter_versions_replace_every_tensor(model_dir: Path) -> None:
    made, trainer = sampler(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for version in range(3):
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(0.01 * version)
        state = published_state(lora.publication_state(model), "float32")
        offer(made, trainer, version, state)
        held = engine_state(made)
        assert made.engine.policy_version == version
        for name, tensor in state.items():
            assert torch.equal(held[name], tensor), (version, name)


def test_lora_versions_reach_the_engine_merged(model_dir: Path) -> None:
    made, trainer = sampler(model_dir)
    model = lora.attach(
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), LoraConfig(rank=2)
    )
    for version in range(2):
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if "lora_" in name:
                    parameter.add_(0.05 * (version + 1))
        state = lora.publication_state(model)
        offer(made, trainer, version, state)
        held = engine_state(made)
        for name, tensor in lora.merge(state).items():
            assert torch.allclose(held[name], tensor, atol=1e-6), (version, name)
        assert not any(name.endswith(lora.ADAPTER_SUFFIXES) for name in held)  # merged, not served


def test_the_shared_mapping_holds_every_dtype_and_shape_and_has_no_name() -> None:
    state = {
        "a": torch.randn(3, 5),
        "b": torch.randn(7).to(torch.bfloat16),
        "c": torch.tensor(2.5, dtype=torch.float16),
        "d": torch.arange(6, dtype=torch.int64).view(2, 3),
    }
    written = SharedState.create(state)
    ours, theirs = multiprocessing.Pipe()
    try:
        written.send(ours)
        kind, slots = theirs.recv()
        read = SharedState.receive(theirs, slots)  # its own descriptor of the same memory
        assert kind == "mapping" and read.fd != written.fd
        written.write(state)  # written after the other side mapped it: seen there
        assert all(slot.offset % 64 == 0 for slot in written.slots)
        for name, tensor in read.read().items():
            assert tensor.dtype == state[name].dtype and torch.equal(tensor, state[name]), name
        with pytest.raises(ValueError, match="changed its tensors"):
            written.write({"a": state["a"]})
        # Nothing to leak whenever a process dies: no name leads to the memory (a memfd, or a
        # file unlinked once open), only the two descriptors.
        for fd in (written.fd, read.fd):
            link = Path(f"/proc/self/fd/{fd}")
            if link.exists():
                target = os.readlink(link)
                assert target.startswith("/memfd:") or target.endswith("(deleted)"), target
        read.close()
    finally:
        written.close()
        ours.close()
        theirs.close()


def versions_of(submission: RolloutSubmission) -> set[int]:
    """The versions a round's tokens were sampled from."""
    return {
        version
        for rollout in submission.rollouts
        for segment in rollout.segments
        for version in segment.policy_versions or []
    }


def settle(client: Client, leases: int, submitted: int) -> None:
    """Wait until the sampling thread has asked `leases` leases and sent `submitted` rounds, then
    a little longer, to see it asks for no more."""
    deadline = time.monotonic() + 30
    while (len(client.leases), len(client.submitted)) < (leases, submitted) and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.3)
    assert (len(client.leases), len(client.submitted)) == (leases, submitted)


def test_rounds_keep_one_ahead_and_wait_for_their_version_to_be_published(model_dir: Path) -> None:
    client = Client(server_info(model_dir), chat_format(model_dir), room=True)
    local = local_rollouts(model_dir, client, until_version=3)
    state = published_state(
        lora.publication_state(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)),
        "float32",
    )
    settle(client, leases=0, submitted=0)  # nothing to sample from before the first version
    local.offer(0, state)
    settle(client, leases=0, submitted=0)  # a lease names a version the coordinator holds
    local.published(0)
    settle(client, leases=2, submitted=2)  # two rounds from version 0
    assert [versions_of(submission) for _, submission in client.submitted] == [{0}, {0}]
    local.offer(1, state)  # version 1 trained: one more round, from it
    settle(client, leases=3, submitted=2)
    assert client.leases[-1].policy_version == 0  # asked at a version the coordinator holds
    local.published(1)
    settle(client, leases=3, submitted=3)
    assert versions_of(client.submitted[2][1]) == {1}
    local.offer(2, state)
    settle(client, leases=4, submitted=3)  # sampled from version 2, not sent: 2 is not published
    local.offer(3, state)  # the last version: nothing sampled from it would be trained
    settle(client, leases=4, submitted=3)
    metrics = local.take_metrics()  # the rounds reported: those sent
    assert metrics["local_rollouts"] == 3 * 16 * 2 and metrics["local_rounds_without_room"] == 0
    local.close()  # the round from version 2, never published, is dropped
    assert len(client.submitted) == 3 and not local.process.is_alive()
    assert local.take_metrics()["local_rollouts"] == 16 * 2  # sampled all the same
    local.check()


def test_a_round_without_room_is_skipped(model_dir: Path) -> None:
    client = Client(server_info(model_dir), chat_format(model_dir), room=False)
    local = local_rollouts(model_dir, client)
    state = published_state(
        lora.publication_state(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)),
        "float32",
    )
    local.offer(0, state)
    local.published(0)
    settle(client, leases=2, submitted=0)  # the pace holds: no retry until the next version
    assert local.take_metrics()["local_rounds_without_room"] == 2
    local.close()


def test_a_failure_of_the_sampler_is_raised_in_the_trainer(model_dir: Path) -> None:
    class Broken(Client):
        def local_lease(self, request: LeaseRequest) -> Lease | None:
            raise ConnectionError("the coordinator is gone")

    local = local_rollouts(model_dir, Broken(server_info(model_dir)))
    local.check()  # nothing yet
    local.offer(0, published_state(lora.publication_state(
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)), "float32"))  # fmt: skip
    local.published(0)
    local.process.join(10)
    with pytest.raises(RuntimeError, match="the trainer's sampler failed") as raised:
        local.check()
    assert "ConnectionError: the coordinator is gone" in str(raised.value)
    local.close()


def test_a_sampler_that_exits_is_raised_in_the_trainer(model_dir: Path) -> None:
    def start(spec: SamplerSpec, conn: Connection, lock: Any) -> Thread:
        return Thread(lambda: None)  # gone without a word

    local = LocalRollouts(spec(model_dir), 10, start=start)
    local.process.join(10)
    with pytest.raises(RuntimeError, match="exited"):
        local.check()
    local.close()
