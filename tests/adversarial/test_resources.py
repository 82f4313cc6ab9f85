"""Disk: a coordinator whose disk runs low says so on `/v1/health` and refuses new work with 507
before SQLite fails, and recovers once space is freed. A real coordinator process; the disk is
"filled" by a real file in its run directory against a floor set just below today's free space.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest

from adversarial.processes import register
from decentrl.protocol import API_PREFIX

pytestmark = pytest.mark.integration

FILL_MB = 256


def free_mb(path: os.PathLike) -> int:
    stat = os.statvfs(path)
    return stat.f_bavail * stat.f_frsize >> 20


def test_low_disk_makes_health_unhealthy_and_new_work_507(start_coordinator, tmp_path) -> None:  # noqa: ANN001
    floor = free_mb(tmp_path) - FILL_MB // 2  # other processes share this disk: keep a wide margin
    coordinator = start_coordinator([f"service.min_free_disk_mb={floor}"])
    client, _ = register(coordinator)
    health = f"{coordinator.url}{API_PREFIX}/health"
    lease = f"{coordinator.url}{API_PREFIX}/leases"
    body = b'{"policy_version": 0, "max_groups": 1}'

    def lease_status() -> int:
        headers = {"Authorization": f"Bearer {client.token}", "Content-Type": "application/json"}
        headers |= client.signer.headers("POST", f"{API_PREFIX}/leases", body)
        return httpx.post(lease, content=body, headers=headers).status_code

    assert httpx.get(health).status_code == 200
    assert lease_status() == 503  # admitted: no version is published yet
    filler = coordinator.run_dir / "filler"
    with open(filler, "wb") as handle:
        os.posix_fallocate(handle.fileno(), 0, FILL_MB << 20)
    try:
        time.sleep(1.2)  # the guard reads the free space at most once a second
        answer = httpx.get(health)
        assert answer.status_code == 503 and answer.json()["status"] == "disk_low", answer.text
        assert lease_status() == 507
    finally:
        filler.unlink()
    time.sleep(1.2)
    assert httpx.get(health).status_code == 200
    client.close()


@pytest.fixture
def read_only_dir(tmp_path):  # noqa: ANN001, ANN201
    """A directory nobody may write: a read-only tmpfs (as root, where permissions do not bind), or
    mode 0555 (as another user)."""
    path = tmp_path / "read-only"
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o555)
        yield path
        path.chmod(0o755)
        return
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro", "tmpfs", str(path)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here: {mounted.stderr.decode().strip()}")
    yield path
    subprocess.run(["umount", str(path)], check=False)


def test_a_read_only_run_directory_is_one_line_naming_the_fix(read_only_dir, tmp_path) -> None:  # noqa: ANN001
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")  # never read: the run directory is checked first
    args = ["coordinator", "--run-dir", str(read_only_dir), "--model-dir", str(model_dir), "--port", "0"]
    done = subprocess.run(
        [sys.executable, "-m", "decentrl", *args], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    error = done.stderr.strip().splitlines()[-1]
    assert error.startswith("decentrl: error: cannot write in the run directory") and "--run-dir" in error
