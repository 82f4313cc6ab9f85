"""The trainer's pipeline dimension: one version's passes run across K stage trainers.

With `trainer.pipeline_stages = K` the trainer is K ranks, rank s holding stage s of the policy
(`stage_model.py`). Every pass of a version goes through the stages as a pipeline, with
`torch.distributed.pipelining`: one `PipelineStage` per rank and a GPipe or 1F1B schedule over the
version's micro-batches, so stage s computes micro-batch i while stage s + 1 computes i - 1.

The passes are the one-process trainer's (`step.py`), stage-wise:
1. pi_prox (and a KL penalty's reference log-probs), forward only over `micro_batch_rows` of the
   whole batch; the last stage scores each micro-batch with `sequence_logprobs` and applies the
   off-policy correction from `algo/` to the whole batch, exactly as one process does.
2. per mini-batch, forward and backward over the same micro-batches as one process; the last
   stage computes `policy_loss` on each (global token counts, `algo/aggregation.py`), the
   schedule runs the backward through every stage, then each stage clips by the *global*
   gradient norm and steps AdamW on its own parameters.

Why the update is the one process's, to the last bit on CPU: each stage computes on exactly the
micro-batch's tensors (the schedule moves them flattened and padded to the pass's largest
micro-batch, and each stage cuts them back before computing); the schedules run each stage's backward passes
in micro-batch order, so gradients accumulate in the same order; the norm is taken over the
per-tensor norms gathered from every stage in the one-process parameter order; and a tied
embedding, held by the first and the last stage, gets the sum of both ends' gradients on both,
which then take the same AdamW step.

What `torch.distributed.pipelining` (torch 2.13) does not do here, and how it is met:
- Its stages infer one shape for every micro-batch of a schedule (from the first, or given
  statically); a version's micro-batches differ in rows and width. Hidden states travel as
  [positions, D], padded to the pass's largest micro-batch (rows x width, at most
  `trainer.micro_batch_tokens`), and a fresh `PipelineStage` (static shapes: no metadata pass)
  and schedule are made per pass.
- Only the first stage gets the schedule's inputs; the others need the micro-batch's mask and
  positions. Every rank holds the collated batch, so the micro-batch index travels with the
  hidden states (an int64 [1, 1] tensor) and each stage looks its rows up.
- 1F1B needs at least as many micro-batches as stages; a pass with fewer runs GPipe.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Literal, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from decentrl.algo.aggregation import BatchCounts
from decentrl.algo.logprobs import sequence_logprobs
from decentrl.config import TrainerConfig
from decentrl.trainer.batch import TrainTensors, micro_batch_rows
from decentrl.trainer.distributed import Ranks
from decentrl.trainer.stage_model import StageModel
from decentrl.trainer.step import (
    LOSS_TERMS,
    Algorithm,
    apply_correction,
    learning_rate,
    optimizer_steps,
    policy_loss,
    version_metrics,
)
from decentrl.trainer.tied_gradients import TiedGradients

log = logging.getLogger(__name__)

ScheduleName = Literal["gpipe", "1f1b"]
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
BoundaryCodec = Literal["float32", "bfloat16"]
TRANSPORT = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""The boundary codecs that are lossy-safe for training: a differentiable cast. The holders'
per-token int8 (`model/boundary_codec.py`) rounds to a grid and has no gradient, so it is not one."""


class _TailModel:
    """What `sequence_logprobs` needs of a causal LM, over the last stage's final hidden states:
    the log-probs and the loss are then computed by the one function every role shares."""

    def __init__(self, stage_model: StageModel, hidden_btd: torch.Tensor):
        causal: Any = stage_model.model  # a transformers causal LM; torch.nn.Module does not declare these
        self.config = causal.config
        self._head = causal.get_output_embeddings()
        self._hidden = hidden_btd

    def get_decoder(self) -> Callable[..., Any]:
        return lambda **_: SimpleNamespace(last_hidden_state=self._hidden)

    def get_output_embeddings(self) -> torch.nn.Module:
        return self._head


OnLast = Callable[[_TailModel, TrainTensors, int], torch.Tensor]
"""What the last stage does with micro-batch i's final hidden states: its loss, or zero."""


class _StagePass(torch.nn.Module):
    """The module one rank's `PipelineStage` runs for each micro-batch of one pass."""

    def __init__(
        self,
        stage_model: StageModel,
        micros: list[TrainTensors],
        shape: tuple,
        on_last: OnLast,
        transport: torch.dtype = torch.float32,
    ):
        super().__init__()
        self.stage_model = stage_model  # a plain attribute holder: the schedule steps no optimizer
        self.micros = micros
        self.shape = shape
        self.on_last = on_last
        self.transport = transport

    def forward(self, *inputs: torch.Tensor) -> Any:
        stage = self.stage_model.stage
        if stage.is_first:
            (index_11,) = inputs
        else:
            flat_pd, index_11 = inputs
        index = int(index_11.reshape(-1)[0])
        micro = self.micros[index]
        rows, width = micro.input_ids_bt.shape
        # The model's own positions for right-padded rows: 0..T-1, shared by every row.
        positions_1t = torch.arange(width, device=stage.device).unsqueeze(0)
        # Hidden states travel flat, [positions, D] padded to the pass's largest micro-batch.
        inputs_x = (
            micro.input_ids_bt if stage.is_first else flat_pd[: rows * width].unflatten(0, (rows, width))
        )
        hidden_btd = stage.run(inputs_x, micro.attention_mask_bt, positions_1t)
        if stage.is_last:
            return self.on_last(_TailModel(self.stage_model, hidden_btd), micro, index)
        # In the boundary's dtype: a bfloat16 boundary halves what crosses it, both ways (the
        # cast's backward hands the gradient over in bfloat16 too; the next stage computes in fp32).
        flat_pd = F.pad(hidden_btd.flatten(0, 1), (0, 0, 0, self.shape[0] - rows * width))
        return flat_pd.to(self.transport), index_11


@dataclass
class PipelineRunner:
    """One rank's part in the pipeline passes of every version."""

    stage_model: StageModel
    ranks: Ranks
    schedule: ScheduleName = "1f1b"
    reference: StageModel | None = None
    """The frozen warm start of this stage, for a KL penalty in full-parameter training (with
    LoRA the reference is this stage with its adapters off)."""
    codec: BoundaryCodec = "float32"
    """How hidden states and their gradients cross a boundary between stage trainers
    (`trainer.boundary_codec`): float32 is exact, bfloat16 halves the bytes."""

    def __post_init__(self) -> None:
        stage_map = self.stage_model.stage_map
        self.is_last = self.stage_model.stage.is_last
        # Both ends hold a tied embedding; they add their gradients in a group of their own.
        tied_trained = stage_map.tied_embeddings and self.stage_model.lora_scaling is None
        self.ends = dist.new_group([0, stage_map.last]) if tied_trained else None
        self.traffic: dict[str, float] = defaultdict(float)
        """Bytes that crossed one boundary this version, forward and backward, and the real
        (unpadded) tokens they carried (`take_traffic`)."""

    # ------------------------------------------------------------------ passes

    def run(
        self, micros: list[TrainTensors], on_last: OnLast, backward: bool, stage_model: StageModel
    ) -> None:
        """Every micro-batch through the pipeline: forward, and with `backward` the backward
        pass too (the last stage's `on_last` returns each micro-batch's loss)."""
        stage = stage_model.stage
        size = stage.config.hidden_size
        shape = (max(micro.input_ids_bt.numel() for micro in micros), size)
        transport = TRANSPORT[self.codec]
        hidden = torch.zeros(shape, device=stage.device, dtype=transport, requires_grad=backward)
        index = torch.zeros((1, 1), dtype=torch.long)
        inputs = (index,) if stage.is_first else (hidden, index)
        outputs = (torch.zeros((), device=stage.device),) if stage.is_last else (hidden, index)
        module = _StagePass(stage_model, micros, shape, on_last, transport)
        crossing = len(micros) * hidden.numel() * hidden.element_size()
        tokens = sum(int(micro.attention_mask_bt.sum()) for micro in micros)
        self.traffic["forward"] += crossing + len(micros) * index.numel() * index.element_size()
        self.traffic["forward_tokens"] += tokens
        if backward:
            self.traffic["backward"] += crossing
            self.traffic["backward_tokens"] += tokens
        pipe = PipelineStage(
            module,
            stage.stage,
            stage_model.stage_map.num_stages,
            stage.device,
            input_args=inputs,
            output_args=outputs,
        )
        count = len(micros)
        kind = SCHEDULES[self.schedule] if backward else ScheduleGPipe
        if kind is Schedule1F1B and count < stage_model.stage_map.num_stages:
            kind = ScheduleGPipe  # 1F1B refuses fewer micro-batches than stages
        loss = (lambda output, _target: output) if backward else None
        schedule = kind(pipe, n_microbatches=count, loss_fn=loss, scale_grads=False)
        indices = torch.arange(count).view(count, 1)
        target = indices if backward else None
        if stage.is_first:
            schedule.step(indices, target=target, return_outputs=False)
        else:
            schedule.step(target=target, return_outputs=False)

    @torch.no_grad()
    def score(
        self, batch: TrainTensors, temperature: float, micro_batch_tokens: int, with_reference: bool
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """pi_prox and (`with_reference`) pi_ref of every token, [B, T] on the last stage (None on
        the others), over the one-process trainer's micro-batches (`step.score`)."""
        groups = micro_batch_rows(batch, list(range(batch.num_rows)), micro_batch_tokens)
        micros = [batch.select(rows).to(self.stage_model.stage.device) for rows in groups]
        proximal_bt = self._score_pass(batch, groups, micros, temperature, self.stage_model)
        reference_bt = None
        if with_reference:
            if self.reference is not None:
                reference_bt = self._score_pass(batch, groups, micros, temperature, self.reference)
            else:
                peft_model: Any = self.stage_model.model
                with peft_model.disable_adapter():
                    reference_bt = self._score_pass(batch, groups, micros, temperature, self.stage_model)
        return proximal_bt, reference_bt

    def _score_pass(
        self,
        batch: TrainTensors,
        groups: list[list[int]],
        micros: list[TrainTensors],
        temperature: float,
        stage_model: StageModel,
    ) -> torch.Tensor | None:
        stage_model.model.eval()
        scores_bt = torch.zeros_like(batch.behaviour_logprobs_bt) if self.is_last else None

        def on_last(tail: Any, micro: TrainTensors, index: int) -> torch.Tensor:
            assert scores_bt is not None
            logprobs_bt, _ = sequence_logprobs(tail, micro.input_ids_bt, micro.attention_mask_bt, temperature)
            scores_bt[groups[index], : micro.input_ids_bt.shape[1]] = logprobs_bt.float().cpu()
            return logprobs_bt.new_zeros(())

        self.run(micros, on_last, backward=False, stage_model=stage_model)
        return scores_bt

    def update(
        self,
        optimizer: torch.optim.Optimizer,
        minibatch: TrainTensors,
        loss_of: Callable[[_TailModel, TrainTensors], tuple[torch.Tensor, dict[str, float]]],
        config: TrainerConfig,
    ) -> dict[str, float]:
        """One optimizer step on `minibatch` (`step.minibatch_update`, pipelined); `loss_of` is the
        last stage's `policy_loss` of one micro-batch. Returns the step's statistics (the loss
        terms summed, the per-token diagnostics token-weighted) on every stage."""
        model = self.stage_model.model
        model.train()
        optimizer.zero_grad(set_to_none=True)
        groups = micro_batch_rows(minibatch, list(range(minibatch.num_rows)), config.micro_batch_tokens)
        micros = [minibatch.select(rows).to(self.stage_model.stage.device) for rows in groups]
        sums: dict[str, float] = defaultdict(float)

        def on_last(tail: _TailModel, micro: TrainTensors, index: int) -> torch.Tensor:
            loss, stats = loss_of(tail, micro)
            tokens = micro.num_loss_tokens
            sums["loss"] += float(loss.detach())
            for key, value in stats.items():
                sums[key] += value if key in LOSS_TERMS else value * tokens
            sums["tokens"] += tokens
            return loss

        tied = self._tied_gradients()
        try:
            self.run(micros, on_last, backward=True, stage_model=self.stage_model)
        finally:
            if tied is not None:
                tied.close()
        if tied is not None:
            tied.finish()
            # the last stage's part per micro-batch, then the sum back to it
            self.traffic["tied"] += (len(micros) + 1) * tied.embedding.numel() * tied.embedding.element_size()
        grad_norm = self._clip(config.max_grad_norm)
        optimizer.step()
        model.eval()
        out: dict[str, float] = {}
        if self.is_last:
            tokens = max(1.0, sums.pop("tokens"))
            out = {key: value if key in LOSS_TERMS else value / tokens for key, value in sums.items()}
        out = from_last(out, self.ranks)
        out["grad_norm"] = grad_norm
        return out

    # ------------------------------------------------------------------ gradients

    def take_traffic(self) -> dict[str, float]:
        """Bytes per token per pass that crossed each boundary since the last call (every boundary
        carries the same: the pass's padded micro-batches): forward over every pass (pi_prox, a
        reference, the training passes), backward over the training passes."""
        traffic = self.traffic
        out = {
            "boundary_forward_bytes_per_token": traffic["forward"] / max(1.0, traffic["forward_tokens"]),
            "boundary_backward_bytes_per_token": traffic["backward"] / max(1.0, traffic["backward_tokens"]),
            "tied_embedding_bytes": traffic["tied"],
        }
        self.traffic.clear()
        return out

    def _tied_gradients(self) -> TiedGradients | None:
        """On the two ends of a trained tied embedding: its gradient gathered as one process
        accumulates it (`TiedGradients`); None on every other stage."""
        if self.ends is None or not (self.stage_model.stage.is_first or self.is_last):
            return None
        causal: Any = self.stage_model.model  # a transformers causal LM; torch.nn.Module does not declare it
        embedding = causal.get_input_embeddings().weight
        return TiedGradients(
            embedding, self.stage_model.stage.is_first, self.stage_model.stage_map.last, self.ends
        )

    def _clip(self, max_norm: float) -> float:
        """Clip by the norm over every stage's gradients, taken as `clip_grad_norm_` takes it in
        one process: the norm of the per-tensor norms, stacked in the model's parameter order."""
        own = [(name, p) for name, p in self.stage_model.named_trainable() if p.grad is not None]
        grads = [cast(torch.Tensor, p.grad) for _, p in own]  # each has one (filtered above)
        # torch's own per-tensor norms (clip_grad_norm_ takes them with _foreach_norm too)
        norms = torch._foreach_norm(grads, 2.0) if grads else []  # pyright: ignore[reportPrivateImportUsage] (not in torch's __all__)
        mine = {name: norm.cpu() for (name, _), norm in zip(own, norms, strict=True)}
        gathered: list[dict[str, torch.Tensor] | None] = [None] * self.ranks.world_size
        dist.all_gather_object(gathered, mine)
        merged: dict[str, torch.Tensor] = {}
        for part in gathered:
            for name, norm in (part or {}).items():
                merged.setdefault(name, norm)  # a tied embedding's, the same at both ends
        order = [name for name in self.stage_model.trainable_order if name in merged]
        total = torch.linalg.vector_norm(torch.stack([merged[name] for name in order]), 2.0)
        torch.nn.utils.clip_grads_with_norm_(
            [p for _, p in own], max_norm, total.to(self.stage_model.stage.device)
        )
        return float(total)


def from_last(values: dict[str, float], ranks: Ranks) -> dict[str, float]:
    """The last stage's `values` on every stage."""
    box = [values]
    dist.broadcast_object_list(box, src=ranks.world_size - 1)
    return dict(box[0] or {})


def train_step(
    runner: PipelineRunner,
    optimizer: torch.optim.Optimizer,
    batch: TrainTensors,
    algorithm: Algorithm,
    config: TrainerConfig,
    temperature: float,
    policy_version: int,
    max_new_tokens: int,
) -> dict[str, float]:
    """`step.train_step` on K stage trainers (a collective: every stage passes the whole batch).
    Returns the version's diagnostics on every stage."""
    ranks = runner.ranks
    for group in optimizer.param_groups:
        group["lr"] = learning_rate(config, policy_version)
    with_reference = algorithm.config.kl_coef > 0
    proximal_bt, reference_bt = runner.score(batch, temperature, config.micro_batch_tokens, with_reference)
    correction_stats: dict[str, float] = {}
    if runner.is_last:  # only the last stage computes a loss, so only it needs the anchors
        assert proximal_bt is not None
        correction_stats = apply_correction(batch, proximal_bt, reference_bt, algorithm)
    # pi_prox on every stage too: rank 0's rollout inspector shows it (a few kB per batch).
    proximal = (proximal_bt if proximal_bt is not None else torch.zeros_like(batch.behaviour_logprobs_bt)).to(
        ranks.device
    )
    dist.broadcast(proximal, src=ranks.world_size - 1)
    batch.proximal_logprobs_bt = proximal.cpu()

    def update(rows: list[int], counts: BatchCounts) -> dict[str, float]:
        def loss_of(tail: Any, micro: TrainTensors) -> tuple[torch.Tensor, dict[str, float]]:
            return policy_loss(tail, micro, algorithm, temperature, counts)

        return runner.update(optimizer, batch.select(rows), loss_of, config)

    metrics = optimizer_steps(batch, config, max_new_tokens, ranks, update)
    metrics.update(runner.take_traffic())
    return version_metrics(
        metrics, optimizer, batch, ranks, from_last(correction_stats, ranks), policy_version
    )
