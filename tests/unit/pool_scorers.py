"""Scorers the pool tests start in fresh processes (importable by name, as `spawn` needs)."""

from __future__ import annotations

import os
import time


def echo_scorer():
    return lambda job: job


def misbehaving_scorer():
    """Behaves by the job: 'sleep:S' sleeps, 'crash' dies, 'big:N' returns N bytes, 'raise'
    raises, 'alloc' allocates 4 GiB, anything else is echoed."""

    def score(job: str):
        if job.startswith("sleep:"):
            time.sleep(float(job.split(":")[1]))
            return "slept"
        if job == "crash":
            os._exit(3)
        if job.startswith("big:"):
            return "x" * int(job.split(":")[1])
        if job == "raise":
            raise ValueError("bad sample")
        if job == "alloc":
            return len(bytearray(4 << 30))
        return job

    return score


def failing_factory():
    raise RuntimeError("no judge endpoint configured")
