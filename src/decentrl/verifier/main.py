"""The verifier role: a trusted process that checks a sampled fraction of accepted rollouts.

It takes jobs from the coordinator (`POST /v1/verifier/jobs`, trainer token), reconstructs the
claimed policy version with the workers' own verified fetch path (`policy_state`), recomputes the
log-probs and the plausibility statistics (`recompute.measure`), recomputes the same tokens under
the version before the claimed one (`recompute.compare_previous`, the version test) and posts what
it measured. The
coordinator judges; the verifier holds no state worth keeping, so it may crash and restart at will
(a job it took and never answered is handed out again).
"""

from __future__ import annotations

import logging
import signal
import tempfile
import threading
import time
from collections import OrderedDict
from pathlib import Path

import torch

from decentrl.client import CoordinatorClient, CoordinatorUnavailable
from decentrl.model import adapters
from decentrl.model.precision import Precision
from decentrl.model.special import read_pad_token_id
from decentrl.model.vision import PixelInputs, drawn_images, policy_from_config
from decentrl.monitor.reporting import Every
from decentrl.protocol import DeclaredDtype, Verdict, VerdictBatch, VerifyJob, VerifyJobsRequest
from decentrl.verifier import stage_blame
from decentrl.verifier.recompute import Measurement, compare_previous, measure
from decentrl.weights.chunks import ChunkStore
from decentrl.weights.signing import parse_public_key
from decentrl.weights.sync import WeightSync, fetch_state
from decentrl.weights.transfer import ChunkFetcher

log = logging.getLogger(__name__)

CACHED_VERSIONS = 4
"""Reconstructed states kept: the versions stale rollouts claim, and the ones before them."""
JOBS_PER_REQUEST = 64
IDLE_SECONDS = 0.2


def policy_state(
    client: CoordinatorClient, version: int, cache: Path, sync: WeightSync | None = None
) -> dict[str, torch.Tensor]:
    """The verified weights of `version`: the one place the verifier gets a version's state. With
    `sync` (a mirror kept between calls) a newer version costs only the deltas since the one held;
    an older one is rebuilt by a route of its own over the same chunk cache. The result is a copy:
    the mirror's tensors change in place with its next version."""
    if sync is None:
        public_key = client.info().trainer_public_key
        if public_key is None:
            raise RuntimeError(
                "the trainer has not registered its public key yet; no version can be verified"
            )
        return fetch_state(client, version, parse_public_key(public_key), cache)
    if sync.version is not None and version < sync.version:
        sync = WeightSync(client, sync.public_key, sync.fetcher)
    sync.sync_to(version)
    return {name: tensor.clone() for name, tensor in sync.state.items()}


class Verifier:
    def __init__(
        self,
        client: CoordinatorClient,
        model_dir: Path,
        cache_dir: Path,
        precision: Precision,
        num_threads: int = 1,
    ):
        torch.set_num_threads(num_threads)
        self.client = client
        self.cache_dir = cache_dir
        # The trainer's device and dtype (trainer.device / trainer.dtype): a verifier recomputes
        # what the trainer would.
        model = policy_from_config(model_dir, precision.dtype)
        self.model = model.to(precision.device).eval()  # pyright: ignore[reportArgumentType]
        self.pad_token_id = read_pad_token_id(model_dir)
        # sent with every request: a bf16 recomputation is judged with bf16's tolerance (trust/logprob_tolerance.py)
        self.dtype_name: DeclaredDtype = "bfloat16" if precision.dtype == torch.bfloat16 else "float32"
        self.version: int | None = None
        self.states: OrderedDict[int, dict[str, torch.Tensor]] = OrderedDict()
        self.compute_seconds = 0.0
        self.num_verdicts = 0
        self.sync: WeightSync | None = None
        """The newest version reconstructed, advanced by deltas (one HTTP client for all fetches)."""
        self.prepared = False
        """The latest version was taken ahead of the first job (`prepare`)."""
        self.pixels = PixelInputs.from_model_dir(model_dir)
        """A vision-language policy's image processor; None for a text policy."""
        self.env = None
        """The run's environment, loaded with the first job that has images (it draws them)."""

    def vision(self, jobs: list[VerifyJob]):
        """The pixel inputs of `jobs`' images, drawn again from their tasks' seeds (None: no image)."""
        if self.pixels is None or not any(job.images for job in jobs):
            return None
        if self.env is None:
            from decentrl.config import TaskConfig
            from decentrl.envs import environment_from_config

            self.env = environment_from_config(TaskConfig.model_validate(self.client.info().sections["task"]))
        return self.pixels.vision_inputs([drawn_images(self.env, job.seed, job.images) for job in jobs])

    def mirror(self) -> WeightSync | None:
        """The verifier's mirror, made once the trainer's key is known (it checks every manifest)."""
        if self.sync is None:
            key = self.client.info().trainer_public_key
            if key is None:
                return None
            fetcher = ChunkFetcher(self.client, ChunkStore(self.cache_dir, durable=False))
            self.sync = WeightSync(self.client, parse_public_key(key), fetcher)
        return self.sync

    def close(self) -> None:
        if self.sync is not None:
            self.sync.fetcher.close()

    def _load(self, version: int) -> None:
        if self.version == version:
            return
        if version not in self.states:
            mirror = self.mirror()
            if mirror is None:
                raise RuntimeError(
                    "the trainer has not registered its public key yet; no version can be verified"
                )
            self.states[version] = policy_state(self.client, version, self.cache_dir, mirror)
            while len(self.states) > CACHED_VERSIONS:
                self.states.popitem(last=False)
        self.states.move_to_end(version)
        # LoRA adapters unmerged, as the hf engine serves them: merged into a bf16 weight, a small
        # update would round back to the base (model/adapters.py)
        adapters.serve(self.model, self.states[version])
        self.model.load_state_dict(self.states[version], strict=False)
        self.version = version

    def check(self, jobs: list[VerifyJob]) -> VerdictBatch:
        """Measure every job under each version its tokens claim, and under the version before."""
        results: dict[str, Measurement] = {}
        unverifiable: dict[str, str] = {}
        blamed: dict[str, tuple[int, str] | None] = {}
        versions = sorted({v for job in jobs for s in job.segments for v in s.policy_versions or []})
        compute = 0.0
        for version in versions:
            claiming = [j for j in jobs if any(version in (s.policy_versions or []) for s in j.segments)]
            try:
                self._load(version)
            except Exception as exc:  # pruned or unreachable version: report, never guess
                log.warning("cannot reconstruct v%d: %s", version, exc)
                unverifiable.update({job.rollout_id: f"version {version} unavailable" for job in claiming})
                continue
            started = time.perf_counter()
            compared = measure(self.model, claiming, version, results, self.vision(claiming))
            for job in claiming:
                if job.stage_traces is not None and job.stage_map is not None:
                    blamed[job.rollout_id] = stage_blame.blame(
                        stage_blame.stages_over(self.model, job.stage_map), job, self.pad_token_id
                    )
            compute += time.perf_counter() - started
            if compared is None or version == 0:
                continue
            try:
                self._load(version - 1)
            except Exception as exc:  # pruned: the version test has no evidence, the rest stands
                log.info("no version test against v%d: %s", version - 1, exc)
                continue
            started = time.perf_counter()
            compare_previous(self.model, compared, results)
            compute += time.perf_counter() - started
        verdicts = []
        for job in jobs:
            found = results.get(job.rollout_id, Measurement())
            blame = blamed.get(job.rollout_id)
            verdicts.append(
                Verdict(
                    rollout_id=job.rollout_id,
                    num_tokens=found.num_tokens,
                    max_logprob_error=found.max_logprob_error,
                    mean_logprob_error=found.mean_logprob_error,
                    logprob_tokens=found.logprob_tokens,
                    error_log_evidence=found.error_log_evidence,
                    pit_sums=found.pit_sums,
                    version_tokens=found.version_tokens,
                    version_log_evidence=found.version_log_evidence,
                    unverifiable=unverifiable.get(job.rollout_id),
                    blame_stage=None if blame is None else blame[0],
                    blame_detail=None if blame is None else blame[1][:200],
                )
            )
        return VerdictBatch(verdicts=verdicts, compute_seconds=compute, dtype=self.dtype_name)

    def run_once(self) -> int:
        """Verify one batch of jobs; returns how many there were."""
        jobs = self.client.verify_jobs(
            VerifyJobsRequest(max_jobs=JOBS_PER_REQUEST, dtype=self.dtype_name)
        ).jobs
        if not jobs:
            return 0
        batch = self.check(jobs)
        self.client.post_verdicts(batch)
        self.compute_seconds += batch.compute_seconds
        self.num_verdicts += len(jobs)
        return len(jobs)

    def prepare(self) -> None:
        """Idle before its first job: take the latest published version now. A group waits for
        its verdicts before it can train, so the first verdicts must not also wait for a whole
        version's download, as they would if the verifier started with them."""
        latest = self.client.latest_weights()
        if latest is None or self.mirror() is None:
            return
        self.prepared = True
        try:
            self._load(latest.version)
        except Exception as exc:  # noqa: BLE001 - the jobs name the versions they need: loaded then
            log.warning("could not load v%d ahead of the jobs: %s", latest.version, exc)

    def run(self, stop: threading.Event) -> int:
        status_due = Every()
        while not stop.is_set():
            if status_due():
                log.info(
                    "status: %d verdicts, %.2fs of compute, holding v%s",
                    self.num_verdicts,
                    self.compute_seconds,
                    self.version,
                )
            if self.run_once() == 0:
                if self.version is None and not self.prepared:
                    self.prepare()
                stop.wait(IDLE_SECONDS)
        log.info("stopped: %d verdicts, %.2fs of compute", self.num_verdicts, self.compute_seconds)
        return 0


def main_verifier(url: str, token: str, model_dir: Path, precision: Precision, num_threads: int = 1) -> int:
    """CLI entry: verify until SIGTERM/SIGINT."""
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    with CoordinatorClient(url, token, interrupt=stop) as client, tempfile.TemporaryDirectory() as cache:
        try:
            verifier = Verifier(client, model_dir, Path(cache), precision, num_threads)
            try:
                return verifier.run(stop)
            finally:
                verifier.close()
        except CoordinatorUnavailable as exc:
            log.warning("stopping without an answer from the coordinator: %s", exc)
            return 0 if stop.is_set() else 1
