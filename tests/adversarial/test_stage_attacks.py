"""A stage holder that corrupts its stage's answers, in a real staged run: caught and blamed on
its own stage, while the honest holder of that stage and the driver keep their standing.

Coordinator, trainer and verifier as processes on loopback; one driver (stage 0); an honest holder
and a hostile one (`hostile_holder.py`, the real worker with a corrupting server) of stage 1. The
model is the tiny one with a sharpened output (it samples confidently, as a trained model does),
so that a swapped token shows in its log-prob."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from integration.test_loop import db_rows, start_system, start_trainer, wait_until, write_config

from decentrl.config import ModelConfig, RunConfig
from decentrl.launch.local import Role, with_loopback_peers
from decentrl.model.tiny import build_tiny, save_model_dir
from decentrl.verifier.main import JOBS_PER_REQUEST

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
HOSTILE = Path(__file__).parent / "hostile_holder.py"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    model, tokenizer = build_tiny(ModelConfig())
    with torch.no_grad():
        model.model.norm.weight.mul_(30.0)
    return save_model_dir(model, tokenizer, tmp_path_factory.mktemp("model"))


def quarantined(run_dir: Path) -> dict[str, str]:
    rows = db_rows(
        run_dir,
        "SELECT w.name, q.reason FROM reputation q JOIN workers w ON w.worker_id = q.worker_id"
        " WHERE q.quarantined IS NOT NULL",
    )
    return dict(rows)


@pytest.mark.slow  # about 35 s each; tests/unit/test_stage_blame.py covers the blame on real holders in CI
@pytest.mark.parametrize(
    ("kind", "stage_trainers"),
    [
        ("hidden", False),
        ("token", False),
        ("logprob", False),
        ("hidden", True),
        ("logprob", True),
    ],
    ids=["hidden", "token", "logprob", "hidden-stage-trainers", "logprob-stage-trainers"],
)
def test_a_corrupting_holder_is_quarantined_with_blame_on_its_stage(
    tmp_path: Path, model_dir: Path, kind: str, stage_trainers: bool
):
    """With `stage_trainers`, no verifier and no whole model anywhere: 2 stage trainers verify,
    each recomputing its own stage on what it committed to (trainer/stage_verification.py)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    path = write_config(
        run_dir,
        "model.num_stages=2",
        # Long enough that a hostile holder slow to start (a loaded machine) still gets routes
        # before the run ends; the test stops every role three versions after the quarantine.
        "trainer.num_steps=400",
        "trainer.eval_every=0",
        "trust.verify_fraction=0.5",
        *(["trainer.pipeline_stages=2"] if stage_trainers else []),
    )
    path.write_text(with_loopback_peers(RunConfig.model_validate_json(path.read_text())).model_dump_json())
    coordinator, endpoint = start_system(run_dir, model_dir, path)
    roles = [coordinator, start_trainer(run_dir, model_dir, path, endpoint)]
    common = ["--config", str(path), "--coordinator", endpoint["url"]]
    verifier = ["verifier", *common, f"--token={endpoint['trainer_token']}", "--model-dir", str(model_dir)]
    if not stage_trainers:
        roles.append(Role("verifier", verifier, run_dir))
    enroll = [f"--token={endpoint['enroll_token']}"]
    for name, stage in (("driver", 0), ("honest", 1)):
        args = [
            "worker",
            *common,
            *enroll,
            "--name",
            name,
            "--state-dir",
            str(run_dir / name),
            "--stage",
            str(stage),
        ]
        roles.append(Role(name, args, run_dir))
    hostile_args = [
        "worker",
        *common,
        *enroll,
        "--name",
        "hostile",
        "--state-dir",
        str(run_dir / "hostile"),
        "--stage",
        "1",
    ]
    log = open(run_dir / "logs" / "hostile.log", "ab")  # noqa: SIM115 - closed below
    hostile = subprocess.Popen(
        [sys.executable, str(HOSTILE), kind, *hostile_args], stdout=log, stderr=subprocess.STDOUT
    )
    try:
        wait_until(
            lambda: "hostile" in quarantined(run_dir), "the hostile holder's quarantine", roles, timeout=200
        )
        reasons = [
            reason
            for (reason,) in db_rows(
                run_dir,
                "SELECT e.reason FROM events e JOIN workers w ON w.worker_id = e.worker_id"
                " WHERE e.kind = 'verified' AND w.name = 'hostile'",
            )
        ]
        assert reasons and all("stage 1" in reason for reason in reasons), reasons
        assert set(quarantined(run_dir)) == {"hostile"}  # neither the driver nor the honest holder
        # Caught at its first verified rollouts (one verdict batch); the leases routed through it
        # meanwhile (verification runs behind generation) lose their untrained rollouts with it.
        # (8 or fewer on a quiet machine; a verifier with a backlog takes up to JOBS_PER_REQUEST
        # jobs at once, and every failed verdict of that batch lands before the quarantine: 16 at load 21)
        assert len(reasons) <= JOBS_PER_REQUEST, f"{len(reasons)} failed verdicts before the quarantine"
        discarded = db_rows(
            run_dir,
            "SELECT e.reason FROM events e JOIN workers w ON w.worker_id = e.worker_id"
            " WHERE e.kind = 'discarded' AND w.name = 'hostile'",
        )
        assert discarded, "the rollouts routed through the hostile holder were not discarded"
        published = db_rows(run_dir, "SELECT MAX(version) FROM weights")[0][0]
        # the run goes on through the honest holder
        wait_until(
            lambda: db_rows(run_dir, "SELECT MAX(version) FROM weights")[0][0] >= published + 3,
            "three more versions after the quarantine",
            roles,
            timeout=120,
        )
    finally:
        hostile.terminate()
        hostile.wait(30)
        log.close()
        for role in reversed(roles):
            role.stop()
