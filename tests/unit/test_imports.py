"""The light core stays light: config, protocol, client and the coordinator import without torch."""

from __future__ import annotations

import subprocess
import sys


def test_coordinator_and_client_import_without_torch() -> None:
    code = (
        "import sys\n"
        "import decentrl.cli, decentrl.client, decentrl.config, decentrl.protocol\n"
        "import decentrl.coordinator.http.app, decentrl.coordinator.server\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'safetensors') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_demo_launcher_and_trainer_import_without_ray() -> None:
    """Ray is an optional extra: only `decentrl launch ray` imports it."""
    code = (
        "import sys\n"
        "import decentrl.cli, decentrl.launch.local, decentrl.launch.ray, decentrl.launch.torchrun\n"
        "import decentrl.trainer.loop, decentrl.trainer.sharded_checkpoint\n"
        "assert 'ray' not in sys.modules\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
