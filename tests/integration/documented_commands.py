"""Every `decentrl` command the README and docs/*.md show, and where a test runs it.

`documented_commands()` reads the commands from the code of the docs (fenced blocks and inline
code spans); `COMMANDS` holds one entry per command: a `Smoke` run in its shortest form by
`test_documented_commands.py`, or `Elsewhere`, the test that already starts what the command
needs (a coordinator, a second venv, the short demo) and runs it there. The two must name the same
commands, so a newly documented command without a test fails the suite, and so does dropping the
entry of one still documented.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCED = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
INLINE = re.compile(r"`([^`\n]+)`")
# `decentrl WORD [WORD]` after a blank, a slash (.venv-vllm/bin/decentrl) or the start of the code
COMMAND = re.compile(r"(?:^|[\s/(])decentrl\s+([a-z][a-z-]*)(?:[ \t]+([a-z][a-z-]*))?", re.M)


@dataclass(frozen=True)
class Smoke:
    """`decentrl *argv` run here: `{tmp}` is the test's directory, `{model}` a tiny model directory."""

    argv: tuple[str, ...]
    status: int = 0
    expect: str = ""
    """Text the command prints (stdout or stderr); a bench's last stdout line is also JSON."""
    slow: bool = False
    timeout_s: float = 600.0
    """The benches that start from the demo's own warm start (1,500 SFT steps when not cached) take longer."""


@dataclass(frozen=True)
class Elsewhere:
    """The test (`path::name`) that runs the command where what it needs is already started."""

    test: str


TINY = ("--set", "sft.steps=20", "--set", "sft.cache_dir='{tmp}/cache'")
"""A warm start of a few steps, cached in the test's directory."""

COMMANDS: dict[str, Smoke | Elsewhere] = {
    "demo": Elsewhere("tests/integration/test_learning.py::test_short_demo_improves_held_out_accuracy"),
    "coordinator": Elsewhere(
        "tests/integration/test_loop.py::test_versions_advance_and_rollouts_are_trained_on"
    ),
    "trainer": Elsewhere("tests/integration/test_loop.py::test_versions_advance_and_rollouts_are_trained_on"),
    "worker": Elsewhere("tests/integration/test_loop.py::test_versions_advance_and_rollouts_are_trained_on"),
    # the short demo runs a verifier (trust.verify_fraction > 0) as `decentrl verifier`
    "verifier": Elsewhere("tests/integration/test_learning.py::test_short_demo_improves_held_out_accuracy"),
    "scorer": Elsewhere(
        "tests/integration/test_bench_rewards.py::test_reward_model_run_improves_the_checked_held_out_score"
    ),
    "serve": Elsewhere(
        "tests/integration/test_openai_server.py::test_completions_and_chat_carry_token_ids_and_logprobs"
    ),
    "eval": Elsewhere("tests/integration/test_eval.py::test_eval_cli_reports_greedy_pass_at_k_and_avg_at_k"),
    "export": Elsewhere(
        "tests/integration/test_release.py::test_export_loads_in_plain_transformers_and_reproduces_the_demo_accuracy"
    ),
    "verify-release": Elsewhere(
        "tests/integration/test_release.py::test_verify_release_accepts_the_export_and_catches_tampering"
    ),
    "launch": Smoke(("launch", "--help"), expect="ray"),
    "launch ray": Elsewhere(
        "tests/integration/test_launch_ray.py::test_ray_launch_trains_replaces_a_dead_worker_and_leaves_nothing"
    ),
    "config show": Smoke(("config", "show", "--demo", "--section", "trainer"), expect="[trainer]"),
    "warmstart": Smoke(("warmstart", *TINY), expect="warmstart-", slow=True),
    "train-rm": Smoke(
        ("train-rm", "--model-dir", "{model}", "--out", "{tmp}/rm", "--steps", "2", "--pairs", "16")
        + ("--batch-size", "8"),
        expect='"heldout_accuracy"',
    ),
    "train-judge": Smoke(
        ("train-judge", "--out", "{tmp}/judge", "--steps", "2", "--batch-size", "4"),
        expect="accuracy",
        slow=True,
    ),
    # the conversion of the packaged GGUF (about 40 s once, then cached)
    "model import-gguf": Smoke(("model", "import-gguf"), expect="SmolLM2", slow=True),
    "bench": Smoke(("bench", "--help"), expect="coordinator"),
    "bench coordinator": Smoke(
        # the README's rollout lengths (the defaults, 1,000 and 4,000 tokens) with a tiny load
        ("bench", "coordinator", "--workers", "2", "--processes", "1", "--group-size", "2")
        + ("--seconds", "1", "--warmup", "0.5", "--no-service-phases", "--root", "{tmp}/bench"),
        expect='"rollout_tokens": 4000',
        slow=True,  # tests/integration/test_bench_coordinator.py runs the same harness in CI
    ),
    "bench engines": Smoke(
        ("bench", "engines", "--engines", "hf", "--hidden-size", "64", "--num-layers", "1")
        + ("--num-heads", "2", "--intermediate-size", "64", "--new-tokens", "4", "--repeats", "1"),
        expect='"tokens_per_s_256"',
    ),
    "bench sandbox": Smoke(
        ("bench", "sandbox", "--seconds", "0.2", "--skip-attacks")
        + ("--tool-use-set", "sft.steps=20", "--tool-use-set", "sft.cache_dir='{tmp}/cache'")
        + ("--tool-use-set", "trainer.num_steps=2", "--tool-use-set", "trainer.eval_every=0")
        + ("--tool-use-set", "task.eval_size=8", "--tool-use-set", "trainer.eval_size=8"),
        expect='"tool_use_run_dir"',
        slow=True,
    ),
    "bench swarm": Smoke(
        ("bench", "swarm", "--workers", "50", "--sizes", "0.5", "--training", "lora", "--duration", "120"),
        expect='"service_cpu_seconds"',
    ),
    "bench weights": Smoke(
        ("bench", "weights", "--demo-steps", "2", "--demo-set", "sft.steps=20")
        + ("--demo-set", "sft.cache_dir='{tmp}/cache'", "--state-mb", "1", "--skip-fanout"),
        expect='"bit_exact": true',
        slow=True,
        timeout_s=1800.0,
    ),
    "bench staleness": Smoke(
        ("bench", "staleness", "--staleness", "0", "--seeds", "0", "--corrections", "none")
        + ("--num-steps", "2", "--out", "{tmp}/staleness"),
        expect='"cells"',
        slow=True,
        timeout_s=1800.0,
    ),
    "bench adversarial": Smoke(
        ("bench", "adversarial", "--trials", "1", "--honest-workers", "1", "--submissions", "1")
        + (
            "--turncoat-trials",
            "0",
            "--evasion-trials",
            "0",
            "--attempts",
            "1",
            "--no-learning",
            "--no-service",
        ),
        expect="accepted",
        slow=True,
        timeout_s=1800.0,
    ),
    "bench lora": Smoke(("bench", "lora", "--versions", "2", "--lr", "1e-5"), expect='"median_unmerged"'),
    "bench rewards": Elsewhere(
        "tests/integration/test_bench_rewards.py::test_math_run_scored_by_math_verify_improves_held_out"
    ),
    "bench pipeline": Elsewhere(
        "tests/integration/test_bench_pipeline.py::test_the_smallest_bench_pipeline_runs_and_its_figures_add_up"
    ),
    "bench envs": Smoke(
        ("bench", "envs", "--instances", "1", "--seconds", "1", "--kinds", "tool_use")
        + ("--kill-instances", "1", "--kill-every", "0.5", "--rollouts", "5"),
        expect='"replay_us_per_rollout"',
    ),
    "envd": Elsewhere(
        "tests/integration/test_served_loop.py::test_env_instances_killed_at_random_lose_no_accepted_rollout_and_train_no_failed_episode"
    ),
    "replay": Elsewhere(
        "tests/integration/test_served_replay.py::test_a_served_browser_episode_replays_to_the_same_views_and_reward"
    ),
    "bench answers": Elsewhere(
        "tests/unit/test_answers_bench.py::test_the_command_reads_a_run_directory_and_refuses_a_missing_file"
    ),
    "bench wan": Elsewhere(
        "tests/integration/test_bench_wan.py::test_a_tiny_wan_fleet_runs_both_modes_and_its_figures_add_up"
    ),
    "bench throughput": Elsewhere(
        "tests/integration/test_bench_throughput.py::test_the_synchronous_arm_reports_its_measured_rate_and_profile"
    ),
}


def command_key(first: str, second: str | None, nested: dict[str, set[str]]) -> str:
    """`bench coordinator`, `config show`, `launch ray`: the second word when the first command
    takes a sub-command; a plain `decentrl eval runs/r1` is `eval`."""
    return f"{first} {second}" if first in nested and second else first


def documented_commands(nested: dict[str, set[str]]) -> dict[str, set[str]]:
    """Each command shown in the docs' code -> the files that show it."""
    found: dict[str, set[str]] = defaultdict(set)
    for path in DOCS:
        text = path.read_text()
        spans = FENCED.findall(text) + INLINE.findall(FENCED.sub("", text))
        for span in spans:
            for match in COMMAND.finditer(span):
                found[command_key(match[1], match[2], nested)].add(path.relative_to(ROOT).as_posix())
    return dict(found)
