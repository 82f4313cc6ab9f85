"""`bench weights` names the run's learning-rate schedule as the trainer ran it."""

from benchmarks.weights.main import lr_schedule


def test_the_schedule_in_words() -> None:
    constant = {"lr_warmup_steps": 0, "lr_decay": "constant", "min_lr_ratio": 0.1, "num_steps": 8}
    assert lr_schedule(constant) == "warmup 0 + constant"
    cosine = {"lr_warmup_steps": 5, "lr_decay": "cosine", "min_lr_ratio": 0.1, "num_steps": 60}
    assert lr_schedule(cosine) == "warmup 5 + cosine to 0.1 x lr over 60 steps"
