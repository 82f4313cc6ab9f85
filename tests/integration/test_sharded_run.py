"""A run no participant holds, trainer included, as real processes on loopback: coordinator
(`weights.store = "peers"`), 2 stage trainers (one torchrun rank per stage), 2 drivers of stage 0
and 2 holders of stage 1 (`model.num_stages = 2` over the tiny 2-layer model, rank-2 LoRA).

No process allocates or stores the whole model: each worker's and each stage trainer's own
record of what it allocated is one stage, their checkpoints and chunk stores hold one stage, and
the coordinator's run directory holds no chunk. A stage trainer SIGKILLed mid-run takes its group
down; the restarted group resumes every stage at one version, versions stay contiguous, every
batch is acked once, by the version it trained, and no accepted rollout is lost.
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest
from safetensors import safe_open
from test_distributed_trainer import rank_pids
from test_loop import db_rows, wait_until
from test_pipeline import WORKERS, model_dir, staged_config, start_staged_run  # noqa: F401 - a fixture

from decentrl.config import ConfigError
from decentrl.release.signature import load_signing_key
from decentrl.stage_map import LAYER, StageMap
from decentrl.trainer.stage_model import published_name
from decentrl.trainer.stage_training import MATERIALISED_FILE
from decentrl.weights.manifest import Manifest
from decentrl.worker.stage_holder import MATERIALISED_FILE as HOLDER_RECORD

pytestmark = pytest.mark.integration

STAGE_TRAINERS = ("trainer.pipeline_stages=2", "weights.store=peers")


def sharded_config(run_dir: Path, *overrides: str) -> Path:
    return staged_config(run_dir, *STAGE_TRAINERS, *overrides)


def stage_manifests(run_dir: Path) -> list[Manifest]:
    return [
        Manifest.model_validate_json(p.read_bytes())
        for p in (run_dir / "weights" / "manifests").glob("*.json")
    ]


def test_no_process_holds_or_stores_the_whole_model(tmp_path, model_dir):  # noqa: F811
    config = sharded_config(tmp_path, "trainer.num_steps=3")
    roles, endpoint = start_staged_run(tmp_path, model_dir, config)
    trainer = roles[1]
    try:
        wait_until(lambda: not trainer.alive(), "the stage trainers to finish 3 versions", roles, timeout=400)
        assert trainer.process.returncode == 0, trainer.log_path.read_text()[-3000:]
        coordinator_maps = Path(f"/proc/{roles[0].process.pid}/maps").read_text()
    finally:
        for role in reversed(roles):
            role.stop()
    stage_map = StageMap.even(2, 2, tied_embeddings=True)
    manifests = stage_manifests(tmp_path)
    assert {m.stage for m in manifests} == {0, 1} and max(m.version for m in manifests) == 3
    every = {tensor.name for m in manifests for tensor in m.tensors}
    assert len([name for name in every if name.endswith((".lora_A", ".lora_B"))]) == 2 * 2 * 7
    held = {name: set((tmp_path / name / HOLDER_RECORD).read_text().split()) for name in WORKERS}
    for stage in (0, 1):
        directory = tmp_path / "trainer" / f"stage-{stage}"
        held[f"trainer-{stage}"] = set((directory / MATERIALISED_FILE).read_text().split())
        # What it stored: its checkpoints and its chunks, its stage's only.
        for checkpoint in directory.glob("v*/stage.safetensors"):
            with safe_open(str(checkpoint), framework="pt") as handle:
                names = {published_name(key) for key in handle.keys()}  # noqa: SIM118 - not a dict
            assert names == set(stage_map.names(stage, every)), (
                stage,
                sorted(names ^ set(stage_map.names(stage, every)))[:4],
            )
        own = {c.sha256 for m in manifests if m.stage == stage for c in m.chunks}
        stored = {path.name for path in (directory / "chunks").rglob("*") if path.is_file()}
        assert stored and stored <= own
    for who, names in held.items():
        stage = int(who.split("-")[0][-1]) if who.startswith("stage") else int(who[-1])
        assert names == set(stage_map.names(stage, every)), who
        layers = {int(match.group(1)) for match in map(LAYER.match, names) if match}
        assert layers == set(stage_map.layers(stage)) and names != every, who
    assert set().union(*held.values()) == every  # together they are the model
    # The coordinator stored no chunk and never opened a weights file.
    assert [p for p in (tmp_path / "weights").rglob("*") if p.is_file() and "chunks" in p.parts] == []
    assert ".safetensors" not in coordinator_maps
    assert db_rows(tmp_path, "SELECT COUNT(*) FROM rollouts")[0][0] > 0
    check_release(tmp_path, config)


def check_release(run_dir: Path, config_path: Path) -> None:
    """`decentrl export` of the run needs every stage trainer's key and chunks; `decentrl
    verify-release` checks each stage's signature, key and chain, and refuses a release that a
    stage trainer did not sign or that one of them signed for another's stage."""
    from decentrl.config.load import load_config
    from decentrl.release.export import export_run
    from decentrl.release.provenance import ReleaseInvalid
    from decentrl.release.signature import fingerprint, sign
    from decentrl.release.verify import verify_release

    config = load_config(str(config_path), [])
    out = run_dir / "export"
    facts, _ = export_run(config, run_dir, out, evaluate=False)
    assert facts.stages is not None and [s.stage for s in facts.stages] == [0, 1]
    keys = [s.public_key for s in facts.stages]
    assert verify_release(out, [fingerprint(key) for key in keys]).version == 3
    card = (out / "README.md").read_text()
    assert all(
        f"stage {s} (layers {s}-{s}): trained and signed by stage trainer key `{keys[s]}`" in card
        for s in (0, 1)
    )
    with pytest.raises(ReleaseInvalid, match="pins"):
        verify_release(out, [fingerprint(keys[0])])
    signature = out / "provenance" / "stage-1.sig"
    original = signature.read_text()
    stage_0_key = load_signing_key(run_dir / "trainer" / "stage-0" / "signing_key.pem", keys[0])
    signature.write_text(sign((out / "provenance" / "provenance.json").read_bytes(), stage_0_key))
    with pytest.raises(ReleaseInvalid, match="not signed by the key"):
        verify_release(out)
    signature.unlink()
    with pytest.raises(ReleaseInvalid, match="stage 1's trainer did not sign"):
        verify_release(out)
    signature.write_text(original)
    # Without stage 1's trainer's key there is no release.
    key_file = run_dir / "trainer" / "stage-1" / "signing_key.pem"
    key_file.rename(key_file.with_suffix(".away"))
    with pytest.raises(ConfigError, match="signing_key.pem does not exist"):
        export_run(config, run_dir, run_dir / "export-2", evaluate=False)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_sigkilled_stage_trainer_resumes_every_stage_at_one_version(tmp_path, model_dir):  # noqa: F811
    config = sharded_config(tmp_path, "trainer.num_steps=8", "trainer.max_restarts=1")
    roles, endpoint = start_staged_run(tmp_path, model_dir, config)
    trainer = roles[1]
    try:
        wait_until(
            lambda: len(db_rows(tmp_path, "SELECT version FROM weights")) >= 3, "version 2", roles, 400
        )
        wait_until(lambda: len(rank_pids(trainer)) == 2, "two stage trainers", roles)
        accepted_before = {row[0] for row in db_rows(tmp_path, "SELECT rollout_id FROM rollouts")}
        os.kill(rank_pids(trainer)[-1], signal.SIGKILL)  # the last stage's trainer
        killed_at = max(row[0] for row in db_rows(tmp_path, "SELECT version FROM weights"))
        wait_until(lambda: not trainer.alive(), "the restarted stage trainers to finish", roles, timeout=600)
        log = trainer.log_path.read_text()
        assert trainer.process.returncode == 0, log[-3000:]
        accepted_after = {row[0] for row in db_rows(tmp_path, "SELECT rollout_id FROM rollouts")}
    finally:
        for role in reversed(roles):
            role.stop()
    # Both stages resumed, at one version, the one the run had reached (or the next, if every
    # stage had checkpointed it before the kill).
    resumed = {
        int(rank): int(version) for rank, version in re.findall(r"rank (\d) resumed at version (\d+)", log)
    }
    assert sorted(resumed) == [0, 1] and len(set(resumed.values())) == 1, log[-3000:]
    assert killed_at <= resumed[0] <= killed_at + 1
    versions = sorted(row[0] for row in db_rows(tmp_path, "SELECT version FROM weights"))
    assert versions == list(range(9)), versions  # contiguous: nothing skipped or published twice
    batches = db_rows(tmp_path, "SELECT batch_id, state, acked_version FROM batches ORDER BY seq")
    assert [(state, acked) for _, state, acked in batches] == [("acked", v) for v in range(1, 9)]
    trained = re.findall(r"v(\d+) from batch (\S+):", log)
    for batch_id in {b for _, b in trained}:  # retrained only if its version never reached every checkpoint
        assert len({v for v, b in trained if b == batch_id}) == 1, (batch_id, trained)
    assert accepted_before <= accepted_after  # no accepted rollout lost
    manifests = stage_manifests(tmp_path)
    for version in range(9):  # every version is every stage's
        assert {m.stage for m in manifests if m.version == version} in ({0, 1}, set())
