"""Sampled verification in a run of stage trainers: each stage trainer recomputes its own stage.

The verifier role rebuilds the claimed version of the whole model; here nobody holds it. The
rollouts of a staged run carry every holder's signed commitments and the bytes they cover
(`StageTrace`), which the coordinator has checked chain from stage to stage. So each stage can be
checked alone (`model/stage_check.py`): stage trainer s runs its stage, at the version the
rollout claims, on exactly what stage s committed to receive, and compares with what it answered.
Rank 0 takes the verification jobs (`POST /v1/verifier/jobs`, the trainer token) while it waits
for batches and with each batch, every rank checks its stage, and rank 0 composes one verdict per
rollout: blame on the first stage whose check failed (blame localisation as the verifier's); and
from the last stage's logits on its committed inputs the log-prob errors, the mean test's evidence
and the plausibility sums (`trust/token_evidence.py`), which the coordinator judges as any verdict.

Each rank keeps its stage's published state of its last `window` versions (the versions a rollout
within `max_staleness` claims) and an inference copy of its stage (`model/stages.py`) to load them
into, so a stage trainer holds its stage about `1 + window` times (bf16 for the kept versions;
with LoRA they share their unchanged base). What the verifier's version test measures (are the
claims closer to the version before?) needs a version's whole chain and is not made here: a stage
answered with another version's weights shows as that stage's deviation, above the codec's
rounding only.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from pathlib import Path

import torch
import torch.distributed as dist

from decentrl.model.stage_check import check_stage
from decentrl.model.stages import Stage, load_stage
from decentrl.protocol import Verdict, VerdictBatch, VerifyJob
from decentrl.stage_map import StageMap
from decentrl.trainer.distributed import Ranks
from decentrl.trust.plausibility import MAX_ORDER
from decentrl.trust.token_evidence import pit_sums, token_errors

log = logging.getLogger(__name__)

StageResult = dict
"""What one stage found on one job (picklable, gathered to rank 0): `blame` (why, or None),
`unverifiable` (why, or None) and, from the last stage, the measurement's numbers."""


class StageVerifier:
    """Rank `stage`'s part: its stage at recent published versions, and the checks on it."""

    def __init__(self, model_dir: Path, stage_map: StageMap, stage: int, window: int, pad_token_id: int):
        self.stage: Stage = load_stage(model_dir, stage_map, stage)
        self.window = window
        self.pad = pad_token_id
        self.versions: OrderedDict[int, dict[str, torch.Tensor]] = OrderedDict()
        self.live: int | None = None

    def keep(self, version: int, state: dict[str, torch.Tensor]) -> None:
        """This stage's published state of `version` (its tensors as workers receive them); a
        tensor equal to the newest kept one's is shared, not copied (LoRA: the frozen base)."""
        newest = self.versions[next(reversed(self.versions))] if self.versions else {}
        kept = {}
        for name, tensor in state.items():
            same = name in newest and torch.equal(newest[name], tensor)
            kept[name] = newest[name] if same else tensor.detach().clone()
        self.versions[version] = kept
        while len(self.versions) > self.window:
            self.versions.popitem(last=False)

    def _at(self, version: int) -> bool:
        if version not in self.versions:
            return False
        if self.live != version:
            self.stage.load_weights(self.versions[version], version)
            self.live = version
        return True

    @torch.no_grad()
    def check(self, job: VerifyJob) -> StageResult:
        """This stage's checks of every model segment of `job`, at the version it claims."""
        if job.stage_traces is None:  # the coordinator keeps every staged rollout's traces
            return {"unverifiable": "no stage traces to check stage by stage"}
        context, traces = list(job.prompt_token_ids), iter(job.stage_traces)
        measured: dict = {"errors": [], "evidence": [], "pit": [0.0] * MAX_ORDER, "sampled": 0}
        for segment in job.segments:
            if segment.source != "model":
                context += segment.token_ids
                continue
            trace = next(traces)
            assert segment.policy_versions is not None and segment.logprobs is not None
            version = segment.policy_versions[0]
            if not self._at(version):
                held = f"v{min(self.versions)}-v{max(self.versions)}" if self.versions else "none"
                return {"unverifiable": f"stage {self.stage.stage} holds {held}, not v{version}"}
            found = check_stage(self.stage, trace, context, segment.token_ids, job.temperature, self.pad)
            if found.blame is not None:
                return {"blame": found.blame}
            if found.logits_nv is not None:
                self._measure(found.logits_nv, segment.token_ids, segment.logprobs, job, measured)
            context += segment.token_ids
        return {"blame": None, **(measured if self.stage.is_last else {})}

    @staticmethod
    def _measure(
        logits_nv: torch.Tensor, tokens: list[int], claimed: list[float], job: VerifyJob, into: dict
    ) -> None:
        """The last stage: the verifier's measurement of one segment's tokens."""
        from decentrl.algo.logprobs import logprobs_from_logits

        tokens_n = torch.tensor(tokens)
        recomputed_n = logprobs_from_logits(logits_nv, tokens_n, job.temperature).double()
        mean_n = torch.full_like(recomputed_n, job.tolerance_mean)
        error_n, evidence_n = token_errors(recomputed_n, torch.tensor(claimed, dtype=torch.float64), mean_n)
        into["errors"] += error_n.tolist()
        into["evidence"].append(float(evidence_n.sum()))
        temperature_n = torch.full_like(recomputed_n, job.temperature)
        owner_n = torch.zeros(len(tokens), dtype=torch.long)
        sums_jk, counts_j = pit_sums(logits_nv, tokens_n, temperature_n, owner_n, 1, job.pit_seed)
        into["pit"] = [a + b for a, b in zip(into["pit"], sums_jk[0].tolist(), strict=True)]
        into["sampled"] += int(counts_j[0])


def verdict(job: VerifyJob, found: list[StageResult]) -> Verdict:
    """One rollout's verdict from every stage's result, in stage order."""
    unverifiable = next((r["unverifiable"] for r in found if r.get("unverifiable")), None)
    if unverifiable is not None:
        return Verdict(rollout_id=job.rollout_id, unverifiable=unverifiable[:200])
    blamed = next(((stage, r["blame"]) for stage, r in enumerate(found) if r["blame"] is not None), None)
    if blamed is not None:
        return Verdict(rollout_id=job.rollout_id, blame_stage=blamed[0], blame_detail=blamed[1][:200])
    last = found[-1]
    errors = last["errors"]
    return Verdict(
        rollout_id=job.rollout_id,
        num_tokens=last["sampled"],
        max_logprob_error=max(errors, default=0.0),
        mean_logprob_error=sum(errors) / len(errors) if errors else 0.0,
        logprob_tokens=len(errors),
        error_log_evidence=sum(last["evidence"]),
        pit_sums=last["pit"],
    )


def verify_round(verifier: StageVerifier, jobs: list[VerifyJob], ranks: Ranks) -> VerdictBatch | None:
    """A collective: every stage checks every job on its stage; rank 0 gets the verdicts."""
    import time

    started = time.perf_counter()
    mine = [verifier.check(job) for job in jobs]
    seconds = time.perf_counter() - started
    gathered: list[tuple[list[StageResult], float] | None] = [None] * ranks.world_size
    dist.all_gather_object(gathered, (mine, seconds))
    if not ranks.is_main:
        return None
    per_stage = [item[0] for item in gathered if item is not None]
    verdicts = [verdict(job, [results[index] for results in per_stage]) for index, job in enumerate(jobs)]
    compute = sum(item[1] for item in gathered if item is not None)
    blamed = [v for v in verdicts if v.blame_stage is not None]
    if blamed:
        log.warning(
            "verification blamed %d of %d rollouts: %s", len(blamed), len(jobs), blamed[0].blame_detail
        )
    return VerdictBatch(verdicts=verdicts, compute_seconds=compute, dtype="float32")
