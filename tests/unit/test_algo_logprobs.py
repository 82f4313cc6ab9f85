"""Log-prob math against numbers worked out by hand, and trainer/engine agreement."""

from __future__ import annotations

import pytest
import torch

from decentrl.algo.logprobs import logprobs_from_logits, sequence_logprobs
from decentrl.config import ModelConfig
from decentrl.engines.hf import HFEngine
from decentrl.model.tiny import build_tiny
from decentrl.protocol import SamplingParams

# ---------------------------------------------------------------- log-probs


def test_logprobs_from_logits_hand_example() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]])
    ids = torch.tensor([2, 0])
    # T=1: logsumexp = 3 + ln(1 + e^-1 + e^-2) = 3 + ln 1.5032147 = 3.4076060
    #   log p(2) = 3 - 3.4076060 = -0.4076060, log p(0) = 1 - 3.4076060 = -2.4076060
    expected_t1 = torch.tensor([-0.4076060, -2.4076060])
    torch.testing.assert_close(logprobs_from_logits(logits, ids, 1.0), expected_t1, atol=1e-6, rtol=0)
    # T=2: logits / 2 = [0.5, 1, 1.5]; logsumexp = 1.5 + ln(1 + e^-0.5 + e^-1) = 1.5 + ln 1.9744101 = 2.1802697
    #   log p(2) = 1.5 - 2.1802697 = -0.6802697, log p(0) = 0.5 - 2.1802697 = -1.6802697
    expected_t2 = torch.tensor([-0.6802697, -1.6802697])
    torch.testing.assert_close(logprobs_from_logits(logits, ids, 2.0), expected_t2, atol=1e-6, rtol=0)
    # temperature 0 (greedy) is scored under the unscaled distribution
    torch.testing.assert_close(logprobs_from_logits(logits, ids, 0.0), expected_t1, atol=1e-6, rtol=0)


@pytest.fixture(scope="module")
def tiny():
    model, tokenizer = build_tiny(ModelConfig())
    return model.eval(), tokenizer


def test_sequence_logprobs_is_aligned_with_the_token_it_scores(tiny) -> None:
    model, tokenizer = tiny
    ids = torch.tensor([tokenizer.encode("12+34=46")])
    with torch.no_grad():
        logprobs, _ = sequence_logprobs(model, ids, torch.ones_like(ids), 1.0)
        logits = model(input_ids=ids).logits[0]
    assert logprobs.shape == ids.shape
    assert logprobs[0, 0].item() == 0.0
    for t in range(1, ids.shape[1]):  # position t holds log p(ids[t] | ids[:t]), from logits at t-1
        expected = torch.log_softmax(logits[t - 1].double(), -1)[ids[0, t]].item()
        assert logprobs[0, t].item() == pytest.approx(expected, abs=1e-5)


def test_sequence_logprobs_matches_engine_sampling_logprobs(tiny) -> None:
    model, tokenizer = tiny
    engine = HFEngine(model, [tokenizer.eos_token_id], tokenizer.pad_token_id, "cpu")
    engine.load_weights(model.state_dict(), 0)
    # different lengths: the engine left-pads the short prompts, the trainer right-pads
    prompts = [tokenizer.encode(text) for text in ("57+68=", "5+6=", "123+4=", "9=")]
    for temperature in (1.0, 0.7):
        sampling = SamplingParams(temperature=temperature, max_new_tokens=6)
        completions = engine.generate(prompts, sampling, seed=0)
        rows = [prompt + c.token_ids for prompt, c in zip(prompts, completions, strict=True)]
        width = max(len(row) for row in rows)
        ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
        attention = torch.zeros_like(ids)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = torch.tensor(row)
            attention[i, : len(row)] = 1
        with torch.no_grad():
            logprobs, _ = sequence_logprobs(model, ids, attention, temperature)
        for i, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
            assert len(completion.logprobs) == len(completion.token_ids) > 0
            assert completion.policy_versions == [0] * len(completion.token_ids)
            trainer_side = logprobs[i, len(prompt) : len(prompt) + len(completion.token_ids)]
            torch.testing.assert_close(trainer_side, torch.tensor(completion.logprobs), atol=1e-5, rtol=0)


def test_chunked_logprobs_match_full_logits_values_and_gradients(tiny) -> None:
    """One position per chunk (checkpointed) gives the numbers and gradients of the whole
    [batch, seq, vocab] logits computed at once."""
    model, tokenizer = tiny
    ids = torch.tensor([tokenizer.encode("12+34=46"), tokenizer.encode("7+8=15<<")])
    attention = torch.ones_like(ids)
    attention[1, -2:] = 0

    def full(model) -> tuple[torch.Tensor, torch.Tensor]:
        logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
        logp = torch.log_softmax(logits / 0.7, -1)
        return logp.gather(-1, ids[:, 1:, None])[..., 0], -(logp.exp() * logp).sum(-1)

    results = []
    for chunked in (True, False):
        model.zero_grad()
        if chunked:
            logprobs, entropy = sequence_logprobs(
                model, ids, attention, 0.7, entropy_grad=True, chunk_elements=1
            )
            logprobs, entropy = logprobs[:, 1:], entropy[:, 1:]
        else:
            logprobs, entropy = full(model)
        (logprobs.sum() + 0.1 * entropy.sum()).backward()
        results.append((logprobs.detach(), entropy.detach(), [p.grad.clone() for p in model.parameters()]))
    (chunk_lp, chunk_ent, chunk_grads), (full_lp, full_ent, full_grads) = results
    torch.testing.assert_close(chunk_lp, full_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(chunk_ent, full_ent, atol=1e-5, rtol=0)
    for a, b in zip(chunk_grads, full_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    model.zero_grad()
