"""The model card (README.md) of an exported model: YAML metadata the Hub reads, then prose."""

from __future__ import annotations

import json

import yaml

from decentrl.config import SECRET_FIELDS, RunConfig
from decentrl.release.provenance import Provenance


def _metadata(config: RunConfig, facts: Provenance, evaluation: dict | None) -> dict:
    meta: dict = {
        "library_name": "transformers",
        "pipeline_tag": "text-generation",
        "tags": ["decentrl", "reinforcement-learning", config.algorithm.advantage.name, config.task.env],
    }
    if config.model.path:
        meta["base_model"] = config.model.path
    if evaluation is not None:
        metrics = [
            {
                "type": name,
                "name": f"{name} (95 % CI {s['low']:.3f}-{s['high']:.3f})",
                "value": round(s["value"], 4),
            }
            for name, s in evaluation.items()
            if isinstance(s, dict) and "value" in s
        ]
        meta["model-index"] = [
            {
                "name": f"decentrl-{facts.run_id}-v{facts.version}",
                "results": [
                    {
                        "task": {"type": "text-generation"},
                        "dataset": {
                            "name": f"{config.task.env} (held-out split, {evaluation['num_problems']} problems)",
                            "type": f"decentrl/{config.task.env}",
                            "split": "eval",
                        },
                        "metrics": metrics,
                    }
                ],
            }
        ]
    return meta


def model_card(config: RunConfig, facts: Provenance, evaluation: dict | None) -> str:
    counts = facts.counts
    lines = [
        "---",
        yaml.safe_dump(_metadata(config, facts, evaluation), sort_keys=False).strip(),
        "---",
        "",
        f"# decentrl run {facts.run_id}, version {facts.version}",
        "",
        f"Post-trained with asynchronous RL by decentrl on the "
        f"`{config.task.env}` environment ({json.dumps(config.task.args)}), rollouts from "
        f"{counts.workers_contributed} untrusted workers. Load it with plain `transformers`:",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        'model = AutoModelForCausalLM.from_pretrained("DIR")',
        'tokenizer = AutoTokenizer.from_pretrained("DIR")',
        "```",
        "",
        "## Evaluation",
        "",
    ]
    if evaluation is None:
        lines.append("Not evaluated at export (`--no-eval`).")
    else:
        lines += [
            f"Held-out split of `{config.task.env}`, {evaluation['num_problems']} problems, "
            f"{evaluation['num_samples']} samples at temperature {evaluation['temperature']} for pass@k/avg@k; "
            f"{100 * evaluation['confidence']:.0f} % intervals over problems (`decentrl eval`).",
            "",
            "| score | value | interval |",
            "|---|---|---|",
        ]
        lines += [
            f"| {name} | {s['value']:.3f} | [{s['low']:.3f}, {s['high']:.3f}] |"
            for name, s in evaluation.items()
            if isinstance(s, dict) and "value" in s
        ]
    lines += [
        "",
        "## Provenance",
        "",
        f"- trainer public key (Ed25519): `{facts.trainer_public_key}`",
        f"- version {facts.version}, state hash `{facts.state_sha256}`",
        f"- rebuilt from {len(facts.route)} signed manifests: {', '.join(facts.route)}",
        f"- {len(facts.versions)} versions published; every state hash is in `provenance/provenance.json`",
        f"- workers: {counts.workers_registered} registered, {counts.workers_contributed} contributed trained "
        f"rollouts, {counts.workers_quarantined} quarantined",
        f"- rollouts: {counts.rollouts_accepted} accepted, {counts.rollouts_trained} trained, "
        f"{counts.rollouts_rejected} rejected; {counts.groups_expired} groups expired as too stale",
        "",
        "`decentrl verify-release DIR` checks the signatures, the chain of state hashes, and that the "
        "weights here are the signed state (`provenance/state.safetensors`) with its LoRA adapters merged.",
        "",
        "## Training config",
        "",
        "```json",
        config.model_dump_json(indent=2, exclude=SECRET_FIELDS),
        "```",
        "",
    ]
    return "\n".join(lines)
