"""Settings valid one by one that can never work together: refused when the config is loaded.

A trainer started with its own config may not know the coordinator's sections; the coordinator
refuses a batch request it can never fill (`coordinator/pipeline/batching.py`) and the
multi-rank trainer checks its ranks against the coordinator's group size when it starts.
"""

from __future__ import annotations

from decentrl.config.base import ConfigError
from decentrl.config.roles import TrainerConfig
from decentrl.config.run import RunConfig


def check_together(config: RunConfig) -> None:
    """A `ConfigError` naming the fix for sizes that contradict each other."""
    groups, pending = config.trainer.groups_per_step, config.coordinator.max_pending_groups
    if groups > pending:
        # The coordinator stops creating groups at max_pending_groups untrained ones, so fewer
        # than a batch would ever be ready: the trainer would wait forever.
        raise ConfigError(
            f"trainer.groups_per_step={groups} exceeds coordinator.max_pending_groups={pending}: "
            "a batch could never fill; lower groups_per_step or raise max_pending_groups"
        )
    check_ranks(config.trainer, config.coordinator.group_size, config.trainer.nproc)
    check_stage_trainers(config)


def check_stage_trainers(config: RunConfig) -> None:
    """Stage trainers train a staged run's stages, one each, in one process group of their own."""
    trainer, model = config.trainer, config.model
    stages = trainer.pipeline_stages
    if config.weights.store == "peers" and stages == 1:
        raise ConfigError(
            'weights.store = "peers" needs stage trainers to serve the chunks: set '
            'trainer.pipeline_stages to the run\'s model.num_stages, or keep weights.store = "coordinator"'
        )
    if stages == 1:
        return
    declared = len(model.stage_layers) if model.stage_layers is not None else model.num_stages
    if declared != stages:
        raise ConfigError(
            f"trainer.pipeline_stages = {stages} needs a run split into as many stages; model.num_stages "
            f"(or model.stage_layers) says {declared}"
        )
    if trainer.nproc > 1:
        raise ConfigError(
            "trainer.nproc > 1 (FSDP2 ranks) and trainer.pipeline_stages > 1 (stage trainers) do not "
            "combine yet; set one of them to 1"
        )
    if trainer.eval_every:
        raise ConfigError(
            "stage trainers never hold the whole model, so they cannot evaluate it in the run: set "
            "trainer.eval_every = 0 (evaluate an export of the run instead, docs/release.md)"
        )


def check_ranks(trainer: TrainerConfig, group_size: int, num_ranks: int) -> None:
    """Each of `num_ranks` trainer ranks needs at least one sequence of every mini-batch (each rank's
    forward and backward are collectives, so none may sit one out)."""
    rows = trainer.groups_per_step * group_size
    # minibatch_rows (trainer/batch.py) cuts the rows into pieces that differ by at most one.
    smallest = rows // min(trainer.minibatches_per_version, rows)
    if smallest < num_ranks:
        raise ConfigError(
            f"a mini-batch of {smallest} sequences (trainer.groups_per_step={trainer.groups_per_step}"
            f" x group_size={group_size} / trainer.minibatches_per_version="
            f"{trainer.minibatches_per_version}) cannot give each of {num_ranks} trainer ranks a "
            "sequence; raise groups_per_step, lower minibatches_per_version or run fewer ranks"
        )
