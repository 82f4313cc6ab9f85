"""The FSDP2 trainer on 2 ranks (gloo, CPU) against the 1-process trainer, and on NCCL with 2 GPUs.

One version on the same batch (4 mini-batches, so 4 AdamW steps, the clip active from the second)
must give the same updated weights whatever the number of ranks: each rank trains on its slice of
every mini-batch under the mini-batch's global counts and FSDP2 sums the gradients. fp32 on both
sides. The gradients differ only in summation order (rank-partial sums, then a reduce-scatter),
~1e-9; AdamW, lr * m / (sqrt(v) + eps) with eps 1e-8, amplifies that on elements whose gradient
is near eps, and the 4 steps compound it (measured: 0.6 % of the elements further apart than
1e-7, the worst 5e-5, while every element moved up to 4e-3). A wrong split, normalisation or
gradient norm moves nearly every element by ~1e-3.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from distributed_support import build_case, one_process_step, published
from processes import cmdline, descendants
from test_loop import db_rows, start_system, start_trainer, start_worker, wait_until, write_config

from decentrl.config import ModelConfig
from decentrl.launch.local import Role
from decentrl.model.tiny import build_tiny, save_model_dir

pytestmark = pytest.mark.integration

SUPPORT = Path(__file__).with_name("distributed_support.py")
CPU = {"CUDA_VISIBLE_DEVICES": ""}
ATOL = 2e-4
"""Largest |2-rank - 1-process| of any updated weight: 5 % of the version's largest move."""
CLOSE = 1e-7
MAX_FRACTION_APART = 0.02
"""Fraction of elements allowed further apart than CLOSE (the near-zero gradients)."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_model_dir(*build_tiny(ModelConfig()), tmp_path_factory.mktemp("model"))


def run_ranks(nproc: int, *args: object, env: dict | None = None) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
        + [str(SUPPORT), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
    )
    assert result.returncode == 0, result.stderr[-4000:]


def assert_same_update(reference: dict[str, torch.Tensor], sharded: dict[str, torch.Tensor]) -> None:
    assert sorted(reference) == sorted(sharded)
    apart_n = {n: (reference[n] - sharded[n].to(reference[n])).abs() for n in reference}
    worst = max(float(a.max()) for a in apart_n.values())
    assert worst <= ATOL, f"2 ranks differ from 1 process by {worst:.2e} > {ATOL:.0e}"
    fraction = sum(int((a > CLOSE).sum()) for a in apart_n.values()) / sum(
        a.numel() for a in apart_n.values()
    )
    assert fraction <= MAX_FRACTION_APART, f"{fraction:.2%} of the weights differ by more than {CLOSE}"


# CI time: the full-parameter case in `make test-all` (the sharded checkpoint test runs it in CI)
@pytest.mark.parametrize(
    "lora_rank", [pytest.param(0, marks=pytest.mark.slow), 2], ids=["full-parameter", "lora"]
)
def test_two_ranks_match_one_process(tmp_path: Path, lora_rank: int) -> None:
    out = tmp_path / "sharded.pt"
    run_ranks(2, out, lora_rank, env=CPU)
    sharded = torch.load(out, weights_only=True)
    reference = one_process_step(lora_rank)
    assert_same_update(reference, sharded)
    initial = published(build_case(lora_rank)[0])
    moved = [n for n in reference if not torch.equal(reference[n], initial[n])]
    # The version trained something (LoRA: only the adapters).
    assert moved and all(n.endswith((".lora_A", ".lora_B")) for n in moved) == (lora_rank > 0), moved[:4]


@pytest.mark.slow  # CI time: `make test-all` runs it
def test_a_batch_too_small_for_its_minibatches_on_every_rank_takes_fewer(tmp_path: Path) -> None:
    """9 sequences asked in 9 mini-batches on 2 ranks (a batch the staleness bound shrank): one
    sequence per mini-batch would leave a rank without a row, so the version takes 4 mini-batches
    (2 + 2 + 2 + 3 rows) and is the 1-process update of 4 mini-batches."""
    assert build_case(0)[3].minibatches_per_version == 4
    out = tmp_path / "sharded.pt"
    run_ranks(2, out, 0, 9, env=CPU)
    assert_same_update(one_process_step(0), torch.load(out, weights_only=True))


@pytest.mark.parametrize(
    "lora_rank", [0, pytest.param(2, marks=pytest.mark.slow)], ids=["full-parameter", "lora"]
)
def test_sharded_checkpoint_of_two_ranks_resumes_on_one(tmp_path: Path, lora_rank: int) -> None:
    run_ranks(2, "checkpoint", tmp_path, "save", lora_rank, env=CPU)
    run_ranks(1, "checkpoint", tmp_path, "load", lora_rank, env=CPU)
    saved, loaded = (torch.load(tmp_path / f"{mode}.pt", weights_only=True) for mode in ("save", "load"))
    assert saved["model"].keys() == loaded["model"].keys()
    for name, tensor in saved["model"].items():
        assert torch.equal(tensor, loaded["model"][name]), name
    # AdamW's moments and step count, resharded from 2 ranks onto 1, bit for bit.
    assert saved["optimizer"].keys() == loaded["optimizer"].keys() and saved["optimizer"]
    for name, moments in saved["optimizer"].items():
        for key, value in moments.items():
            assert torch.equal(value, loaded["optimizer"][name][key]), (name, key)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (NCCL)")
@pytest.mark.parametrize("nproc", [1, 2], ids=["1-gpu", "2-gpus"])
@pytest.mark.parametrize("lora_rank", [0, 2], ids=["full-parameter", "lora"])
def test_ranks_on_nccl_follow_the_fp32_update(tmp_path: Path, nproc: int, lora_rank: int) -> None:
    """bf16 compute with fp32 reduction: not bit-comparable with fp32, so the update's direction is
    compared (cosine similarity of the flattened weight changes)."""
    if torch.cuda.device_count() < nproc:
        pytest.skip(f"needs {nproc} CUDA GPUs")
    out = tmp_path / "sharded.pt"
    run_ranks(nproc, out, lora_rank, env={"CUDA_VISIBLE_DEVICES": ",".join(map(str, range(nproc)))})
    sharded = torch.load(out, weights_only=True)
    reference = one_process_step(lora_rank)
    initial = published(build_case(lora_rank)[0])
    delta_reference = torch.cat([(reference[n] - initial[n]).flatten() for n in sorted(reference)])
    delta_sharded = torch.cat([(sharded[n].float() - initial[n]).flatten() for n in sorted(reference)])
    assert torch.isfinite(delta_sharded).all()
    cosine = float(torch.nn.functional.cosine_similarity(delta_reference, delta_sharded, dim=0))
    print(f"NCCL {nproc} rank(s), lora {lora_rank}: cosine to the fp32 update {cosine:.4f}")
    assert cosine > 0.9, f"the NCCL bf16 update points elsewhere (cosine {cosine:.3f})"


def rank_pids(trainer: Role) -> list[int]:
    """The ranks: processes under the torchrun agent that run `-m decentrl trainer`."""
    return [
        pid
        for pid in descendants(trainer.process.pid)
        if "torch.distributed.run" not in (args := cmdline(pid)) and "trainer" in args
    ]


@pytest.mark.slow
def test_sigkilled_rank_restarts_the_group_from_the_sharded_checkpoint(tmp_path, model_dir):
    config = write_config(tmp_path, "trainer.num_steps=6", "trainer.eval_every=0", "trainer.max_restarts=1")
    coordinator, endpoint = start_system(tmp_path, model_dir, config)
    roles = [coordinator]
    try:
        worker = start_worker("worker", tmp_path, config, endpoint)
        trainer = start_trainer(tmp_path, model_dir, config, endpoint, "--nproc", "2")
        roles += [worker, trainer]
        wait_until(lambda: len(db_rows(tmp_path, "SELECT version FROM weights")) >= 3, "version 2", roles)
        wait_until(lambda: len(rank_pids(trainer)) == 2, "two ranks", roles)
        victim = rank_pids(trainer)[-1]
        os.kill(victim, signal.SIGKILL)
        killed_at = max(row[0] for row in db_rows(tmp_path, "SELECT version FROM weights"))
        wait_until(lambda: not trainer.alive(), "the restarted group to finish", roles, timeout=400)
        log = trainer.log_path.read_text()
        assert trainer.process.returncode == 0, log[-3000:]
        resumed = [int(v) for v in re.findall(r"rank 0 resumed at version (\d+)", log)]
        assert len(resumed) == 1 and killed_at <= resumed[0] <= killed_at + 1, (killed_at, log[-3000:])
        versions = sorted(row[0] for row in db_rows(tmp_path, "SELECT version FROM weights"))
        assert versions == list(range(7)), versions  # contiguous: nothing skipped or published twice
        batches = db_rows(tmp_path, "SELECT batch_id, state, acked_version FROM batches ORDER BY seq")
        assert [(state, acked) for _, state, acked in batches] == [("acked", v) for v in range(1, 7)]
        # A batch trained twice was one whose version never reached the checkpoint (so never
        # acked): both times it produced the same version.
        trained = re.findall(r"v(\d+) from batch (\S+):", log)
        for batch_id in {b for _, b in trained}:
            assert len({v for v, b in trained if b == batch_id}) == 1, (batch_id, trained)
        assert {b for _, b in trained} == {b for b, _, _ in batches}
        assert list((tmp_path / "trainer" / "sharded" / "latest").glob("*.distcp"))
    finally:
        for role in reversed(roles):
            role.stop()


@pytest.mark.slow
def test_two_ranks_evaluate_version_0_and_report_like_one_process(tmp_path, model_dir):
    """`trainer.nproc = 2` reports what the one-process trainer does around its evaluations: v0's
    held-out accuracy before the first update (an evaluation-only step), then every `eval_every`."""
    config = write_config(tmp_path, "trainer.num_steps=2", "trainer.eval_every=2")
    coordinator, endpoint = start_system(tmp_path, model_dir, config)
    roles = [coordinator]
    try:
        roles.append(start_worker("worker", tmp_path, config, endpoint))
        trainer = start_trainer(tmp_path, model_dir, config, endpoint, "--nproc", "2")
        roles.append(trainer)
        wait_until(lambda: not trainer.alive(), "the two-rank trainer to finish", roles, timeout=400)
        assert trainer.process.returncode == 0, trainer.log_path.read_text()[-3000:]
        history = db_rows(tmp_path, "SELECT version, metrics FROM train_metrics ORDER BY version")
    finally:
        for role in reversed(roles):
            role.stop()
    metrics = {version: json.loads(text) for version, text in history}
    assert sorted(metrics) == [0, 1, 2]
    assert set(metrics[0]) == {"eval_accuracy"} and "eval_accuracy" in metrics[2]
    assert "eval_accuracy" not in metrics[1] and metrics[2]["num_ranks"] == 2.0
    assert "v0 held-out accuracy " in trainer.log_path.read_text()
