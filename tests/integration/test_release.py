"""Release of the short demo's run (the `short_demo` fixture, conftest.py): the exported model
loads in plain `transformers` and reproduces the demo's final held-out accuracy; `decentrl eval`
reproduces the demo's before/after numbers; `decentrl verify-release` accepts the export and
catches tampering (every forgery: test_release_forgery.py); `--push-to-hub` fails clearly when the Hub is unreachable (nothing contacts a
hub: HF_HUB_OFFLINE is set and the endpoint points at a closed local port)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from decentrl.config import load_config
from decentrl.envs import environment_from_config
from decentrl.release.signature import fingerprint
from decentrl.release.verify import ReleaseInvalid, verify_release

pytestmark = pytest.mark.integration
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9"}

# Runs with `decentrl` made unimportable: only transformers reads the directory.
PLAIN_TRANSFORMERS = r"""
import json, sys
sys.modules["decentrl"] = None
from transformers import AutoModelForCausalLM, AutoTokenizer
directory, problems_path, out_path, max_new_tokens = sys.argv[1:5]
model = AutoModelForCausalLM.from_pretrained(directory).eval()
tokenizer = AutoTokenizer.from_pretrained(directory)
eos = model.generation_config.eos_token_id
eos = set(eos if isinstance(eos, list) else [eos])
answers = []
for prompt in json.load(open(problems_path)):
    if isinstance(prompt, str):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
    else:
        ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, return_tensors="pt", return_dict=True).input_ids
    new = model.generate(ids, max_new_tokens=int(max_new_tokens), do_sample=False)[0, ids.shape[1]:].tolist()
    if new and new[-1] in eos:
        new = new[:-1]
    answers.append(tokenizer.decode(new, skip_special_tokens=False))
json.dump(answers, open(out_path, "w"))
"""


def decentrl(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "decentrl", *args], capture_output=True, text=True, timeout=timeout, env=ENV
    )


def test_export_loads_in_plain_transformers_and_reproduces_the_demo_accuracy(short_demo, tmp_path):
    run_dir, summary = short_demo
    export = Path(summary["export_dir"])
    assert summary["export_eval"]["pass@1_greedy"]["value"] == summary["eval_after"]
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "README.md"):
        assert (export / name).is_file(), name
    # a release is for others to read: no file of it is owner-only (the weights were 0600)
    modes = {str(path.relative_to(export)): path.stat().st_mode & 0o777 for path in export.rglob("*")}
    assert all(mode == (0o755 if (export / name).is_dir() else 0o644) for name, mode in modes.items()), modes
    config = load_config(run_dir / "config.json")
    env = environment_from_config(config.task)
    problems = [env.problem(index, "eval") for index in range(config.task.eval_size)]
    prompts = tmp_path / "prompts.json"
    prompts.write_text(
        json.dumps([p.prompt if isinstance(p.prompt, str) else list(p.prompt) for p in problems])
    )
    answers = tmp_path / "answers.json"
    done = subprocess.run(
        [sys.executable, "-c", PLAIN_TRANSFORMERS, str(export), str(prompts), str(answers)]
        + [str(config.coordinator.max_new_tokens)],
        capture_output=True,
        text=True,
        timeout=600,
        env=ENV,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rewards = [
        env.reward(
            problem, [{"role": "user", "content": problem.text}, {"role": "assistant", "content": answer}]
        )
        for problem, answer in zip(problems, json.loads(answers.read_text()), strict=True)
    ]
    assert sum(rewards) / len(rewards) == summary["eval_after"]
    card = (export / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: transformers") and "model-index" in card
    assert json.loads((export / "provenance" / "provenance.json").read_text())["trainer_public_key"] in card


def test_eval_reproduces_the_demo_numbers_and_reports_pass_at_8(short_demo):
    run_dir, summary = short_demo
    after = decentrl("eval", str(run_dir), "--samples", "8")
    assert after.returncode == 0, after.stderr[-3000:]
    report = json.loads(after.stdout.strip().splitlines()[-1])
    assert report["pass@1_greedy"]["value"] == summary["eval_after"]
    assert report["pass@8"]["value"] >= report["pass@1_greedy"]["low"]
    assert f"@v{summary['num_policy_versions']}" in report["source"]
    (warm_start,) = (run_dir.parent / "cache").glob("warmstart-*")
    before = decentrl("eval", str(warm_start), "--config", str(run_dir / "config.json"), "--samples", "0")
    assert before.returncode == 0, before.stderr[-3000:]
    assert (
        json.loads(before.stdout.strip().splitlines()[-1])["pass@1_greedy"]["value"] == summary["eval_before"]
    )


def test_verify_release_accepts_the_export_and_catches_tampering(short_demo, tmp_path):
    from safetensors.torch import load_file, save_file

    export = Path(short_demo[1]["export_dir"])
    done = decentrl("verify-release", str(export))
    assert done.returncode == 0 and done.stdout.startswith("ok:"), done.stdout + done.stderr
    # unpinned, it names the key that signed and how to pin it
    key = json.loads((export / "provenance" / "provenance.json").read_text())["trainer_public_key"]
    key_print = fingerprint(key)
    assert f"signed by trainer key {key} ({key_print})" in done.stdout
    assert "not pinned" in done.stdout and f"--trainer-key {key_print}" in done.stdout

    def tampered(name: str, change) -> Path:
        copy = tmp_path / name.replace("/", "-")
        shutil.copytree(export, copy)
        change(copy)
        return copy

    def nudge(path: Path) -> None:
        tensors = load_file(path)
        first = sorted(tensors)[0]
        tensors[first] = tensors[first].clone()
        tensors[first].view(-1)[0] += 1e-3
        save_file(tensors, path)

    signed = "is not the file the trainer's key signed"
    with pytest.raises(ReleaseInvalid, match=f"model.safetensors {signed}"):
        verify_release(tampered("weights", lambda d: nudge(d / "model.safetensors")))
    with pytest.raises(ReleaseInvalid, match=f"provenance/state.safetensors {signed}"):
        verify_release(tampered("state", lambda d: nudge(d / "provenance" / "state.safetensors")))

    def forge(directory: Path) -> None:
        (manifest,) = sorted((directory / "provenance" / "manifests").glob("*.json"))[-1:]
        body = json.loads(manifest.read_text())
        body["signature"] = ("0" if body["signature"][0] != "0" else "1") + body["signature"][1:]
        manifest.write_text(json.dumps(body))

    with pytest.raises(ReleaseInvalid, match=f"provenance/manifests/v.*json {signed}"):
        verify_release(tampered("signature", forge))


@pytest.mark.slow  # CI time (a second export): `make test-all` runs it
def test_push_to_hub_offline_is_a_clear_error_after_a_complete_export(short_demo, tmp_path):
    run_dir, _ = short_demo
    out = tmp_path / "pushed"
    done = decentrl(
        "export", str(run_dir), "--out", str(out), "--no-eval", "--push-to-hub", "someone/decentrl-demo"
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "cannot push to someone/decentrl-demo" in done.stderr and "Traceback" not in done.stderr
    assert (out / "model.safetensors").is_file() and (out / "README.md").is_file()
    assert decentrl("verify-release", str(out)).returncode == 0
