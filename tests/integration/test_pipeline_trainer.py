"""K stage trainers (one torchrun rank per pipeline stage, gloo on CPU) against the one-process trainer.

One version on the same batch from the same start must give the same weights: each stage runs its
layers on exactly the micro-batch's tensors, the schedules accumulate each stage's gradients in
micro-batch order, the gradient norm is taken over every stage's per-tensor norms in the
one-process order, and the tied embedding's two ends add their parts per micro-batch as autograd
does in one process. The bar is 1e-6 in fp32; on this CPU the update is identical bit for bit.
The micro-batch budget is small, so each mini-batch is several micro-batches in flight (1F1B with
K = 2, and with K = 3 where a pass has at least 3) and 2 mini-batches make the clip active.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pipeline_support import initial, one_process, settings_of

from decentrl.config import ModelConfig
from decentrl.model.tiny import build_tiny, save_model_dir
from decentrl.stage_map import StageMap
from decentrl.trainer.stage_model import published_name

pytestmark = pytest.mark.integration

SUPPORT = Path(__file__).with_name("pipeline_support.py")
NUM_LAYERS = 3
"""The tiny model with 3 decoder layers: 2 + 1 over two stages, 1 + 1 + 1 over three."""
ATOL = 1e-6
SETTINGS = settings_of(micro_batch_tokens=16, minibatches=2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_model_dir(*build_tiny(ModelConfig(num_layers=NUM_LAYERS)), tmp_path_factory.mktemp("model"))


def run_stages(num_stages: int, model_dir: Path, out: Path, lora_ranks: str, *settings: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={num_stages}"]
        + [str(SUPPORT), str(model_dir), str(out), str(NUM_LAYERS), "1f1b", lora_ranks, *settings],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""},
    )
    assert result.returncode == 0, result.stderr[-4000:]


def stage_states(out: Path, lora_rank: int, num_stages: int) -> dict[str, torch.Tensor]:
    """The stages' published tensors together; a tensor two stages hold (the tied embedding) must
    be the same on both."""
    joined: dict[str, torch.Tensor] = {}
    for stage in range(num_stages):
        for name, tensor in torch.load(f"{out}.lora{lora_rank}.{stage}.pt", weights_only=True).items():
            if name in joined:
                assert torch.equal(joined[name], tensor), f"the two ends disagree on {name}"
            joined[name] = tensor
    return joined


@pytest.mark.parametrize("num_stages", [2, 3])
def test_k_stage_trainers_make_the_one_process_update(
    tmp_path: Path, model_dir: Path, num_stages: int
) -> None:
    out = tmp_path / "stages"
    run_stages(num_stages, model_dir, out, "0,2", *SETTINGS)
    stage_map = StageMap.even(NUM_LAYERS, num_stages, tied_embeddings=True)
    for lora_rank in (0, 2):
        reference, metrics = one_process(lora_rank, NUM_LAYERS, SETTINGS)
        pipelined = stage_states(out, lora_rank, num_stages)
        assert sorted(pipelined) == sorted(reference)
        apart = max(float((reference[name] - pipelined[name]).abs().max()) for name in reference)
        assert apart <= ATOL, f"K = {num_stages}, lora {lora_rank}: {apart:.2e} from the one-process update"
        start = initial(lora_rank, NUM_LAYERS)
        moved = [name for name in reference if not torch.equal(reference[name], start[name])]
        assert moved and all(name.endswith((".lora_A", ".lora_B")) for name in moved) == (lora_rank > 0)
        # The version's diagnostics are the one process's too (the last stage computes them).
        reported = json.loads(Path(f"{out}.lora{lora_rank}.metrics.json").read_text())
        for key in ("loss", "grad_norm", "clip_fraction", "entropy", "mismatch_kl", "num_minibatches"):
            assert reported[key] == pytest.approx(metrics[key], rel=1e-6, abs=1e-9), key
        assert reported["num_stages"] == num_stages and metrics["clip_fraction"] > 0
        # Each rank allocated its own stage's parameters and no other's.
        for stage in range(num_stages):
            held = Path(f"{out}.lora{lora_rank}.{stage}.names").read_text().split("\n")
            published = {published_name(name) for name in held}
            foreign = [name for name in published if stage not in stage_map.stages_of(name)]
            assert not foreign and published < set(reference), (stage, foreign[:3])
