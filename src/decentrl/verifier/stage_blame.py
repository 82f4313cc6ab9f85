"""Which stage of a staged rollout computed wrongly: each stage recomputed on its committed inputs.

The trusted verifier holds the whole claimed version, so it runs every stage's check
(`model/stage_check.py`: teacher forced on exactly what that stage received, compared with what it
answered) and blames the first stage whose check fails: an honest stage given corrupted inputs
computes correctly on them, so blame never lands on a later honest one. A run trained by stage
trainers checks the same way with each stage trainer running its own stage's check
(`trainer/stage_verification.py`).
"""

from __future__ import annotations

import torch

from decentrl.model.stage_check import BOUNDARY_TOLERANCE, LOGPROB_TOLERANCE, check_stage
from decentrl.model.stages import Stage
from decentrl.protocol import VerifyJob
from decentrl.stage_map import StageMap

__all__ = ["BOUNDARY_TOLERANCE", "LOGPROB_TOLERANCE", "blame", "stages_over"]


def stages_over(model: torch.nn.Module, stage_map: StageMap) -> list[Stage]:
    """The stages of the verifier's whole model (every module real; each runs only its layers)."""
    names = list(model.state_dict())
    stages = [Stage(model, stage_map, s, stage_map.names(s, names)) for s in range(stage_map.num_stages)]  # type: ignore[arg-type]
    for stage in stages:
        stage.loaded = True  # the verifier loaded the claimed version into the whole model
    return stages


@torch.no_grad()
def blame(stages: list[Stage], job: VerifyJob, pad_token_id: int) -> tuple[int, str] | None:
    """(stage, why) for the first stage of any model segment whose answer diverges; None if none."""
    assert job.stage_traces is not None
    context = list(job.prompt_token_ids)
    traces = iter(job.stage_traces)
    for segment in job.segments:
        if segment.source == "model":
            trace = next(traces)
            for stage in stages:
                found = check_stage(stage, trace, context, segment.token_ids, job.temperature, pad_token_id)
                if found.blame is not None:
                    return stage.stage, found.blame
        context += segment.token_ids
    return None
