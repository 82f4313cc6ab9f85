"""The model card (README.md) of an exported model: YAML metadata the Hub reads, then prose.

Rendered from the signed provenance alone (every count, score, the run id and the config come from
it), so `decentrl verify-release` renders it again and refuses a card that says anything else."""

from __future__ import annotations

import json

import yaml

from decentrl.release.provenance import Provenance
from decentrl.release.signature import fingerprint


def _metadata(facts: Provenance) -> dict:
    env, evaluation = facts.config["task"]["env"], facts.evaluation
    meta: dict = {
        "library_name": "transformers",
        "pipeline_tag": "text-generation",
        "tags": ["decentrl", "reinforcement-learning", facts.config["algorithm"]["advantage"]["name"], env],
    }
    if facts.config["model"]["path"]:
        meta["base_model"] = facts.config["model"]["path"]
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
                            "name": f"{env} (held-out split, {evaluation['num_problems']} problems)",
                            "type": f"decentrl/{env}",
                            "split": "eval",
                        },
                        "metrics": metrics,
                    }
                ],
            }
        ]
    return meta


def _loading(facts: Provenance) -> list[str]:
    """How a user loads the release: a vision-language model (its processor signed among the
    files) with its processor, a causal LM with its tokenizer."""
    if "processor_config.json" in facts.files:
        return [
            "from transformers import AutoModelForImageTextToText, AutoProcessor",
            'model = AutoModelForImageTextToText.from_pretrained("DIR")',
            'processor = AutoProcessor.from_pretrained("DIR")',
        ]
    return [
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        'model = AutoModelForCausalLM.from_pretrained("DIR")',
        'tokenizer = AutoTokenizer.from_pretrained("DIR")',
    ]


def model_card(facts: Provenance) -> str:
    counts, task, evaluation = facts.counts, facts.config["task"], facts.evaluation
    lines = [
        "---",
        yaml.safe_dump(_metadata(facts), sort_keys=False).strip(),
        "---",
        "",
        f"# decentrl run {facts.run_id}, version {facts.version}",
        "",
        f"Post-trained with asynchronous RL by decentrl on the "
        f"`{task['env']}` environment ({json.dumps(task['args'])}), rollouts from "
        f"{counts.workers_contributed} untrusted workers. Load it with plain `transformers`:",
        "",
        "```python",
        *_loading(facts),
        "```",
        "",
        "## Evaluation",
        "",
    ]
    if evaluation is None:
        lines.append("Not evaluated at export (`--no-eval`).")
    else:
        lines += [
            f"Held-out split of `{task['env']}`, {evaluation['num_problems']} problems, "
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
    if facts.stages is None:
        signers = [
            f"- trainer public key (Ed25519): `{facts.trainer_public_key}` "
            f"(fingerprint `{fingerprint(facts.trainer_public_key)}`); it signs `provenance/provenance.json`"
        ]
    else:  # trained by stage trainers: which key signed which stage
        signers = [
            f"- stage {s.stage} (layers {s.layers[0]}-{s.layers[1] - 1}): trained and signed by stage trainer key "
            f"`{s.public_key}` (fingerprint `{fingerprint(s.public_key)}`), stage state hash `{s.state_sha256}`; "
            f"it signs `provenance/provenance.json` too ({'provenance.sig' if s.stage == 0 else f'stage-{s.stage}.sig'})"
            for s in facts.stages
        ]
    pins = " ".join(
        f"--trainer-key {fingerprint(key)}"
        for key in (
            [facts.trainer_public_key] if facts.stages is None else [s.public_key for s in facts.stages]
        )
    )
    lines += [
        "",
        "## Provenance",
        "",
        *signers,
        f"- version {facts.version}, state hash `{facts.state_sha256}`",
        f"- rebuilt from {len(facts.route)} signed manifests: {', '.join(facts.route)}",
        f"- {len(facts.versions)} versions published; every state hash is in `provenance/provenance.json`",
        f"- workers: {counts.workers_registered} registered, {counts.workers_contributed} contributed trained "
        f"rollouts, {counts.workers_quarantined} quarantined",
        f"- rollouts: {counts.rollouts_accepted} accepted, {counts.rollouts_trained} trained, "
        f"{counts.rollouts_rejected} rejected; {counts.groups_expired} groups expired as too stale",
        "",
        f"`decentrl verify-release DIR {pins}` checks the "
        "signatures, that every file here is the one signed and this card says what the signed provenance "
        "says, the chain of state hashes, and that the weights `transformers` loads are the signed state "
        "(`provenance/state.safetensors`) with its LoRA adapters merged.",
        "",
        "## Training config",
        "",
        "```json",
        json.dumps(facts.config, indent=2),
        "```",
        "",
    ]
    return "\n".join(lines)
