"""Two stage trainers on NCCL, one GPU each (skipped without two CUDA devices): the test of
`tests/integration/test_pipeline_trainer.py` on GPUs.

`pipeline_support.py` runs one version of the tiny model through the pipeline with each rank's
stage on its own GPU (`torch.distributed.pipelining` over NCCL, fp32 parameters), and the update
is compared with the one-process fp32 update on the CPU. GPU and CPU kernels order their sums
differently, so the comparison is the update's direction (cosine of the flattened weight changes)
and its size, not bit for bit; the CPU/gloo test is the bit-exact one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from decentrl.config import ModelConfig
from decentrl.model.tiny import build_tiny, save_model_dir

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices (NCCL)"),
]
INTEGRATION = Path(__file__).parents[1] / "integration"
NUM_LAYERS = 3


@pytest.mark.parametrize("lora_rank", [0, 2], ids=["full-parameter", "lora"])
def test_two_stage_trainers_on_nccl_follow_the_one_process_update(tmp_path: Path, lora_rank: int) -> None:
    sys.path.insert(0, str(INTEGRATION))
    from pipeline_support import initial, one_process, settings_of

    model_dir = save_model_dir(*build_tiny(ModelConfig(num_layers=NUM_LAYERS)), tmp_path / "model")
    settings = settings_of(micro_batch_tokens=16, minibatches=2)
    out = tmp_path / "stages"
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
        + [str(INTEGRATION / "pipeline_support.py"), str(model_dir), str(out), str(NUM_LAYERS), "1f1b"]
        + [str(lora_rank), *settings],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "0,1"},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    reference, metrics = one_process(lora_rank, NUM_LAYERS, settings)
    start = initial(lora_rank, NUM_LAYERS)
    stages = {}
    for stage in range(2):
        stages.update(torch.load(f"{out}.lora{lora_rank}.{stage}.pt", weights_only=True))
    assert sorted(stages) == sorted(reference)
    moved_ref = torch.cat([(reference[n] - start[n]).flatten() for n in sorted(reference)])
    moved = torch.cat([(stages[n].float() - start[n]).flatten() for n in sorted(reference)])
    cosine = float(torch.nn.functional.cosine_similarity(moved_ref, moved, dim=0))
    apart = float((moved_ref - moved).abs().max())
    reported = json.loads(Path(f"{out}.lora{lora_rank}.metrics.json").read_text())
    print(f"NCCL 2 stage trainers, lora {lora_rank}: cosine {cosine:.6f}, max |diff| {apart:.2e}")
    assert torch.isfinite(moved).all() and cosine > 0.999, cosine
    assert reported["loss"] == pytest.approx(metrics["loss"], rel=1e-3, abs=1e-5)
