"""The scorer role: a trusted process that scores rollouts with a reward model, in batches.

Like the verifier it holds the trainer token, takes jobs from the coordinator
(`POST /v1/scorer/jobs`: a rollout id, the rubric term, the prompt and the decoded answer),
scores a whole batch in one forward pass of a `*ForSequenceClassification` model and posts the
scores (`POST /v1/scorer/scores`). The coordinator combines them with the rubric's other terms;
a job taken and never answered is handed out again, so a scorer may crash and restart at will.
Runs on CUDA when present, else CPU.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from pathlib import Path

from decentrl.client import CoordinatorClient, CoordinatorUnavailable
from decentrl.protocol import ScoreJobsRequest, TermScore, TermScoreBatch
from decentrl.rewards.reward_model import RewardModel

log = logging.getLogger(__name__)
IDLE_SECONDS = 0.2


class Scorer:
    def __init__(
        self,
        client: CoordinatorClient,
        model: RewardModel,
        term: str | None = None,
        jobs_per_request: int = 64,
    ) -> None:
        self.client = client
        self.model = model
        self.term = term
        self.jobs_per_request = jobs_per_request
        self.num_scored = 0
        self.compute_seconds = 0.0

    def run_once(self) -> int:
        """Score one batch of jobs; returns how many there were."""
        jobs = self.client.score_jobs(ScoreJobsRequest(max_jobs=self.jobs_per_request, term=self.term)).jobs
        if not jobs:
            return 0
        started = time.perf_counter()
        values = self.model.score([job.prompt for job in jobs], [job.answer for job in jobs])
        compute = time.perf_counter() - started
        scores = [
            TermScore(rollout_id=j.rollout_id, term=j.term, value=v)
            for j, v in zip(jobs, values, strict=True)
        ]
        self.client.post_scores(TermScoreBatch(scores=scores, compute_seconds=compute))
        self.num_scored += len(jobs)
        self.compute_seconds += compute
        return len(jobs)

    def run(self, stop: threading.Event) -> int:
        while not stop.is_set():
            if self.run_once() == 0:
                stop.wait(IDLE_SECONDS)
        log.info("stopped: %d scores, %.2fs of compute", self.num_scored, self.compute_seconds)
        return 0


def main_scorer(
    url: str, token: str, model_dir: Path, term: str | None = None, device: str = "auto", num_threads: int = 1
) -> int:
    """CLI entry: score until SIGTERM/SIGINT."""
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    model = RewardModel(model_dir, device=device, num_threads=num_threads)
    log.info("reward model %s on %s", model_dir, model.device)
    with CoordinatorClient(url, token, interrupt=stop) as client:
        try:
            return Scorer(client, model, term).run(stop)
        except CoordinatorUnavailable as exc:
            log.warning("stopping without an answer from the coordinator: %s", exc)
            return 0 if stop.is_set() else 1
