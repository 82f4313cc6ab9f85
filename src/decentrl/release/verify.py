"""`decentrl verify-release DIR [--trainer-key KEY]`: check an exported model against what the
run's trainer key signed.

1. `provenance/provenance.json` is signed (`provenance.sig`) by the key it names, and that key is
   the pinned one (`--trainer-key`; without it, the output names the key that signed);
2. the directory holds exactly the files the provenance hashes, byte for byte (release/files.py),
   and the model card is the one those signed facts render;
3. every manifest of the route carries the same key's signature, and the manifests chain: a
   snapshot first, then each delta names the state hash the step before left, each patch applies
   to the version before it; the route ends at the exported version and its state hash;
4. the published state in provenance/state.safetensors hashes to that signed hash;
5. the weights `transformers` loads from the directory (release/loaded.py) are exactly that state
   with its LoRA adapters merged (`model/lora.py`).

A release of a run trained by stage trainers (`release/stage_release.py`) passes 1 with every
stage trainer's signature, 3 and 4 for every stage under its own key and hash.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import ValidationError

from decentrl.release.card import model_card
from decentrl.release.files import CARD, check_files
from decentrl.release.provenance import (
    DIRECTORY,
    FACTS_FILE,
    SIGNATURE_FILE,
    STATE_FILE,
    Provenance,
    ReleaseInvalid,
)
from decentrl.release.signature import check_signature, fingerprint, key_matches
from decentrl.release.stage_release import check_stage_routes, check_stage_signatures


def check_route(facts: Provenance, manifests: list) -> None:
    from decentrl.weights.signing import BadSignature, parse_public_key, verify
    from decentrl.weights.sync import VerificationFailed, check_chain

    key = parse_public_key(facts.trainer_public_key)
    for name, manifest in zip(facts.route, manifests, strict=True):
        try:
            verify(manifest, key)
        except BadSignature as exc:
            raise ReleaseInvalid(f"{name}: {exc}") from None
        if facts.versions.get(manifest.version) != manifest.state_sha256:
            raise ReleaseInvalid(
                f"{name}: its state hash is not the one the run recorded for v{manifest.version}"
            )
    try:
        check_chain(manifests, None, None)
    except VerificationFailed as exc:
        raise ReleaseInvalid(f"the signed manifests do not chain: {exc}") from None
    if not manifests or (manifests[-1].version, manifests[-1].state_sha256) != (
        facts.version,
        facts.state_sha256,
    ):
        raise ReleaseInvalid(
            f"the signed route does not end at v{facts.version} with state {facts.state_sha256[:12]}"
        )


def signed_facts(directory: Path, trainer_key: str | list[str] | None) -> Provenance:
    """The provenance, once its signature verifies under the key it names (the pinned one); with
    stage trainers, under every stage's key, each pinned in stage order."""
    provenance = directory / DIRECTORY
    if not (provenance / FACTS_FILE).is_file() or not (provenance / SIGNATURE_FILE).is_file():
        raise ReleaseInvalid(
            f"{directory} has no signed {DIRECTORY}/{FACTS_FILE}; pass a directory `decentrl export` wrote"
        )
    body = (provenance / FACTS_FILE).read_bytes()
    try:
        facts = Provenance.model_validate_json(body)
    except ValidationError as exc:
        problem = exc.errors()[0]
        raise ReleaseInvalid(
            f"{FACTS_FILE}: {'.'.join(map(str, problem['loc']))}: {problem['msg']}"
        ) from None
    check_signature(body, (provenance / SIGNATURE_FILE).read_text(), facts.trainer_public_key)
    signers = [facts.trainer_public_key]
    if facts.stages is not None:
        check_stage_signatures(directory, body, facts.stages)
        signers = [stage.public_key for stage in facts.stages]
        if signers[0] != facts.trainer_public_key:
            raise ReleaseInvalid("provenance.sig is not stage 0's trainer's signature")
    pins = [trainer_key] if isinstance(trainer_key, str) else trainer_key
    if pins is not None and (
        len(pins) != len(signers)
        or not all(key_matches(pin, key) for pin, key in zip(pins, signers, strict=True))
    ):
        named = ", ".join(f"{key} ({fingerprint(key)})" for key in signers)
        if len(signers) == 1:
            raise ReleaseInvalid(f"signed by trainer key {named}, not the one --trainer-key pins")
        raise ReleaseInvalid(
            f"signed by the stage trainers' keys {named} (stage 0 first), not the ones --trainer-key "
            f"pins ({len(pins)} given; one per stage, in stage order)"
        )
    return facts


def check_card(directory: Path, facts: Provenance) -> None:
    try:
        card = model_card(facts)
    except (KeyError, TypeError, ValueError):  # a signed config or evaluation without the fields it shows
        raise ReleaseInvalid(f"{FACTS_FILE} lacks what the model card shows; re-export") from None
    if not (directory / CARD).is_file() or (directory / CARD).read_text() != card:
        raise ReleaseInvalid(f"{CARD} is not the model card the signed provenance renders")


def verify_release(directory: Path, trainer_key: str | list[str] | None = None) -> Provenance:
    from safetensors.torch import load_file

    from decentrl.model import lora
    from decentrl.release.loaded import check_loaded
    from decentrl.weights.codec import state_hash
    from decentrl.weights.manifest import Manifest

    facts = signed_facts(directory, trainer_key)
    # Every file is the signed one before anything below parses it.
    check_files(directory, facts.files)
    check_card(directory, facts)
    for name in [f"manifests/{name}" for name in facts.route] + [STATE_FILE]:
        if f"{DIRECTORY}/{name}" not in facts.files:
            raise ReleaseInvalid(f"{DIRECTORY}/{name} is not among the signed files")
    state = load_file(directory / DIRECTORY / STATE_FILE)
    if facts.stages is not None:  # every stage's own chain, key and hash
        check_stage_routes(directory, facts.version, facts.versions.get(facts.version), facts.stages, state)
        if facts.versions.get(facts.version) != facts.state_sha256:
            raise ReleaseInvalid(
                f"the signed state hash is not the one the run recorded for v{facts.version}"
            )
    else:
        manifests = [
            Manifest.model_validate_json((directory / DIRECTORY / "manifests" / name).read_bytes())
            for name in facts.route
        ]
        check_route(facts, manifests)
        if state_hash(state) != facts.state_sha256:
            raise ReleaseInvalid(
                f"{DIRECTORY}/{STATE_FILE} does not hash to the signed state of v{facts.version}"
            )
    check_loaded(directory, lora.merge(state))
    return facts


def main_verify(directory: Path, trainer_key: str | list[str] | None = None) -> int:
    try:
        facts = verify_release(directory, trainer_key)
    except ReleaseInvalid as exc:
        print(f"decentrl: verify-release: FAILED: {exc}")
        return 1
    keys = [facts.trainer_public_key] if facts.stages is None else [s.public_key for s in facts.stages]
    signed = (
        f"trainer key {keys[0]} ({fingerprint(keys[0])})"
        if facts.stages is None
        else "; ".join(
            f"stage {s.stage} by key {s.public_key} ({fingerprint(s.public_key)})" for s in facts.stages
        )
    )
    print(
        f"ok: {directory} is v{facts.version} of run {facts.run_id} (state {facts.state_sha256[:16]}), "
        f"rebuilt by {len(facts.route)} manifests; everything signed by {signed}"
    )
    if trainer_key is None:
        pins = " ".join(f"--trainer-key {fingerprint(key)}" for key in keys)
        print(
            "the key is not pinned: anyone can sign a release with their own key. Check that it is your "
            f"trainer's with {pins}"
        )
    return 0
