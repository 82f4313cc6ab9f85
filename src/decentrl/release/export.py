"""`decentrl export RUN --out DIR`: a run's version as a standard Hugging Face model directory.

The version is rebuilt through the signed-weights path (weights/run_dir.py), its LoRA adapters
merged into the base weights, and written with the base model's config, tokenizer, generation
config and chat template: `transformers` loads it with no decentrl installed. Next to the weights:
`provenance/` (release/provenance.py), `eval_results.json` and the model card `README.md`. The
provenance, which hashes every other file, is signed with the run's trainer key
(release/signature.py), so export runs where that key is (`RUN/trainer/signing_key.pem`, or
`--signing-key`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

from decentrl.config import ConfigError, RunConfig, shareable
from decentrl.release.card import model_card
from decentrl.release.files import CARD, release_files
from decentrl.release.provenance import (
    DIRECTORY,
    FACTS_FILE,
    SIGNATURE_FILE,
    Provenance,
    run_counts,
    run_id,
    write_route,
    write_state,
)
from decentrl.release.signature import load_signing_key, sign


def write_model(base: Path, state: dict, out: Path) -> None:
    import torch
    from transformers import AutoProcessor

    from decentrl.model import lora
    from decentrl.model.vision import is_vision_language, load_policy

    model = load_policy(base, torch.float32)
    missing, unexpected = model.load_state_dict(lora.merge(state), strict=False)
    missing = [name for name in missing if name != "lm_head.weight"]  # tied to the embeddings
    assert not missing and not unexpected, (missing, unexpected)
    model.save_pretrained(out, safe_serialization=True)
    if is_vision_language(model.config):  # its processor: tokenizer, image processor, chat template
        AutoProcessor.from_pretrained(base, backend="pil").save_pretrained(out)
    else:
        write_tokenizer(base, out)
    for name in ("chat_template.jinja", "generation_config.json"):
        if (base / name).is_file() and not (out / name).is_file():
            shutil.copy(base / name, out / name)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
PROBE = 'click "rain" now\n[1] button  "a b"\t12+34=46 <eos>'
"""Text with spaces, a newline, a tab, quotes and digits: what a re-built tokenizer gets wrong."""


def write_tokenizer(base: Path, out: Path) -> None:
    """The base's tokenizer files as they are (the ids every role computed with), checked to encode
    like the run's `tokenizer.json` when read with `PreTrainedTokenizerFast`.

    Loading and saving through `AutoTokenizer` is not safe: transformers 5 maps a Qwen2 directory
    to its own `Qwen2Tokenizer`, which rebuilds a byte-level BPE from the vocabulary, and the
    character tokenizer built here then loses every space and newline (an exported browser policy
    scored 0.000 where the run scored 0.225). For the same reason plain `transformers` should read
    the tiny models' tokenizers with `PreTrainedTokenizerFast.from_pretrained` (docs/release.md)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    for name in TOKENIZER_FILES:
        if (base / name).is_file():
            shutil.copy(base / name, out / name)
    expected = Tokenizer.from_file(str(base / "tokenizer.json")).encode(PROBE, add_special_tokens=False).ids
    loaded = PreTrainedTokenizerFast.from_pretrained(out)(PROBE, add_special_tokens=False)["input_ids"]
    if loaded != expected:
        raise ConfigError(
            f"the exported tokenizer in {out} encodes differently from the run's {base / 'tokenizer.json'}: "
            "the export would not reproduce the run's numbers"
        )


def evaluate_export(out: Path, config: RunConfig) -> dict:
    """The card's numbers: `decentrl eval` on the written directory (so they come from the export)."""
    from decentrl.eval.report import run_report

    return run_report(config, str(out), None, None)


def export_run(
    config: RunConfig,
    run_dir: Path,
    out: Path,
    version: int | None = None,
    model_dir: str | None = None,
    evaluate: bool = True,
    signing_key: Path | None = None,
    trainer_dir: Path | None = None,
) -> tuple[Provenance, dict | None]:
    """`trainer_dir`: a run of stage trainers: where their `stage-S/` directories are (default
    RUN/trainer; `release/stage_release.py`)."""
    from decentrl.model.resolve import resolve_model_dir
    from decentrl.release.stage_release import prepare, stage_keys_of, write_stage_routes
    from decentrl.weights.run_dir import NotARun, RunWeights, reconstruct

    if stage_keys_of(run_dir) is not None:  # every stage trainer's stage, key and consent
        run, keys, version, state, stages, routes = prepare(run_dir, out, version, trainer_dir)
        base = resolve_model_dir(config, model_dir)
        out.mkdir(parents=True, exist_ok=True)
        write_model(base, state, out)
        route = write_stage_routes(out, run, routes)
        write_state(out, state)
        return finish(config, run_dir, out, run.versions, version, route, keys, stages, evaluate)
    try:
        run = RunWeights(run_dir)
    except NotARun as exc:
        raise ConfigError(str(exc)) from None
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"--out {out} is not empty; choose a new directory or remove it")
    # Before any costly work: without the trainer's key there is no release to sign.
    key = load_signing_key(signing_key or run_dir / "trainer" / "signing_key.pem", run.trainer_public_key)
    version = run.latest_version if version is None else version
    base = resolve_model_dir(config, model_dir)
    with tempfile.TemporaryDirectory(prefix="decentrl-export-") as cache:
        state, manifests = reconstruct(run, version, Path(cache))
    out.mkdir(parents=True, exist_ok=True)
    write_model(base, state, out)
    route = write_route(out, run, manifests)
    write_state(out, state)
    return finish(config, run.run_dir, out, run.versions, version, route, [key], None, evaluate)


def finish(
    config: RunConfig,
    run_dir: Path,
    out: Path,
    versions: dict[int, str],
    version: int,
    route: list[str],
    keys: list,
    stages: list | None,
    evaluate: bool,
) -> tuple[Provenance, dict | None]:
    """Evaluate the written directory, then sign its provenance (with the trainer's key, or with
    every stage trainer's: `keys[0]` signs provenance.sig) and render the card from it."""
    from decentrl.release.stage_release import sign_stages
    from decentrl.weights.signing import public_key_hex

    evaluation = evaluate_export(out, config) if evaluate else None
    if evaluation is not None:
        (out / "eval_results.json").write_text(json.dumps(evaluation, indent=2))
    facts = Provenance(
        run_id=run_id(run_dir),
        version=version,
        state_sha256=versions[version],
        trainer_public_key=public_key_hex(keys[0]),
        route=route,
        versions=versions,
        counts=run_counts(run_dir),
        config=shareable(config),
        evaluation=evaluation,
        stages=stages,
        files=release_files(out),  # last: every file but the card and the provenance is written
    )
    # A release of one trainer reads as before (no `stages` key).
    body = facts.model_dump_json(indent=2, exclude={"stages"} if stages is None else None).encode()
    (out / DIRECTORY / FACTS_FILE).write_bytes(body)
    (out / DIRECTORY / SIGNATURE_FILE).write_text(sign(body, keys[0]) + "\n")
    sign_stages(out, body, keys)
    (out / CARD).write_text(model_card(facts))
    readable_by_all(out)
    return facts, evaluation


def readable_by_all(out: Path) -> None:
    """A release is published: every file 0644, every directory 0755 (safetensors writes its
    file owner-only). It holds no secret: the config in it is the shareable one."""
    out.chmod(0o755)
    for path in out.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)


def main_export(config: RunConfig, args: argparse.Namespace, run_dir: Path, out: Path) -> int:
    from decentrl.release.hub import PushFailed, push_to_hub

    started = time.monotonic()
    facts, evaluation = export_run(
        config,
        run_dir,
        out,
        args.version,
        args.model_dir,
        not args.no_eval,
        args.signing_key,
        args.trainer_dir,
    )
    scores = "" if evaluation is None else f", held-out pass@1 {evaluation['pass@1_greedy']['value']:.3f}"
    print(
        f"exported v{facts.version} of run {facts.run_id} to {out}{scores} ({time.monotonic() - started:.0f} s)"
    )
    if args.push_to_hub:
        try:
            print(f"pushed: {push_to_hub(out, args.push_to_hub)}")
        except PushFailed as exc:
            print(f"decentrl: error: {exc}", file=sys.stderr)
            return 1
    return 0
