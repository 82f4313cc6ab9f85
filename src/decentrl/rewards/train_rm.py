"""`decentrl train-rm`: Bradley–Terry training of a reward model on generated preference pairs.

The preference set is made here for a task the project can judge: for each problem, the gold
answer is *chosen* and a wrong answer the environment's own reward rejects is *rejected*: half of
the time a near miss (a zero-padded answer, one digit changed, a digit dropped or added, the sign
flipped), half of the time another number (random of the same length, or off by 1 to 10). Pairs come
from the train split; accuracy is measured on pairs from the held-out split, which share no
problem with them. The loss is the Bradley–Terry negative log-likelihood
-log sigmoid(r(chosen) - r(rejected)) (Bradley & Terry 1952; Ouyang et al. 2022, eq. 1). The
model starts from a causal LM's body (by default the run's warm start, which already reads the
task) with a fresh one-logit head.
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from decentrl.config import ConfigError
from decentrl.envs.base import Environment, Problem, Split
from decentrl.rewards.reward_model import batch_scores, load_reward_model, rm_text

log = logging.getLogger(__name__)
DIGITS = "0123456789"


@dataclass(frozen=True)
class Pair:
    prompt: str
    chosen: str
    rejected: str


def near_misses(answer: str, rng: random.Random) -> list[str]:
    """Plausible wrong versions of `answer`."""
    misses = [f"0{answer}", answer[1:] if answer.startswith("-") else f"-{answer}"]
    if len(answer) > 1:
        cut = rng.randrange(len(answer))
        misses.append(answer[:cut] + answer[cut + 1 :])
    index = rng.randrange(len(answer))
    if answer[index] in DIGITS:
        misses.append(answer[:index] + rng.choice(DIGITS.replace(answer[index], "")) + answer[index + 1 :])
    misses.append(answer + rng.choice(DIGITS))
    return misses


def other_answers(answer: str, rng: random.Random) -> list[str]:
    """Wrong answers that look nothing like `answer` in its digits: a number of the same length,
    and the answer off by a little. A model trained on near misses alone learns the shape of
    the gold answer next to its near misses (trained so, it ranked "98" above a near miss of
    "109" for 51+58, and RL against it learnt to answer 98); these make it check the value."""
    if not answer.lstrip("-").isdigit():
        return []
    value = int(answer)
    width = len(answer.lstrip("-"))
    low = 0 if width == 1 else 10 ** (width - 1)
    return [str(rng.randrange(low, 10**width)), str(value + rng.choice([-1, 1]) * rng.randint(1, 10))]


def preference_pairs(env: Environment, split: Split, count: int, seed: int = 0) -> list[Pair]:
    """`count` pairs from problems of `split`: the gold answer over a wrong answer the env scores
    0, half of them near misses and half other answers (`other_answers`)."""
    rng = random.Random(f"preferences:{split}:{seed}")
    score = getattr(env, "score", None)  # single-turn environments only: not part of Environment
    if score is None:
        raise ValueError(f"environment {env.name!r} has no score(); reward-model pairs need one")
    pairs: list[Pair] = []
    problem_seed = 0
    while len(pairs) < count:
        problem: Problem = env.problem(problem_seed, split)
        problem_seed += 1
        if not isinstance(problem.prompt, str) or score(problem, problem.answer) != 1.0:
            continue
        near = near_misses(problem.answer, rng)
        candidates = near if rng.random() < 0.5 else other_answers(problem.answer, rng) or near
        misses = [m for m in candidates if m and score(problem, m) == 0.0]
        if misses:
            pairs.append(Pair(problem.prompt, problem.answer, rng.choice(misses)))
    return pairs


def pairwise_accuracy(model, tokenizer, pairs: list[Pair], batch_size: int = 256) -> float:
    """Fraction of pairs in which the model scores the chosen answer above the rejected one."""
    model.eval()
    eos = tokenizer.eos_token
    wins = 0
    with torch.no_grad():
        for start in range(0, len(pairs), batch_size):
            chunk = pairs[start : start + batch_size]
            chosen = batch_scores(
                model, tokenizer, [rm_text(p.prompt, p.chosen, eos) for p in chunk], model.device
            )
            rejected = batch_scores(
                model, tokenizer, [rm_text(p.prompt, p.rejected, eos) for p in chunk], model.device
            )
            wins += int((chosen > rejected).sum())
    return wins / len(pairs)


def train_reward_model(
    env: Environment,
    init_dir: Path,
    out_dir: Path,
    steps: int = 300,
    batch_size: int = 32,
    lr: float = 1e-4,
    num_train_pairs: int = 4096,
    num_eval_pairs: int = 512,
    seed: int = 0,
) -> dict:
    """Train, save to `out_dir` (a HF directory the scorer loads) and return the report."""
    if not 0 < batch_size <= num_train_pairs:
        raise ConfigError(f"--batch-size {batch_size} must be between 1 and --pairs ({num_train_pairs})")
    torch.manual_seed(seed)
    model, tokenizer = load_reward_model(init_dir)
    train = preference_pairs(env, "train", num_train_pairs, seed)
    held_out = preference_pairs(env, "eval", num_eval_pairs, seed)
    before = pairwise_accuracy(model, tokenizer, held_out)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    rng = random.Random(seed)
    eos = tokenizer.eos_token
    losses = []
    for step in range(steps):
        model.train()
        chunk = rng.sample(train, batch_size)
        texts = [rm_text(p.prompt, p.chosen, eos) for p in chunk] + [
            rm_text(p.prompt, p.rejected, eos) for p in chunk
        ]
        scores = batch_scores(model, tokenizer, texts, model.device)
        loss = -torch.nn.functional.logsigmoid(scores[:batch_size] - scores[batch_size:]).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        if step % 50 == 0:
            log.info("train-rm step %d loss %.4f", step, loss.item())
    report = {
        "heldout_pairs": len(held_out),
        "heldout_accuracy_before": before,
        "heldout_accuracy": pairwise_accuracy(model, tokenizer, held_out),
        "train_accuracy": pairwise_accuracy(model, tokenizer, train[:num_eval_pairs]),
        "final_loss": sum(losses[-20:]) / min(len(losses), 20),
        "steps": steps,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    (out_dir / "train_rm.json").write_text(json.dumps(report, indent=2))
    return report
