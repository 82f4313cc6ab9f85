"""decentrl.worker: keeps an engine on the latest weights, leases tasks, submits rollouts."""

from decentrl.worker.main import main_worker, run_worker

__all__ = ["main_worker", "run_worker"]
