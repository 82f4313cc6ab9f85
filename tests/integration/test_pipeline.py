"""A staged run as real processes on loopback: coordinator, trainer, two drivers of stage 0 and
two holders of stage 1 (`model.num_stages = 2` over the tiny 2-layer model, random weights,
rank-2 LoRA as the demo trains).

No worker allocates a tensor of the other stage, yet together they hold the whole model and
generate the rollouts the trainer trains on; a holder SIGKILLed mid-episode costs the leases
routed through it, never an accepted rollout, and the run goes on through the other holder.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest
from test_loop import db_rows, start_system, start_trainer, wait_until, write_config

from decentrl.client import CoordinatorClient
from decentrl.config import ModelConfig, RunConfig
from decentrl.launch.local import Role, with_loopback_peers
from decentrl.model.tiny import build_tiny, save_model_dir
from decentrl.stage_map import LAYER, StageMap
from decentrl.weights.manifest import Manifest
from decentrl.worker.stage_holder import MATERIALISED_FILE

pytestmark = pytest.mark.integration

WORKERS = {"stage0-0": 0, "stage0-1": 0, "stage1-0": 1, "stage1-1": 1}
"""The workers of each run, named as `decentrl demo` names them, and the stage each holds."""
BEHIND_NAT = "stage1-0"
"""This holder opens no port (`worker.stage_listen = false`): its drivers reach it through the
coordinator's relay, while the other holder of its stage takes direct connections."""
EOS_TOKEN_ID = 1  # the tiny model's


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_model_dir(*build_tiny(ModelConfig()), tmp_path_factory.mktemp("model"))


def staged_config(run_dir: Path, *overrides: str) -> Path:
    """The loop tests' short run split into 2 stages, its holders serving on loopback."""
    path = write_config(run_dir, "model.num_stages=2", "lora.rank=2", "trainer.eval_every=0", *overrides)
    config = with_loopback_peers(RunConfig.model_validate_json(path.read_text()))
    path.write_text(config.model_dump_json())
    return path


def start_staged_run(run_dir: Path, model_dir: Path, config: Path) -> tuple[list[Role], dict]:
    """Coordinator, trainer and the four workers of `WORKERS` (the trainer is `roles[1]`)."""
    coordinator, endpoint = start_system(run_dir, model_dir, config)
    roles = [coordinator, start_trainer(run_dir, model_dir, config, endpoint)]
    for name, stage in WORKERS.items():
        args = ["worker", "--config", str(config), "--coordinator", endpoint["url"]]
        args += [f"--token={endpoint['enroll_token']}", "--name", name, "--state-dir", str(run_dir / name)]
        args += ["--stage", str(stage)] + (
            ["--set", "worker.stage_listen=false"] if name == BEHIND_NAT else []
        )
        roles.append(Role(name, args, run_dir))
    return roles, endpoint


def stage_listing(endpoint: dict) -> dict:
    headers = {"Authorization": f"Bearer {endpoint['trainer_token']}"}
    return httpx.get(f"{endpoint['url']}/v1/stages", headers=headers, timeout=10).json()


def worker_ids(run_dir: Path) -> dict[str, str]:
    return {name: worker_id for worker_id, name in db_rows(run_dir, "SELECT worker_id, name FROM workers")}


def worker_ids_when_registered(run_dir: Path, roles: list[Role]) -> dict[str, str]:
    wait_until(lambda: len(worker_ids(run_dir)) == len(WORKERS), "every worker to register", roles)
    return worker_ids(run_dir)


def version_zero(run_dir: Path) -> Manifest:
    """The first published version: a snapshot of every tensor, LoRA adapters included."""
    return Manifest.model_validate_json(
        (run_dir / "weights" / "manifests" / "v00000000.snapshot.json").read_bytes()
    )


def holders_of_accepted_rollouts(run_dir: Path) -> dict[str, int]:
    """Accepted rollouts per stage-1 holder of the route their lease ran through."""
    rows = db_rows(
        run_dir,
        "SELECT r.worker_id, COUNT(*) FROM rollouts o JOIN lease_routes r ON r.lease_id = o.lease_id"
        " WHERE r.stage = 1 GROUP BY r.worker_id",
    )
    return dict(rows)


def incomplete_trained_rollouts(run_dir: Path, max_new_tokens: int) -> list[str]:
    """Trained rollouts whose model turn neither ended with EOS nor ran to `max_new_tokens`."""
    partial = []
    for rollout_id, payload in db_rows(
        run_dir, "SELECT rollout_id, payload FROM rollouts WHERE staleness IS NOT NULL"
    ):
        (model,) = [s["token_ids"] for s in json.loads(payload)["segments"] if s["source"] == "model"]
        if not model or (model[-1] != EOS_TOKEN_ID and len(model) != max_new_tokens):
            partial.append(rollout_id)
    return partial


def test_no_worker_holds_another_stage_and_together_they_hold_the_model(tmp_path, model_dir):
    """... and a holder behind NAT serves its share through the coordinator's relay."""
    config = staged_config(tmp_path, "trainer.num_steps=3")
    roles, endpoint = start_staged_run(tmp_path, model_dir, config)
    trainer = roles[1]
    listed: dict[str, int] = {}
    relayed: dict[str, bool] = {}
    relay: dict = {}
    try:

        def finished() -> bool:
            listing = stage_listing(endpoint)
            listed.update({holder["worker_id"]: holder["stage"] for holder in listing["holders"]})
            relayed.update({holder["worker_id"]: holder["relayed"] for holder in listing["holders"]})
            relay.update(listing["relay"])
            return not trainer.alive()

        wait_until(finished, "the trainer to finish 3 steps", roles)
        assert trainer.process.returncode == 0, trainer.log_path.read_text()[-3000:]
        with CoordinatorClient(endpoint["url"], endpoint["trainer_token"]) as client:
            stats = client.stats()
    finally:
        for role in reversed(roles):
            role.stop()
    ids = worker_ids(tmp_path)
    assert listed == {ids["stage1-0"]: 1, ids["stage1-1"]: 1}  # both holders, and no driver

    manifest = version_zero(tmp_path)
    assert manifest.stage_map == StageMap.even(2, 2, tied_embeddings=True)
    stage_map = manifest.stage_map
    every = {tensor.name for tensor in manifest.tensors}
    assert len([name for name in every if name.endswith((".lora_A", ".lora_B"))]) == 2 * 2 * 7
    held = {name: set((tmp_path / name / MATERIALISED_FILE).read_text().split()) for name in WORKERS}
    for name, stage in WORKERS.items():
        # each allocated exactly its stage's tensors (adapters included: they came with the
        # weights), so none of the other stage's layer
        assert held[name] == set(stage_map.names(stage, every)), name
        layers = {int(match.group(1)) for match in map(LAYER.match, held[name]) if match}
        assert layers == set(stage_map.layers(stage)), (name, layers)
    assert set().union(*held.values()) == every
    assert "model.embed_tokens.weight" in held["stage0-0"] & held["stage1-0"]  # the tied head

    assert stats["latest_version"] == 3 and stats["groups"]["trained"] >= 3 * 4
    # every accepted rollout came through a route, and each holder carried some of them; no hop
    # failed (a holder announcing a version it skipped would have made routes to it fail)
    routed = holders_of_accepted_rollouts(tmp_path)
    # Counted in the stopped run's database: the workers may submit after `stats` was taken.
    (accepted,) = db_rows(tmp_path, "SELECT COUNT(*) FROM rollouts")[0]
    assert set(routed) == {ids["stage1-0"], ids["stage1-1"]} and sum(routed.values()) == accepted
    assert accepted >= stats["rollouts_accepted"]
    assert db_rows(tmp_path, "SELECT reason FROM events WHERE kind = 'stage_hop_failed'") == []
    # each driver timed its hops and sent the timings with a later lease request: the coordinator
    # holds its figure for holders it was routed through (`coordinator/route_latency.py`)
    measured = db_rows(tmp_path, "SELECT driver_id, holder_id, step_ms FROM route_latency")
    assert {driver for driver, _, _ in measured} == {ids["stage0-0"], ids["stage0-1"]}, measured
    assert {holder for _, holder, _ in measured} <= set(routed) and all(ms > 0 for _, _, ms in measured)
    assert incomplete_trained_rollouts(tmp_path, max_new_tokens=6) == []
    assert all(role.process.returncode == 0 for role in roles), [
        (r.name, r.process.returncode) for r in roles
    ]
    # the holder behind NAT announced no address and carried its rollouts through the relay:
    # each a step per token and a close, so at least 7 relayed requests per rollout's lease
    assert relayed == {ids["stage1-0"]: True, ids["stage1-1"]: False}
    nat_url = db_rows(tmp_path, f"SELECT url FROM stage_holders WHERE worker_id = '{ids['stage1-0']}'")
    assert nat_url == [("",)]
    nat_leases = db_rows(
        tmp_path, f"SELECT COUNT(DISTINCT lease_id) FROM lease_routes WHERE worker_id = '{ids['stage1-0']}'"
    )[0][0]
    leases_accepted = -(-routed[ids["stage1-0"]] // 8)  # 2 groups of 4 per lease, at least
    assert relay["relayed_requests"] >= 2 * leases_accepted and relay["failed_requests"] == 0
    assert nat_leases > 0 and relay["relayed_bytes"] > 0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_holder_killed_mid_episode_costs_its_leases_and_no_accepted_rollout(tmp_path, model_dir):
    # 24 new tokens per sequence: a lease is 24 round trips through its holder, so one is on its
    # way through the victim when it dies
    max_new_tokens = 24
    config = staged_config(
        tmp_path,
        "trainer.num_steps=8",
        f"coordinator.max_new_tokens={max_new_tokens}",
        "coordinator.lease_seconds=8.0",
    )
    roles, endpoint = start_staged_run(tmp_path, model_dir, config)
    trainer, victim = roles[1], roles[2 + list(WORKERS).index("stage1-0")]
    accepted_seen = []
    client = CoordinatorClient(endpoint["url"], endpoint["trainer_token"])
    try:
        ids = worker_ids_when_registered(tmp_path, roles)
        victim_id, survivor_id = ids["stage1-0"], ids["stage1-1"]
        through_victim = (
            "SELECT COUNT(*) FROM lease_routes r JOIN leases l ON l.lease_id = r.lease_id"
            f" WHERE r.worker_id = '{victim_id}' AND l.state = 'open'"
        )
        wait_until(
            lambda: db_rows(tmp_path, through_victim)[0][0] > 0 and client.stats()["rollouts_accepted"] > 0,
            "a lease routed through the victim, after some accepted rollouts",
            roles,
        )
        victim.process.kill()
        victim.process.wait()
        killed_at = time.time()
        version_at_kill = client.stats()["latest_version"]
        accepted_before = {row[0] for row in db_rows(tmp_path, "SELECT rollout_id FROM rollouts")}

        def finished() -> bool:
            accepted_seen.append(client.stats()["rollouts_accepted"])
            return not trainer.alive()

        wait_until(finished, "the run to finish without the victim", roles)
        assert trainer.process.returncode == 0, trainer.log_path.read_text()[-3000:]
        stats = client.stats()
    finally:
        client.close()
        for role in reversed(roles):
            role.stop()
    assert stats["latest_version"] == 8 > version_at_kill
    assert accepted_seen == sorted(accepted_seen), "the accepted count went down"
    accepted_after = {row[0] for row in db_rows(tmp_path, "SELECT rollout_id FROM rollouts")}
    assert accepted_before <= accepted_after, "an accepted rollout disappeared"

    # The leases in flight through the victim were given up, each reported by its driver: 1 or 2
    # here (2 in 6 of 7 runs), one per driver that had a lease routed through the victim when it died.
    failed = db_rows(tmp_path, "SELECT worker_id, reason, ts FROM events WHERE kind = 'stage_hop_failed'")
    assert failed and {worker for worker, _, _ in failed} == {victim_id}, failed
    assert all(reason.startswith("unreachable: stage 1 on lease") for _, reason, _ in failed), failed
    given_up = db_rows(
        tmp_path,
        "SELECT COUNT(*) FROM leases l JOIN lease_routes r ON r.lease_id = l.lease_id"
        f" WHERE r.worker_id = '{victim_id}' AND l.state = 'expired'",
    )[0][0]
    assert given_up >= len(failed)
    # Reported down, the dead holder is in no new route (it never announces again, so its outage
    # never ends): the run went on through the survivor.
    reported = min(ts for _, _, ts in failed)
    late_routes = db_rows(
        tmp_path,
        "SELECT DISTINCT r.worker_id FROM leases l JOIN lease_routes r ON r.lease_id = l.lease_id"
        f" WHERE l.created > {reported}",
    )
    assert late_routes == [(survivor_id,)], late_routes
    after_kill = db_rows(tmp_path, f"SELECT COUNT(*) FROM rollouts WHERE accepted > {killed_at}")[0][0]
    assert after_kill > 0
    assert incomplete_trained_rollouts(tmp_path, max_new_tokens) == []
