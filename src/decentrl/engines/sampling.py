"""Batched sampling shared by every engine that computes its own logits (`hf`, pipeline stages).

A left-padded batch, the sampling of the next token and its log-prob, the loop that stops at EOS
and the cut into `Completion`s live here once, so that the `hf` engine and a chain of pipeline
stages (`model/stage_session.py`) that run the same weights with the same seed sample the same
tokens with the same log-probs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from decentrl.algo.logprobs import logprobs_from_logits
from decentrl.engines.base import Completion
from decentrl.protocol import SamplingParams


def check_prompts(prompts: list[list[int]]) -> None:
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate needs at least one prompt and no empty prompt")


def left_pad_ids(prompts: list[list[int]], pad_token_id: int) -> torch.Tensor:
    """Token ids [B, T] with each prompt right-aligned: every sequence's next token is column T."""
    width = max(len(p) for p in prompts)
    ids_bt = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids_bt[row, width - len(prompt) :] = torch.tensor(prompt)
    return ids_bt


class LeftPadded:
    """The attention mask and positions of a left-padded batch as it grows by one token a step.

    Positions count real tokens only (a pad column is position 0 and masked), so a prompt's
    positions do not depend on the longer prompts it is batched with."""

    def __init__(self, prompt_lengths: Sequence[int], width: int, device: torch.device | str = "cpu"):
        assert prompt_lengths and all(1 <= n <= width for n in prompt_lengths), (prompt_lengths, width)
        self.mask_bt = torch.zeros((len(prompt_lengths), width), dtype=torch.long)
        for row, length in enumerate(prompt_lengths):
            self.mask_bt[row, width - length :] = 1
        self.mask_bt = self.mask_bt.to(device)
        self.positions_bt = (self.mask_bt.cumsum(-1) - 1).clamp(min=0)
        """The prompt's positions [B, T]."""
        self.next_position_b = self.positions_bt[:, -1] + 1

    def grow(self) -> torch.Tensor:
        """Append one real column to the mask; the positions [B, 1] of that column."""
        ones_b1 = torch.ones_like(self.mask_bt[:, :1])
        self.mask_bt = torch.cat([self.mask_bt, ones_b1], 1)
        positions_b1 = self.next_position_b[:, None]
        self.next_position_b = self.next_position_b + 1
        return positions_b1


def sample_next(
    logits_bv: torch.Tensor,
    temperature: float,
    generator: torch.Generator,
    suppressed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token [B], its log-prob [B]): multinomial at `temperature`, argmax at 0, in float32.

    `suppressed` ids (a vision-language model's image token, which only a processor may place)
    are never sampled. The log-prob is still the policy's own, over the whole vocabulary, so the
    trainer and the verifier recompute it exactly; the sampling distribution differs from the
    policy's by the mass of the suppressed ids (log(1 - p) per token, about -p), which a
    warm-started model gives next to none."""
    logits_bv = logits_bv.float()
    scores_bv = logits_bv if suppressed is None else logits_bv.index_fill(-1, suppressed, float("-inf"))
    if temperature > 0:
        probs_bv = torch.softmax(scores_bv / temperature, dim=-1)
        token_b = torch.multinomial(probs_bv, 1, generator=generator).squeeze(-1)
    else:
        token_b = scores_bv.argmax(-1)
    return token_b, logprobs_from_logits(logits_bv, token_b, temperature)


def sample_loop(
    logits_bv: torch.Tensor,
    next_logits: Callable[[torch.Tensor], torch.Tensor],
    sampling: SamplingParams,
    generator: torch.Generator,
    eos_token_ids: Sequence[int],
    pad_token_id: int,
    suppressed_ids: Sequence[int] = (),
) -> tuple[list[list[int]], list[list[float]]]:
    """Tokens and log-probs [B][steps] from the prompt's last logits: `next_logits(token_b)` runs
    the model one position on and gives that position's logits [B, V]. A finished sequence
    samples pad tokens until every sequence has stopped or `max_new_tokens` is reached; no
    sequence samples one of `suppressed_ids` (see `sample_next`)."""
    done_b = torch.zeros(logits_bv.shape[0], dtype=torch.bool, device=logits_bv.device)
    eos_e = torch.tensor(list(eos_token_ids), device=logits_bv.device)
    suppressed = torch.tensor(list(suppressed_ids), device=logits_bv.device) if suppressed_ids else None
    tokens, logprobs = [], []
    for step in range(sampling.max_new_tokens):
        token_b, logprob_b = sample_next(logits_bv, sampling.temperature, generator, suppressed)
        token_b = torch.where(done_b, torch.full_like(token_b, pad_token_id), token_b)
        tokens.append(token_b)
        logprobs.append(logprob_b)
        done_b |= torch.isin(token_b, eos_e)
        if bool(done_b.all()) or step == sampling.max_new_tokens - 1:
            break
        logits_bv = next_logits(token_b)
    return torch.stack(tokens, 1).tolist(), torch.stack(logprobs, 1).tolist()


def completions(
    tokens: list[list[int]], logprobs: list[list[float]], eos_token_ids: Sequence[int], policy_version: int
) -> list[Completion]:
    """Each row cut after its first EOS ("stop"), or whole ("length")."""
    out = []
    for row_tokens, row_logprobs in zip(tokens, logprobs, strict=True):
        stops = [i for i, token in enumerate(row_tokens) if token in eos_token_ids]
        if stops:
            end, reason = stops[0] + 1, "stop"
        else:
            end, reason = len(row_tokens), "length"
        out.append(
            Completion(
                token_ids=row_tokens[:end],
                logprobs=row_logprobs[:end],
                policy_versions=[policy_version] * end,
                finish_reason=reason,
            )
        )
    return out
