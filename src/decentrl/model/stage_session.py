"""A batch of sequences decoding through pipeline stages, each stage with its own KV cache.

`StageSession` is what a stage holder keeps per batch between two requests: the stage's cache and
the batch's left-padded mask and positions (`engines/sampling.py:LeftPadded`, the `hf` engine's
own), advanced one position a decode step. `generate_through_stages` chains the sessions of every
stage in one process; it is the reference a distributed pipeline is tested against, and it samples
exactly what `HFEngine.generate` samples from the same weights and seed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from decentrl.engines.base import Completion
from decentrl.engines.sampling import LeftPadded, completions, left_pad_ids, sample_loop, sample_next
from decentrl.model import boundary_codec
from decentrl.model.boundary_codec import Codec
from decentrl.model.stages import Stage
from decentrl.protocol import SamplingParams


class StageSession:
    """One batch on one stage: prefill once, then one decode step per new token."""

    def __init__(self, stage: Stage):
        self.stage = stage
        self.cache = stage.new_cache()
        self.padded: LeftPadded | None = None

    def prefill(self, inputs: torch.Tensor, prompt_lengths: Sequence[int]) -> torch.Tensor:
        """The left-padded prompts (ids [B, T] on stage 0, hidden states [B, T, D] after it), whose
        row b ends with its `prompt_lengths[b]` real tokens. Hidden states [B, T, D] out, or the
        last stage's logits [B, 1, V] of each prompt's last position."""
        assert self.padded is None, "a session prefills once"
        self.padded = LeftPadded(prompt_lengths, inputs.shape[1], self.stage.device)
        return self.stage.forward(inputs, self.padded.mask_bt, self.padded.positions_bt, self.cache)

    def decode(self, inputs_b1: torch.Tensor) -> torch.Tensor:
        """One new position per sequence (ids [B, 1] or hidden states [B, 1, D]); its output."""
        assert self.padded is not None, "decode after prefill"
        positions_b1 = self.padded.grow()
        return self.stage.forward(inputs_b1, self.padded.mask_bt, positions_b1, self.cache)

    def sample(
        self, logits_bv: torch.Tensor, temperature: float, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(token [B], log-prob [B]) from the last stage's logits: the `hf` engine's own step."""
        assert self.stage.is_last, "only the last stage has logits to sample from"
        return sample_next(logits_bv, temperature, generator)


def across_boundary(hidden_btd: torch.Tensor, codec: Codec | None) -> torch.Tensor:
    """Hidden states as the next stage receives them: through `codec`'s bytes, or as they are."""
    if codec is None:
        return hidden_btd
    data = boundary_codec.encode(hidden_btd, codec)
    return boundary_codec.decode(data, codec, tuple(hidden_btd.shape)).to(hidden_btd.device)


def generate_through_stages(
    stages: list[Stage],
    prompts: list[list[int]],
    sampling: SamplingParams,
    seed: int,
    eos_token_ids: Sequence[int],
    pad_token_id: int,
    codec: Codec | None = None,
) -> list[Completion]:
    """One completion per prompt, stage 0 to the last and back each token, in this process.
    `codec` passes the hidden states between stages through that wire format (None: exact)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate needs at least one prompt and no empty prompt")
    assert [s.stage for s in stages] == list(range(stages[0].stage_map.num_stages)), (
        "one of each stage, in order"
    )
    versions = {s.policy_version for s in stages}
    if len(versions) != 1:
        raise ValueError(
            f"the stages hold different weight versions {sorted(versions)}; load one version into all"
        )
    sessions = [StageSession(stage) for stage in stages]
    lengths = [len(p) for p in prompts]

    def chain(inputs: torch.Tensor, prefill: bool) -> torch.Tensor:
        out = inputs
        for index, session in enumerate(sessions):
            out = out if index == 0 else across_boundary(out, codec)
            out = session.prefill(out, lengths) if prefill else session.decode(out)
        return out[:, -1]

    generator = torch.Generator(device=stages[-1].device)
    generator.manual_seed(seed)
    logits_bv = chain(left_pad_ids(prompts, pad_token_id), prefill=True)
    tokens, logprobs = sample_loop(
        logits_bv,
        lambda token_b: chain(token_b[:, None], prefill=False),
        sampling,
        generator,
        eos_token_ids,
        pad_token_id,
    )
    return completions(tokens, logprobs, eos_token_ids, versions.pop())
