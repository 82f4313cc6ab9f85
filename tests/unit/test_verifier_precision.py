"""The verifier and held-out evaluation compute on the trainer's device in the trainer's dtype."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from decentrl.client import CoordinatorClient
from decentrl.config import ModelConfig, load_config
from decentrl.engines.hf import HFEngine
from decentrl.model.precision import Precision
from decentrl.model.tiny import build_tiny
from decentrl.protocol import SamplingParams, Segment, VerifyJob
from decentrl.verifier.main import Verifier
from decentrl.verifier.recompute import Measurement, measure


@pytest.fixture(scope="module")
def sampled(tmp_path_factory: pytest.TempPathFactory):
    """A saved tiny model and eight rollouts an honest fp32 worker sampled from it (version 3)."""
    torch.manual_seed(0)
    model, tokenizer = build_tiny(ModelConfig())
    model_dir = tmp_path_factory.mktemp("tiny")
    model.save_pretrained(model_dir)
    engine = HFEngine(model, [tokenizer.eos_token_id], tokenizer.pad_token_id, "cpu")
    engine.load_weights(model.state_dict(), 3)
    prompts = [tokenizer.encode(text) for text in ("12+3=", "4+56=")]
    completions = engine.generate(
        [p for p in prompts for _ in range(4)], SamplingParams(max_new_tokens=5), seed=1
    )
    jobs = [
        VerifyJob(
            rollout_id=str(i),
            temperature=1.0,
            prompt_token_ids=prompts[i // 4],
            segments=[
                Segment(
                    source="model",
                    token_ids=c.token_ids,
                    logprobs=c.logprobs,
                    policy_versions=c.policy_versions,
                )
            ],
            pit_seed=i,
        )
        for i, c in enumerate(completions)
    ]
    return model, model_dir, jobs


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_verifier_takes_the_trainer_dtype(sampled, tmp_path: Path, dtype: str) -> None:
    model, model_dir, jobs = sampled
    precision = Precision.from_config(
        load_config(None, [f"trainer.dtype={dtype}", "trainer.device=cpu"]).trainer
    )
    assert precision == Precision(torch.device("cpu"), getattr(torch, dtype))
    with CoordinatorClient("http://127.0.0.1:9", "unused") as client:  # never called here
        verifier = Verifier(client, model_dir, tmp_path, precision)
    assert {p.dtype for p in verifier.model.parameters()} == {precision.dtype}
    verifier.model.load_state_dict(model.state_dict())
    results: dict[str, Measurement] = {}
    measure(verifier.model, jobs, 3, results)
    assert len(results) == len(jobs)
    worst = max(m.max_logprob_error for m in results.values())
    if dtype == "float32":
        assert worst < 1e-4  # the fp32 worker's own numbers
    else:
        # bf16 rounding shows (docs/security.md: a bf16 run needs a bf16-sized tolerance), but the
        # recomputation is of the same model, not noise
        assert 1e-4 < worst < 0.5
    assert all(
        m.num_tokens > 0 and all(map(torch.isfinite, torch.tensor(m.pit_sums))) for m in results.values()
    )


def test_evaluation_follows_the_trainer_unless_eval_device_is_set() -> None:
    config = load_config(None, ["trainer.device=cpu", "trainer.dtype=bfloat16"])
    assert Precision.for_evaluation(config) == Precision(torch.device("cpu"), torch.bfloat16)
    config = load_config(None, ["trainer.device=cuda:1", "eval.device=cpu"])
    # dtype auto on the evaluation's device: fp32 on CPU
    assert Precision.for_evaluation(config) == Precision(torch.device("cpu"), torch.float32)
