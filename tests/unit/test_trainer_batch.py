"""Collating wire rollouts into training tensors, and trainer checkpoints."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from decentrl.algo.advantages.grpo import GRPO
from decentrl.algo.aggregation import BatchCounts, token_scale
from decentrl.algo.losses import LossInputs
from decentrl.algo.registry import build_loss
from decentrl.config import ModelConfig
from decentrl.config.algorithm import CISPOLoss, DAPOLoss, GRPOAdvantage, GSPOLoss, PPOClipLoss
from decentrl.model.tiny import build_tiny
from decentrl.protocol import Segment, TrainGroup, TrainRollout
from decentrl.trainer.batch import collate
from decentrl.trainer.checkpoint import Checkpointer, TrainerState, capture

PAD = 0


def model_segment(ids: list[int], logprobs: list[float], version: int) -> Segment:
    return Segment(source="model", token_ids=ids, logprobs=logprobs, policy_versions=[version] * len(ids))


def rollout(name: str, prompt: list[int], segments: list[Segment], reward: float) -> TrainRollout:
    return TrainRollout(
        rollout_id=name,
        worker_id="w",
        prompt_token_ids=prompt,
        segments=segments,
        finish_reason="stop",
        reward=reward,
    )


@pytest.fixture
def groups() -> list[TrainGroup]:
    # group a: rewards [1, 0]; the second rollout is multi-turn: model, env, model
    # group b: rewards [0, 0, 1]
    a0 = rollout("a0", [10, 11, 12], [model_segment([20, 21], [-0.1, -0.2], 3)], 1.0)
    a1 = rollout(
        "a1",
        [10, 11, 12],
        [
            model_segment([22, 23], [-0.3, -0.4], 3),
            Segment(source="env", token_ids=[30, 31, 32]),
            model_segment([24, 1], [-0.5, -0.6], 4),
        ],
        0.0,
    )
    b0 = rollout("b0", [13, 14], [model_segment([25], [-0.7], 2)], 0.0)
    b1 = rollout("b1", [13, 14], [model_segment([26, 27, 1], [-0.8, -0.9, -1.0], 2)], 0.0)
    b2 = rollout("b2", [13, 14], [model_segment([28, 1], [-1.1, -1.2], 4)], 1.0)
    return [
        TrainGroup(group_id="a", task_id="ta", rollouts=[a0, a1]),
        TrainGroup(group_id="b", task_id="tb", rollouts=[b0, b1, b2]),
    ]


def test_collate_layout(groups: list[TrainGroup]) -> None:
    batch = collate(groups, PAD, GRPO(GRPOAdvantage()))
    # widest row: a1 = 3 prompt + 2 model + 3 env + 2 model = 10 tokens
    assert batch.input_ids_bt.tolist() == [
        [10, 11, 12, 20, 21, 0, 0, 0, 0, 0],
        [10, 11, 12, 22, 23, 30, 31, 32, 24, 1],
        [13, 14, 25, 0, 0, 0, 0, 0, 0, 0],
        [13, 14, 26, 27, 1, 0, 0, 0, 0, 0],
        [13, 14, 28, 1, 0, 0, 0, 0, 0, 0],
    ]
    assert batch.attention_mask_bt.tolist() == [
        [1, 1, 1, 1, 1, 0, 0, 0, 0, 0],
        [1] * 10,
        [1, 1, 1, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0, 0, 0, 0],
    ]
    # loss only on model tokens: not prompt, not env, not padding
    assert batch.loss_mask_bt.int().tolist() == [
        [0, 0, 0, 1, 1, 0, 0, 0, 0, 0],
        [0, 0, 0, 1, 1, 0, 0, 0, 1, 1],
        [0, 0, 1, 0, 0, 0, 0, 0, 0, 0],
        [0, 0, 1, 1, 1, 0, 0, 0, 0, 0],
        [0, 0, 1, 1, 0, 0, 0, 0, 0, 0],
    ]
    assert batch.num_loss_tokens == 2 + 4 + 1 + 3 + 2
    loss_positions = batch.loss_mask_bt
    expected_logprobs = [-0.1, -0.2, -0.3, -0.4, -0.5, -0.6, -0.7, -0.8, -0.9, -1.0, -1.1, -1.2]
    torch.testing.assert_close(batch.behaviour_logprobs_bt[loss_positions], torch.tensor(expected_logprobs))
    assert batch.policy_versions_bt.tolist() == [
        [-1, -1, -1, 3, 3, -1, -1, -1, -1, -1],
        [-1, -1, -1, 3, 3, -1, -1, -1, 4, 4],
        [-1, -1, 2, -1, -1, -1, -1, -1, -1, -1],
        [-1, -1, 2, 2, 2, -1, -1, -1, -1, -1],
        [-1, -1, 4, 4, -1, -1, -1, -1, -1, -1],
    ]
    assert batch.rewards_b.tolist() == [1.0, 0.0, 0.0, 0.0, 1.0]


def test_collate_broadcasts_group_advantages(groups: list[TrainGroup]) -> None:
    batch = collate(groups, PAD, GRPO(GRPOAdvantage()))
    # group a [1, 0]: mean 0.5, unbiased std sqrt(0.5) = 0.7071068 -> ±0.7071068
    # group b [0, 0, 1]: mean 1/3, unbiased var (1/9 + 1/9 + 4/9) / 2 = 1/3, std 0.5773503
    #   -> -1/3 / 0.5773503 = -0.5773503 (twice), 2/3 / 0.5773503 = 1.1547005
    expected = [0.7071068, -0.7071068, -0.5773503, -0.5773503, 1.1547005]
    for row, advantage in enumerate(expected):
        on_loss_tokens = batch.advantages_bt[row][batch.loss_mask_bt[row]]
        torch.testing.assert_close(
            on_loss_tokens, torch.full_like(on_loss_tokens, advantage), atol=1e-5, rtol=0
        )


@pytest.mark.parametrize(
    "loss_config", [PPOClipLoss(), DAPOLoss(), GSPOLoss(), CISPOLoss()], ids=lambda c: c.name
)
def test_env_tokens_get_exactly_zero_gradient(groups: list[TrainGroup], loss_config) -> None:
    batch = collate(groups, PAD, GRPO(GRPOAdvantage()))
    generator = torch.Generator().manual_seed(0)
    logprobs = batch.behaviour_logprobs_bt + 0.05 * torch.randn(batch.input_ids_bt.shape, generator=generator)
    logprobs.requires_grad_(True)
    # big env-token log-probs would dominate the loss if they leaked in
    logprobs_with_env = torch.where(batch.loss_mask_bt, logprobs, logprobs * 50)
    counts = BatchCounts(batch.num_loss_tokens, len(batch.rewards_b), 8)
    out = build_loss(loss_config)(
        LossInputs(
            logprobs_bt=logprobs_with_env,
            anchor_logprobs_bt=batch.behaviour_logprobs_bt,
            weights_bt=torch.ones_like(logprobs),
            advantages_bt=batch.advantages_bt,
            loss_mask_bt=batch.loss_mask_bt,
            token_scale_bt=token_scale("token_mean", batch.loss_mask_bt, counts),
        )
    )
    out.loss.backward()
    env_positions = [(1, 5), (1, 6), (1, 7)]
    for row, column in env_positions:
        assert logprobs.grad[row, column] == 0.0
    assert torch.all(logprobs.grad[~batch.loss_mask_bt] == 0)
    assert logprobs.grad[batch.loss_mask_bt].abs().sum() > 0


# ---------------------------------------------------------------- checkpoints


def trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The tiny model after one optimizer step, so the optimizer has per-parameter state."""
    model, _ = build_tiny(ModelConfig(seed=seed))
    # SGD with momentum: its buffers are real optimizer state, and AdamW's step is slow on this CPU build
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    generator = torch.Generator().manual_seed(seed)
    for parameter in model.parameters():
        parameter.grad = torch.randn(parameter.shape, generator=generator)
    optimizer.step()
    return model, optimizer


def assert_same(model_a, optimizer_a, model_b, optimizer_b) -> None:
    state_a, state_b = model_a.state_dict(), model_b.state_dict()
    assert state_a.keys() == state_b.keys()
    for name in state_a:
        assert torch.equal(state_a[name], state_b[name]), name
    opt_a, opt_b = optimizer_a.state_dict(), optimizer_b.state_dict()
    assert opt_a["param_groups"] == opt_b["param_groups"]
    assert opt_a["state"].keys() == opt_b["state"].keys() and len(opt_a["state"]) > 0
    for index, entry in opt_a["state"].items():
        for key, value in entry.items():
            assert torch.equal(value, opt_b["state"][index][key]), (index, key)


def test_checkpoint_round_trip(tmp_path) -> None:
    model, optimizer = trained(seed=0)
    checkpointer = Checkpointer(tmp_path / "ckpt")
    assert not checkpointer.exists()
    written = TrainerState(policy_version=7, batch_id="batch-7", unacked=[(5, "batch-5"), (6, "batch-6")])
    checkpointer.save(model, optimizer, written)
    assert checkpointer.exists()

    fresh_model, fresh_optimizer = trained(seed=1)
    assert not torch.equal(fresh_model.model.embed_tokens.weight, model.model.embed_tokens.weight)
    state = Checkpointer(tmp_path / "ckpt").load(fresh_model, fresh_optimizer)
    assert state == written  # with the earlier batches whose acks were not confirmed
    assert_same(model, optimizer, fresh_model, fresh_optimizer)
    # the tied head is left out of the file; it must still follow the embedding
    assert torch.equal(fresh_model.lm_head.weight, model.lm_head.weight)


def test_captured_checkpoint_is_the_state_when_captured(tmp_path) -> None:
    # The outbox writes a version's checkpoint while the next version trains: what is written must
    # be the captured state, whatever the live model and optimizer do meanwhile.
    model, optimizer = trained(seed=0)
    reference_model, reference_optimizer = trained(seed=0)
    data = capture(model, optimizer, TrainerState(policy_version=4, batch_id="batch-4"))
    for parameter in model.parameters():
        parameter.grad = torch.ones_like(parameter)
    optimizer.step()  # moves every weight and momentum buffer in place
    assert not torch.equal(model.model.embed_tokens.weight, reference_model.model.embed_tokens.weight)
    checkpointer = Checkpointer(tmp_path)
    checkpointer.write(data)
    fresh_model, fresh_optimizer = trained(seed=1)
    assert checkpointer.load(fresh_model, fresh_optimizer) == TrainerState(4, "batch-4")
    assert_same(reference_model, reference_optimizer, fresh_model, fresh_optimizer)


def test_checkpoint_second_save_replaces_first(tmp_path) -> None:
    model, optimizer = trained(seed=0)
    checkpointer = Checkpointer(tmp_path)
    checkpointer.save(model, optimizer, TrainerState(policy_version=1, batch_id="b1"))
    checkpointer.save(model, optimizer, TrainerState(policy_version=2, batch_id="b2"))
    assert checkpointer.load(*trained(seed=1)) == TrainerState(policy_version=2, batch_id="b2")


def test_checkpoint_survives_crash_between_renames(tmp_path) -> None:
    model, optimizer = trained(seed=0)
    checkpointer = Checkpointer(tmp_path)
    checkpointer.save(model, optimizer, TrainerState(policy_version=3, batch_id=None))
    # a crash after `latest -> previous` and before `staging -> latest` of the next save
    (tmp_path / "latest").rename(tmp_path / "previous")
    shutil.copytree(tmp_path / "previous", tmp_path / "staging-12345")
    assert not (tmp_path / "latest").exists()

    restarted = Checkpointer(tmp_path)
    assert restarted.exists()
    fresh_model, fresh_optimizer = trained(seed=1)
    assert restarted.load(fresh_model, fresh_optimizer) == TrainerState(policy_version=3, batch_id=None)
    assert_same(model, optimizer, fresh_model, fresh_optimizer)


def test_bf16_checkpoint_keeps_the_fp32_master_weights(tmp_path) -> None:
    """A bf16 trainer checkpoints its fp32 masters, not their rounded copies: a resume is exact."""
    from decentrl.trainer.master_weights import MasterWeights

    model, _ = trained(seed=0)
    model = model.to(torch.bfloat16)
    master = MasterWeights(model)
    with torch.no_grad():  # masters that bf16 cannot represent
        for tensor in master.parameters():
            tensor.add_(1e-4)
    master.master_to_model()
    optimizer = torch.optim.SGD(master.parameters(), lr=1e-3, momentum=0.9)
    Checkpointer(tmp_path).save(model, optimizer, TrainerState(policy_version=2, batch_id="b2"), master)

    fresh, _ = trained(seed=1)
    fresh = fresh.to(torch.bfloat16)
    fresh_master = MasterWeights(fresh)
    Checkpointer(tmp_path).load(fresh, torch.optim.SGD(fresh_master.parameters(), lr=1e-3), fresh_master)
    for name, tensor in master.state().items():
        assert torch.equal(fresh_master.state()[name], tensor), name
        assert not torch.equal(tensor.to(torch.bfloat16).float(), tensor)  # rounding would lose it
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b)


def test_minibatches_and_micro_batches_partition_the_rows() -> None:
    from decentrl.trainer.batch import micro_batch_rows, minibatch_rows

    assert minibatch_rows(16, 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert minibatch_rows(5, 2) == [[0, 1], [2, 3, 4]]
    assert minibatch_rows(2, 4) == [[0], [1]]  # never an empty mini-batch
    groups = [
        TrainGroup(
            group_id="g",
            task_id="t",
            rollouts=[
                rollout(f"r{n}", [5] * n, [model_segment([7, 8], [-0.1, -0.2], 0)], float(n % 2))
                for n in (1, 6, 2, 5)
            ],
        )
    ]
    batch = collate(groups, PAD, GRPO(GRPOAdvantage()))
    # lengths 3, 8, 4, 7: longest first, each micro-batch within 16 padded tokens
    assert micro_batch_rows(batch, [0, 1, 2, 3], 16) == [[1, 3], [2, 0]]
    assert micro_batch_rows(batch, [0, 1, 2, 3], 15) == [[1], [3, 2], [0]]
    assert micro_batch_rows(batch, [0, 2], 1) == [[2], [0]]  # a row over the budget goes alone
    micro = batch.select([2, 0])
    assert micro.input_ids_bt.shape == (2, 4)  # cut to the longer of the two
    assert torch.equal(micro.input_ids_bt[1, :3], batch.input_ids_bt[0, :3])
    assert torch.equal(micro.advantages_bt, batch.advantages_bt[[2, 0], :4])


def test_trainer_drops_groups_beyond_max_staleness() -> None:
    from decentrl.trainer.batch import within_staleness

    def group(name: str, versions: list[int]) -> TrainGroup:
        segment = Segment(
            source="model",
            token_ids=[5] * len(versions),
            logprobs=[-1.0] * len(versions),
            policy_versions=versions,
        )
        rollout = TrainRollout(
            rollout_id=name,
            worker_id="w",
            prompt_token_ids=[4],
            segments=[segment],
            finish_reason="length",
            reward=0.0,
        )
        return TrainGroup(group_id=name, task_id=name, rollouts=[rollout])

    # at version 10 with max_staleness 4: a group is judged by its OLDEST token (6 ok, 5 too old)
    groups = [group("fresh", [9, 10]), group("edge", [6, 9]), group("old", [5, 10])]
    kept = within_staleness(groups, version=10, max_staleness=4)
    assert [g.group_id for g in kept] == ["fresh", "edge"]


class DiskEvents:
    """The renames and fsyncs of a checkpoint write, in order (the real calls still happen)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.events: list[tuple[str, str]] = []
        real_fsync, real_rename = os.fsync, Path.rename

        def fsync(handle: int) -> None:
            self.events.append(("fsync", os.readlink(f"/proc/self/fd/{handle}")))
            real_fsync(handle)

        def rename(path: Path, target: Path) -> Path:
            self.events.append(("rename", str(target)))
            return real_rename(path, target)

        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(Path, "rename", rename)

    def assert_renames_synced(self, directory: Path) -> None:
        """`directory/latest` was made by a rename, and `directory` was fsynced after it (a rename
        is durable only then), with state.json fsynced before it."""
        directory = directory.resolve()
        renamed = [i for i, event in enumerate(self.events) if event == ("rename", str(directory / "latest"))]
        assert renamed, self.events
        assert ("fsync", str(directory)) in self.events[renamed[-1] :], self.events
        synced = [target for kind, target in self.events[: renamed[-1]] if kind == "fsync"]
        assert any(target.endswith("/state.json") for target in synced), self.events


def test_checkpoint_renames_are_fsynced(tmp_path, monkeypatch) -> None:
    model, optimizer = trained(seed=0)
    checkpointer = Checkpointer(tmp_path)
    checkpointer.save(model, optimizer, TrainerState(policy_version=1, batch_id="b1"))
    disk = DiskEvents(monkeypatch)
    checkpointer.save(model, optimizer, TrainerState(policy_version=2, batch_id="b2"))
    disk.assert_renames_synced(tmp_path)


def test_sharded_checkpoint_renames_are_fsynced(tmp_path, monkeypatch) -> None:
    import torch.distributed as dist

    from decentrl.trainer.distributed import Ranks
    from decentrl.trainer.sharded_checkpoint import ShardedCheckpointer

    # One rank in this process: the same code path as rank 0 of many.
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        model, optimizer = trained(seed=0)
        checkpointer = ShardedCheckpointer(tmp_path / "sharded", Ranks(0, 1, torch.device("cpu")))
        disk = DiskEvents(monkeypatch)
        checkpointer.save(model, optimizer, TrainerState(policy_version=1, batch_id="b1"))
        disk.assert_renames_synced(tmp_path / "sharded")
    finally:
        dist.destroy_process_group()
