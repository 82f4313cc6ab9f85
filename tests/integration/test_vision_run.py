"""A vision-language policy end to end: `decentrl demo --config configs/vision.toml` (the tiny
LLaVA on `shape_color`) warm-starts, runs workers, a verifier and the trainer on image + text
prompts, exports, and the export loads with plain `transformers` (model and processor) and passes
`decentrl verify-release`.

The short run (CI) shrinks the model and trains 3 versions; the full run (slow) must raise held-out
accuracy by at least 15 points.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from demo_support import run_demo

pytestmark = pytest.mark.integration

CONFIG = Path(__file__).parents[2] / "configs" / "vision.toml"


def decentrl(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, "-m", "decentrl", *args], capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done


def test_a_vision_language_run_trains_verifies_and_exports(tmp_path: Path) -> None:
    summary = run_demo(
        tmp_path,
        "model.hidden_size=64",
        "model.num_heads=2",
        "model.intermediate_size=128",
        "sft.steps=10",
        "trainer.num_steps=3",
        "trainer.groups_per_step=4",
        "trainer.eval_every=0",
        "task.eval_size=16",
        "demo.num_workers=1",
        config=CONFIG,
        timeout=600,  # 44-55 s in CI; a hung role shows its log (demo_support.role_logs)
    )
    assert summary["num_policy_versions"] == 3
    assert summary["num_rollouts_accepted"] >= 3 * 4 * 8 and summary["num_rollouts_rejected"] == 0
    run = tmp_path / "run"
    with sqlite3.connect(run / "coordinator.db") as db:
        payload = json.loads(db.execute("SELECT payload FROM rollouts LIMIT 1").fetchone()[0])
        verdicts = [
            json.loads(v) for (v,) in db.execute("SELECT verdict FROM verify_jobs WHERE verdict IS NOT NULL")
        ]
        quarantined = db.execute("SELECT COUNT(*) FROM reputation WHERE quarantined IS NOT NULL").fetchone()[
            0
        ]
    assert len(payload["images"]) == 1 and payload["images"][0]["source"] == "task"
    # the verifier recomputed the workers' tokens with the task's pixels: the same log-probs
    assert verdicts and max(v["max_logprob_error"] for v in verdicts) < 1e-4 and quarantined == 0

    check_inspector_shows_images(run)
    export = Path(summary["export_dir"])
    assert "ok:" in decentrl("verify-release", str(export)).stdout
    check_export_loads(export)
    evaluated = decentrl(
        "eval", str(export), "--config", str(CONFIG), "--set", "task.eval_size=8", "--samples", "0"
    )
    report = json.loads(evaluated.stdout.strip().splitlines()[-1])
    assert report["env"] == "shape_color" and report["num_problems"] == 8


def check_inspector_shows_images(run: Path) -> None:
    """The dashboard's rollout inspector gives each rollout's images beside its tokens: PNGs of
    exactly the pixels the rollout names."""
    import base64
    import io

    from PIL import Image

    from decentrl.envs import load_environment
    from decentrl.envs.images import image_sha256
    from decentrl.monitor.inspector import rollout_detail
    from decentrl.weights.run_dir import read_only

    env = load_environment("shape_color")
    with read_only(run) as db:
        (rollout_id,) = db.execute("SELECT rollout_id FROM rollouts LIMIT 1").fetchone()
        detail = rollout_detail(db, rollout_id, str, lambda seed: env.problem(seed, "train").images)
    assert detail is not None and detail["tokens"] and len(detail["images"]) == 1
    shown = detail["images"][0]
    png = base64.b64decode(shown["png"].removeprefix("data:image/png;base64,"))
    picture = Image.open(io.BytesIO(png)).convert("RGB")
    assert image_sha256(*picture.size, picture.tobytes()) == shown["sha256"]


def check_export_loads(export: Path) -> None:
    """Plain `transformers` loads the model and the processor, and the processor makes the
    coordinator's prompt ids of a problem, id for id."""
    code = f"""
from transformers import AutoModelForImageTextToText, AutoProcessor
from decentrl.envs import load_environment
from decentrl.envs.chat import ChatFormat
from decentrl.model.special import read_eos_token_ids
from pathlib import Path
directory = Path({str(export)!r})
model = AutoModelForImageTextToText.from_pretrained(directory)
processor = AutoProcessor.from_pretrained(directory)
problem = load_environment("shape_color").problem(0, "eval")
text = processor.apply_chat_template([dict(m) for m in problem.prompt], add_generation_prompt=True, tokenize=False)
inputs = processor(images=[problem.images[0].to_pil()], text=[text], return_tensors="pt")
chat = ChatFormat.from_model_dir(directory, read_eos_token_ids(directory))
assert inputs["input_ids"][0].tolist() == chat.prompt_ids(problem.prompt)
logits = model(**inputs).logits
print(type(model).__name__, type(processor).__name__, tuple(logits.shape))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("LlavaForConditionalGeneration LlavaProcessor")


@pytest.mark.slow
def test_the_vision_demo_improves_held_out_accuracy(tmp_path: Path) -> None:
    summary = run_demo(tmp_path, config=CONFIG, timeout=3 * 3600)
    gain = summary["eval_after"] - summary["eval_before"]
    assert gain >= 0.15, summary
    assert summary["num_rollouts_rejected"] <= 0.001 * summary["num_rollouts_accepted"], summary
