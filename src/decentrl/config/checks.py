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
    if config.model.vision is not None and config.model.num_stages is not None:
        raise ConfigError(
            "model.vision with model.num_stages: pipeline stages split a language model's decoder "
            "layers, not a vision tower; run a vision-language model unstaged"
        )
    check_colocated(config)
    check_stage_trainers(config)


def colocated_room(config: RunConfig) -> int:
    """Untrained groups a colocated trainer alone keeps in flight: the batch it trains, the next
    one fetched, the last one until its ack, and the round it samples ahead."""
    return 3 * config.trainer.groups_per_step + config.trainer.local_groups


def check_colocated(config: RunConfig) -> None:
    """A colocated trainer samples on one process with room for its round ahead, and a demo
    needs someone to sample."""
    local = config.trainer.local_groups
    pending = config.coordinator.max_pending_groups
    if local and pending < colocated_room(config):
        raise ConfigError(
            f"trainer.local_groups={local} needs coordinator.max_pending_groups >= {colocated_room(config)} "
            f"(3 x groups_per_step + local_groups: the batch training, the next one fetched, the last one "
            f"until its ack, and the round sampled ahead), not {pending}; raise it"
        )
    if local and config.trainer.nproc > 1:
        raise ConfigError(
            f"trainer.local_groups={local} needs trainer.nproc=1: a colocated trainer samples with "
            "one process's model; run workers beside a multi-rank trainer instead"
        )
    if local and config.model.num_stages is not None:
        raise ConfigError(
            f"trainer.local_groups={local} cannot run in a staged run (model.num_stages="
            f"{config.model.num_stages}): only stage holders sample there; set local_groups=0"
        )
    if config.demo.num_workers == 0 and not local:
        raise ConfigError(
            "demo.num_workers=0 leaves nobody to sample: set trainer.local_groups > 0 "
            "(`decentrl demo --colocate`) or start at least one worker"
        )


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
