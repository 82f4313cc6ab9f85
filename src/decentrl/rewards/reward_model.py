"""A scalar reward model: a Hugging Face `*ForSequenceClassification` with one label, in batches.

The input is the problem's prompt text followed by the answer and the end-of-sequence token (so
"12+16=2" and "12+16=28" differ in their last token), and the score is the head's logit at the
last non-padding token, as `transformers` computes it for sequence classification. Trained by
`rewards/train_rm.py`; served by the trusted `decentrl scorer` role (`scorer/main.py`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer, PreTrainedModel

from decentrl.config import ConfigError
from decentrl.engines.hf import pick_device


def rm_text(prompt: str, answer: str, eos_token: str) -> str:
    """What the reward model reads for one (prompt, answer): the one place this is decided."""
    return f"{prompt}{answer}{eos_token}"


def load_reward_model(model_dir: str | Path, num_labels: int = 1) -> tuple[PreTrainedModel, Any]:
    """A sequence-classification model from `model_dir`: a trained reward model, or a causal LM
    whose body starts a new one (its head is then freshly initialised)."""
    if not (Path(model_dir) / "config.json").is_file():
        raise ConfigError(
            f"{model_dir} is not a model directory (no config.json): pass one that `decentrl train-rm "
            "--out` wrote, or a Hugging Face model directory"
        )
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(
        model_dir, num_labels=num_labels, dtype=torch.float32
    )
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def batch_scores(model: PreTrainedModel, tokenizer, texts: list[str], device: torch.device) -> torch.Tensor:
    """Logits of `texts` (shape [len(texts)]), with gradients when the caller wants them."""
    encoded = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    encoded = {key: value.to(device) for key, value in encoded.items()}
    return model(**encoded).logits[:, 0].float()


class RewardModel:
    def __init__(
        self, model_dir: str | Path, device: str = "auto", batch_size: int = 64, num_threads: int = 1
    ):
        torch.set_num_threads(num_threads)
        self.device = pick_device(device)
        self.model, self.tokenizer = load_reward_model(model_dir)
        # transformers wraps `to` in a decorator that pyright reads as an unbound function
        self.model.to(self.device).eval()  # pyright: ignore[reportArgumentType]
        self.batch_size = batch_size

    @torch.no_grad()
    def score(self, prompts: list[str], answers: list[str]) -> list[float]:
        texts = [rm_text(p, a, self.tokenizer.eos_token) for p, a in zip(prompts, answers, strict=True)]
        scores: list[float] = []
        for start in range(0, len(texts), self.batch_size):
            scores += batch_scores(
                self.model, self.tokenizer, texts[start : start + self.batch_size], self.device
            ).tolist()
        return scores
