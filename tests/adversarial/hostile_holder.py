"""A stage holder that corrupts what it answers: `python hostile_holder.py KIND <worker arguments>`.

Run as its own process by `test_stage_attacks.py`, as a hostile participant would run it: the real
`decentrl worker --stage S` with its server swapped for one that commits to wrong answers
(`KIND`: `hidden` scales its hidden states by 1.1, `token` answers another token than it sampled,
`logprob` claims each sampled token 0.3 nats likelier).
"""

from __future__ import annotations

import sys

import torch

from decentrl.cli import main
from decentrl.worker import stage_holder
from decentrl.worker.stage_server import Session, StageServer


class ScaledHidden(StageServer):
    def _answer(self, request, session: Session, output: torch.Tensor) -> bytes:  # noqa: ANN001
        return super()._answer(request, session, output * 1.1)


class SwappedToken(StageServer):
    def sample(self, session: Session, logits_bv: torch.Tensor) -> tuple[list[int], list[float]]:
        tokens, logprobs = super().sample(session, logits_bv)
        return [(token + 1) % logits_bv.shape[-1] for token in tokens], logprobs


class InflatedLogprob(StageServer):
    def sample(self, session: Session, logits_bv: torch.Tensor) -> tuple[list[int], list[float]]:
        tokens, logprobs = super().sample(session, logits_bv)
        return tokens, [min(0.0, logprob + 0.3) for logprob in logprobs]


KINDS = {"hidden": ScaledHidden, "token": SwappedToken, "logprob": InflatedLogprob}

if __name__ == "__main__":
    stage_holder.StageServer = KINDS[sys.argv[1]]  # this process's holder serves through it
    sys.exit(main(sys.argv[2:]))
