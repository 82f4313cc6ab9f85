"""One stage of a staged rollout recomputed on what it committed to receive, against what it answered.

The coordinator has checked that a trace's bytes are what each holder committed to and that they
chain from stage to stage (`coordinator/trust/stage_traces.py`), so each stage can be checked on its
own, by whoever holds that stage at the claimed version: the verifier, which holds the whole
version (`verifier/stage_blame.py`), or each stage trainer for its own stage, which never holds the
others (`trainer/stage_verification.py`). Teacher forced, one pass over the row's positions:

- stage 0 (the driver): its output on the row's tokens against what stage 1 received;
- a middle stage: its output on what it received against what it answered;
- the last stage: the log-prob of each sampled token against the one it answered.

An honest stage differs only by the boundary codec's rounding of its answer (bfloat16 and per-token
int8 both round to within 2^-8 of a position's largest value) and by arithmetic order, so a position
whose largest deviation exceeds `BOUNDARY_TOLERANCE` of its largest value, or a log-prob beyond
`LOGPROB_TOLERANCE`, is that stage's doing. An honest stage given corrupted inputs computes correctly
on them, so blame belongs to the first stage whose check fails, never to a later honest one.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass

import torch

from decentrl.algo.logprobs import logprobs_from_logits
from decentrl.model.boundary_codec import decode
from decentrl.model.stages import Stage
from decentrl.protocol import StageTrace
from decentrl.stage_wire import bytes_per_token, sampled_values

BOUNDARY_TOLERANCE = {"float32": 1e-3, "bfloat16": 0.02, "int8": 0.02}
"""Largest |answered - recomputed| over a position, relative to that position's largest value.
The codec's own rounding is <= 2^-8 = 0.0039 (bfloat16, int8); measured on honest demo runs:
docs/pipeline.md. A corruption below this is a perturbation smaller than the codec's own."""
LOGPROB_TOLERANCE = 0.01
"""The last stage's answered log-prob against the recomputed one on the same inputs (float32)."""


@dataclass
class StageCheck:
    """One stage's check on one model segment."""

    blame: str | None
    """Why this stage's answer is not what it computes; None when it is."""
    logits_nv: torch.Tensor | None = None
    """The last stage's logits at the segment's sampled positions (fp32, CPU), for the rollout's
    log-prob measurement; None on the other stages."""


def hop_hidden(data: str, codec: str, hidden_size: int, width: int, steps: int) -> torch.Tensor:
    """A hop's hidden states of the first `steps` steps (the prefill's `width` positions, then one
    per step), as [1, width + steps - 1, D]: each step was encoded on its own (int8 has a scale
    block per encoding), so each is decoded on its own."""
    raw, size = base64.b64decode(data), bytes_per_token(codec, hidden_size)
    pieces, offset = [], 0
    for positions in [width] + [1] * (steps - 1):
        pieces.append(decode(raw[offset : offset + positions * size], codec, (1, positions, hidden_size)))
        offset += positions * size
    return torch.cat(pieces, dim=1)


def deviation(answered_td: torch.Tensor, recomputed_td: torch.Tensor) -> float:
    """The largest |answered - recomputed| of any position, relative to its largest value."""
    scale_t = recomputed_td.abs().amax(-1).clamp(min=1e-6)
    return float(((answered_td - recomputed_td).abs().amax(-1) / scale_t).max())


@torch.no_grad()
def check_stage(
    stage: Stage, trace: StageTrace, context: list[int], tokens: list[int], temperature: float, pad: int
) -> StageCheck:
    """Stage `stage.stage` of the route that generated `tokens` after `context`, checked on its own
    committed inputs (`stage` holds the claimed version's weights)."""
    width, length, steps = trace.width, trace.prompt_length, len(tokens)
    mask_t = torch.tensor([[0] * (width - length) + [1] * (length + steps - 1)])
    position_t = (mask_t.cumsum(-1) - 1).clamp(min=0)
    real = mask_t[0].bool()
    hidden_size = int(stage.config.hidden_size)
    tolerance = BOUNDARY_TOLERANCE[trace.codec]
    index = stage.stage
    if stage.is_first:
        ids_t = [pad] * (width - length) + context[-length:] + tokens[:-1]
        output = stage.forward(torch.tensor([ids_t]), mask_t, position_t, None)
        answered = hop_hidden(trace.hops[0].inputs, trace.codec, hidden_size, width, steps)
    else:
        hop = trace.hops[index - 1]
        received = hop_hidden(hop.inputs, trace.codec, hidden_size, width, steps)
        output = stage.forward(received, mask_t, position_t, None, logits_to_keep=0)
        if stage.is_last:
            logits_nv = output[0, width - 1 : width - 1 + steps].float().cpu()
            recomputed = logprobs_from_logits(logits_nv, torch.tensor(tokens), temperature)
            sampled = sampled_values(base64.b64decode(hop.outputs))[:steps]
            claimed = torch.tensor([logprob for _, logprob in sampled], dtype=torch.float64)
            error = float((claimed - recomputed.double()).abs().max())
            if error > LOGPROB_TOLERANCE:
                return StageCheck(
                    f"stage {index}'s log-probs err by {error:.3g} (> {LOGPROB_TOLERANCE:g})", logits_nv
                )
            return StageCheck(None, logits_nv)
        answered = hop_hidden(hop.outputs, trace.codec, hidden_size, width, steps)
    found = deviation(answered[0, real], output[0, real])
    if found > tolerance:
        return StageCheck(f"stage {index}'s answer deviates by {found:.3g} of its scale (> {tolerance:g})")
    return StageCheck(None)
