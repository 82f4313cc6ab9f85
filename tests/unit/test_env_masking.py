"""Environment tokens of a multi-turn rollout contribute exactly zero gradient."""

from __future__ import annotations

import torch

from decentrl.config import ModelConfig, RunConfig
from decentrl.model.tiny import build_tiny
from decentrl.protocol import Segment, TrainGroup, TrainRollout
from decentrl.trainer.batch import collate
from decentrl.trainer.step import Algorithm, train_step


def rollout(index: int, reward: float) -> TrainRollout:
    def model(ids: list[int]) -> Segment:
        return Segment(
            source="model", token_ids=ids, logprobs=[-1.0] * len(ids), policy_versions=[0] * len(ids)
        )

    return TrainRollout(
        rollout_id=f"r{index}",
        worker_id="w",
        prompt_token_ids=[10, 11, 12],
        segments=[
            model([20 + index, 21, 1]),
            Segment(source="env", token_ids=[30, 31, 32, 33]),
            model([40, 41 + index, 1]),
        ],
        finish_reason="stop",
        reward=reward,
    )


def test_env_tokens_get_exactly_zero_gradient() -> None:
    torch.manual_seed(0)
    model, tokenizer = build_tiny(ModelConfig(hidden_size=64, num_heads=2, intermediate_size=64))
    config = RunConfig()
    algorithm = Algorithm.from_config(config.algorithm)
    groups = [TrainGroup(group_id="g", task_id="t", rollouts=[rollout(0, 1.0), rollout(1, 0.0)])]
    batch = collate(groups, tokenizer.pad_token_id, algorithm.advantage)
    captured: list[torch.Tensor] = []

    def keep(module, inputs, output):
        if output.requires_grad:  # the training forward, not the no-grad pi_prox pass
            output.retain_grad()
            captured.append(output)

    # The final norm's output is the hidden state the head turns into the logits of each position
    # (position by position), so its gradient at t is what the token t+1 contributes.
    model.model.norm.register_forward_hook(keep)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    trainer = config.trainer.model_copy(update={"minibatches_per_version": 1})
    train_step(model, optimizer, batch, algorithm, trainer, 1.0, 0, max_new_tokens=16)
    (hidden_bth,) = captured
    assert hidden_bth.grad is not None
    # Position t predicts token t+1. Layout of each row (from `rollout`): prompt 0-2,
    # model 3-5, env 6-9, model 10-12; derived here from the segments, not from the batch's mask.
    contribution_bt = hidden_bth.grad[:, :-1].abs().sum(-1)
    env_targets = torch.arange(6, 10) - 1
    model_targets = torch.cat([torch.arange(3, 6), torch.arange(10, 13)]) - 1
    assert torch.all(contribution_bt[:, env_targets] == 0.0)  # env tokens contribute exactly nothing
    assert torch.all(contribution_bt[:, model_targets] > 0.0)  # every model token does
