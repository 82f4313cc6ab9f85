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
HIDDEN = ModelConfig().hidden_size
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


@pytest.mark.parametrize(
    "num_stages", [2, pytest.param(3, marks=pytest.mark.slow)]
)  # CI time: K = 3 in test-all
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
        # float32 hidden states and gradients cross each boundary: 4 bytes x 128 per position,
        # plus the micro-batches' padding
        for direction in ("forward", "backward"):
            per_token = reported[f"boundary_{direction}_bytes_per_token"]
            assert 4 * HIDDEN <= per_token <= 1.5 * 4 * HIDDEN, (direction, per_token)
        # Each rank allocated its own stage's parameters and no other's.
        for stage in range(num_stages):
            held = Path(f"{out}.lora{lora_rank}.{stage}.names").read_text().split("\n")
            published = {published_name(name) for name in held}
            foreign = [name for name in published if stage not in stage_map.stages_of(name)]
            assert not foreign and published < set(reference), (stage, foreign[:3])


def test_a_bfloat16_boundary_halves_the_bytes_and_keeps_the_update(tmp_path: Path, model_dir: Path) -> None:
    """bfloat16 is the lossy-safe boundary codec for training: a differentiable cast, so hidden
    states go one way and their gradients the other in half the bytes, and the update is the
    one-process one up to bfloat16's rounding (measured: cosine 0.9996 full-parameter, 0.9994
    LoRA; a few elements whose gradient is near zero take AdamW's step the other way)."""
    settings = (*SETTINGS, "trainer.boundary_codec=bfloat16")
    out = tmp_path / "stages"
    run_stages(2, model_dir, out, "0", *settings)
    reference, _ = one_process(0, NUM_LAYERS, settings)
    start = initial(0, NUM_LAYERS)
    pipelined = stage_states(out, 0, 2)
    moved_ref = torch.cat([(reference[n] - start[n]).flatten() for n in sorted(reference)])
    moved = torch.cat([(pipelined[n] - start[n]).flatten() for n in sorted(reference)])
    assert float(torch.nn.functional.cosine_similarity(moved_ref, moved, dim=0)) > 0.999
    assert not torch.equal(moved_ref, moved)  # it is lossy
    reported = json.loads(Path(f"{out}.lora0.metrics.json").read_text())
    for direction in ("forward", "backward"):
        per_token = reported[f"boundary_{direction}_bytes_per_token"]
        assert 2 * HIDDEN <= per_token <= 1.5 * 2 * HIDDEN, (direction, per_token)
