"""Per-token log-probabilities: the single definition shared by engines, trainer and verifier.

Log-probs are taken under the temperature-scaled distribution that sampled the token, as verl
and prime-rl compute them: trainer logits are divided by the same temperature as the worker's.
Computed in fp32 with log_softmax, then gathered. A vision-language policy takes its rows' pixel
inputs (`vision`) in the same function: the image tokens' positions get the vision tower's
features, and every later token's log-prob depends on them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.utils.checkpoint


def logprobs_from_logits(logits: torch.Tensor, token_ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """log p(token_ids) from `logits` [..., V]; temperature 0 (greedy) uses the raw distribution."""
    scale = temperature if temperature > 0 else 1.0
    logp = torch.log_softmax(logits.float() / scale, dim=-1)
    return logp.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Entropy of the temperature-scaled distribution, per position."""
    scale = temperature if temperature > 0 else 1.0
    logp = torch.log_softmax(logits.float() / scale, dim=-1)
    return -(logp.exp() * logp).sum(-1)


LOGITS_CHUNK_ELEMENTS = 1 << 25
"""Logit elements (positions x vocabulary) one chunk of `sequence_logprobs` computes at a time:
128 MiB in fp32, so a 150k-token vocabulary costs about 220 positions per chunk, not the batch."""

# Config fields of architectures whose forward transforms the head's output (Gemma 2's soft cap,
# Cohere's and Granite's scales): those go through the model's own forward instead of the head.
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def _token_scores(
    head: torch.nn.Module,
    hidden_bch: torch.Tensor,
    targets_bc: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    entropy_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of `targets_bc` and (optionally) the entropy from one chunk of hidden states."""
    logits_bcv = head(hidden_bch)
    logprobs_bc = logprobs_from_logits(logits_bcv, targets_bc, temperature)
    if not with_entropy:
        return logprobs_bc, torch.zeros_like(logprobs_bc)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy_bc = entropy_from_logits(logits_bcv, temperature)
    return logprobs_bc, entropy_bc


def multimodal_body(model: Any) -> torch.nn.Module:
    """The module of a vision-language model that runs the vision tower, puts its features at the
    image tokens and runs the decoder (LLaVA's `model`), under any `peft` wrapper."""
    if hasattr(model, "multimodal_body"):  # the KL reference of a LoRA run (model/lora.py)
        return model.multimodal_body()
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.model


def _head_and_hidden(
    model: torch.nn.Module,
    input_ids_bt: torch.Tensor,
    attention_mask_bt: torch.Tensor,
    vision: Mapping[str, torch.Tensor] | None = None,
):
    """(head, final hidden states [B, T, H]) of a causal LM whose logits are head(hidden); or
    (identity, logits [B, T, V]) when the architecture post-processes its logits."""
    config = getattr(model, "config", None)
    inputs = {"input_ids": input_ids_bt, "attention_mask": attention_mask_bt, "use_cache": False}
    # An FSDP2-sharded model (trainer.nproc > 1) gathers its root's parameters (embeddings, final
    # norm, head) only in its own forward, so it takes the whole-logits path.
    sharded = type(model).__name__.startswith("FSDP")
    if sharded or any(getattr(config, name, None) not in (None, 1, 1.0) for name in LOGIT_TRANSFORMS):
        return torch.nn.Identity(), model(**inputs, **(vision or {})).logits
    causal: Any = model  # a transformers causal LM; torch.nn.Module does not declare these methods
    decoder = multimodal_body(causal) if vision else causal.get_decoder()
    hidden = decoder(**inputs, **(vision or {}))
    return causal.get_output_embeddings(), hidden.last_hidden_state


def sequence_logprobs(
    model: torch.nn.Module,
    input_ids_bt: torch.Tensor,
    attention_mask_bt: torch.Tensor,
    temperature: float,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    chunk_elements: int = LOGITS_CHUNK_ELEMENTS,
    vision: Mapping[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of each token given its prefix, aligned with `input_ids_bt` (position 0 gets 0).

    Inputs are right-padded, so default position ids are correct for every row. The entropy of
    the distribution at each position (aligned the same way) is differentiable only when
    `entropy_grad` (an entropy bonus needs it; a diagnostic does not). `vision`: a
    vision-language policy's pixel inputs of the rows' images, in row order
    (`model/vision.py:PixelInputs.vision_inputs`).

    The [batch, seq, vocab] logits are never held whole: the decoder's final hidden states go
    through the output head a chunk of positions at a time (about `chunk_elements` logits), and
    under autograd each chunk is checkpointed, so the backward pass recomputes that chunk's
    logits instead of keeping all of them alive (the fp32 log-softmax of a 150k vocabulary is
    0.6 MB per token).
    """
    with_entropy = with_entropy or entropy_grad
    head, hidden_bth = _head_and_hidden(model, input_ids_bt, attention_mask_bt, vision)
    batch, length = input_ids_bt.shape
    vocab = head.out_features if isinstance(head, torch.nn.Linear) else hidden_bth.shape[-1]
    step = max(1, chunk_elements // (batch * vocab))
    logprobs, entropies = [], []
    for start in range(0, length - 1, step):
        end = min(start + step, length - 1)  # the last position predicts nothing
        hidden_bch = hidden_bth[:, start:end]
        targets_bc = input_ids_bt[:, start + 1 : end + 1]
        args = (head, hidden_bch, targets_bc, temperature, with_entropy, entropy_grad)
        if torch.is_grad_enabled() and hidden_bch.requires_grad:
            logprobs_bc, entropy_bc = torch.utils.checkpoint.checkpoint(
                _token_scores, *args, use_reentrant=False
            )
        else:
            logprobs_bc, entropy_bc = _token_scores(*args)
        logprobs.append(logprobs_bc)
        entropies.append(entropy_bc)
    pad = torch.zeros((batch, 1), dtype=torch.float32, device=input_ids_bt.device)
    logprobs_bt = torch.cat([pad, *logprobs], dim=1)
    entropy_bt = torch.cat([pad, *entropies], dim=1) if with_entropy else None
    return logprobs_bt, entropy_bt
