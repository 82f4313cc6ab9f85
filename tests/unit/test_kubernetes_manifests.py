"""deploy/kubernetes: every object valid against the Kubernetes schemas, offline (the
`kubernetes-validate` package bundles them), every Deployment ready only through a probe, and
every container's command one the `decentrl` command line takes, on a config that loads.

This is all that runs in CI: the manifests have not been applied to a real cluster by these tests.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
import yaml

from decentrl.cli import build_parser
from decentrl.config import load_config
from decentrl.envd.api import HEALTH_PATH
from decentrl.protocol import API_PREFIX

kubernetes_validate = pytest.importorskip("kubernetes_validate")
MANIFESTS = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
KUBERNETES = "1.37.0"


def objects() -> list[dict]:
    found = []
    for path in sorted(MANIFESTS.glob("*.yaml")):
        found += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    return found


def deployments() -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects() if o["kind"] == "Deployment"}


def test_every_object_is_valid_against_the_kubernetes_schema_in_strict_mode():
    found = objects()
    assert {o["kind"] for o in found} >= {
        "Deployment",
        "Service",
        "ConfigMap",
        "Secret",
        "PersistentVolumeClaim",
    }
    for obj in found:
        kubernetes_validate.validate(obj, KUBERNETES, strict=True)


def test_a_wrong_field_fails_the_validation():
    broken = deployments()["decentrl-envd"]
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["port"] = [8770]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES, strict=True)


def test_coordinator_env_servers_and_workers_are_deployments_ready_through_a_probe():
    found = deployments()
    assert {"decentrl-coordinator", "decentrl-envd", "decentrl-worker", "decentrl-trainer"} <= set(found)
    probes = {}
    for name, deployment in found.items():
        for container in deployment["spec"]["template"]["spec"]["containers"]:
            assert "readinessProbe" in container, f"{name}/{container['name']} has no readiness probe"
            probes[name] = container["readinessProbe"]
    assert probes["decentrl-coordinator"]["httpGet"]["path"] == f"{API_PREFIX}/health"
    assert probes["decentrl-envd"]["httpGet"]["path"] == HEALTH_PATH


def test_every_container_runs_a_decentrl_command_on_a_config_that_loads(tmp_path):
    config_map = next(o for o in objects() if o["kind"] == "ConfigMap")
    path = tmp_path / "config.toml"
    path.write_text(config_map["data"]["config.toml"])
    tomllib.loads(path.read_text())
    parser = build_parser()
    for name, deployment in deployments().items():
        for container in deployment["spec"]["template"]["spec"]["containers"]:
            argv = [a.replace("/etc/decentrl/config.toml", str(path)) for a in container["args"]]
            args = parser.parse_args(argv)  # argparse exits on an unknown flag or command
            # Kubernetes puts the secret where the manifest says $(NAME): the --set values stay TOML strings.
            overrides = [
                o.replace("$(ENROLL_TOKEN)", "e-1").replace("$(TRAINER_TOKEN)", "t-1") for o in args.overrides
            ]
            config = load_config(str(path), overrides)
            assert config.task.served and config.task.env == "browser", name
            if name == "decentrl-coordinator":
                assert (config.coordinator.enroll_token, config.coordinator.trainer_token) == ("e-1", "t-1")
