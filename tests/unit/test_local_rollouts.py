"""A colocated trainer's engine (trainer/local_rollouts.py) takes each trained version's published
state: every tensor under full-parameter training, the adapted layers merged (W0 + B @ A) under
LoRA; and a round sampled from a version is only sent once that version is published."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from decentrl.config import LoraConfig, ModelConfig
from decentrl.envs.chat import ChatFormat
from decentrl.model import lora
from decentrl.model.precision import Precision
from decentrl.model.special import read_eos_token_ids, read_pad_token_id
from decentrl.model.tiny import build_tiny, save_model_dir
from decentrl.protocol import RolloutSubmission, SamplingParams, ServerInfo
from decentrl.trainer.local_rollouts import LocalRollouts
from decentrl.weights.codec import published_state


class Client:
    """Records what would go to the coordinator."""

    def __init__(self) -> None:
        self.submitted: list[tuple[float, RolloutSubmission]] = []

    def submit_local_rollouts(self, submission: RolloutSubmission) -> None:
        self.submitted.append((time.monotonic(), submission))

    def local_lease(self, request: object) -> None:  # the next round's, asked ahead: no room
        return None

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_model_dir(*build_tiny(ModelConfig()), tmp_path_factory.mktemp("model"))


def local_rollouts(model_dir: Path, client: Client) -> LocalRollouts:
    eos = read_eos_token_ids(model_dir)
    info = ServerInfo(
        run_id="r", vocab_size=99, eos_token_ids=eos, pad_token_id=read_pad_token_id(model_dir), group_size=2,
        max_staleness=1, sampling=SamplingParams(temperature=1.0, max_new_tokens=4), latest_version=0,
        model_files=[], trainer_public_key=None, env_args={}, logprob_tolerances={}, sections={},
    )  # fmt: skip
    chat = ChatFormat.from_model_dir(model_dir, eos)
    precision = Precision(torch.device("cpu"), torch.float32)
    return LocalRollouts(2, info, model_dir, chat, client, precision, threading.Event())  # type: ignore[arg-type]


def engine_state(local: LocalRollouts) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in local.engine.model.state_dict().items()}


def test_full_parameter_versions_replace_every_tensor(model_dir: Path) -> None:
    local = local_rollouts(model_dir, Client())
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for version in range(3):
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(0.01 * version)
        state = published_state(lora.publication_state(model), "float32")
        local.offer(version, state)
        local._apply()
        held = engine_state(local)
        assert local.engine.policy_version == version
        for name, tensor in state.items():
            assert torch.equal(held[name], tensor), (version, name)


def test_lora_versions_reach_the_engine_merged(model_dir: Path) -> None:
    local = local_rollouts(model_dir, Client())
    model = lora.attach(
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), LoraConfig(rank=2)
    )
    for version in range(2):
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if "lora_" in name:
                    parameter.add_(0.05 * (version + 1))
        state = lora.publication_state(model)
        local.offer(version, state)
        local._apply()
        held = engine_state(local)
        for name, tensor in lora.merge(state).items():
            assert torch.allclose(held[name], tensor, atol=1e-6), (version, name)
        assert not any(name.endswith(lora.ADAPTER_SUFFIXES) for name in held)  # merged, not served


def test_a_round_waits_for_its_version_to_be_published(model_dir: Path) -> None:
    client = Client()
    local = local_rollouts(model_dir, client)
    submission = RolloutSubmission.model_construct(rollouts=[])  # never parsed: only passed along
    future = local.submitter.submit(local._submit, 3, submission)
    time.sleep(0.3)
    assert not client.submitted  # v3 is not published yet
    local.published(2)
    time.sleep(0.3)
    assert not client.submitted
    local.published(3)
    future.result(5)
    assert client.submitted and client.submitted[0][1] is submission
    # a round whose version never goes out is dropped when the trainer closes
    dropped = local.submitter.submit(local._submit, 9, submission)
    local.close()
    dropped.result(5)
    assert len(client.submitted) == 1
