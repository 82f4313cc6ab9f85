"""`decentrl verify-release DIR`: check an exported model against the run's signed weight chain.

1. every manifest of the route (provenance/manifests/) carries the trainer's signature under the
   key the provenance names, and the manifests chain: a snapshot first, then each delta names the
   state hash the step before left, each patch applies to the version before it;
2. the route ends at the exported version with the state hash the run recorded for it;
3. the published state shipped in provenance/state.safetensors hashes to that signed hash;
4. merging it (LoRA adapters folded in, `model/lora.py`) gives exactly the model's weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from decentrl.release.provenance import DIRECTORY, FACTS_FILE, STATE_FILE, Provenance


class ReleaseInvalid(ValueError):
    """The directory's weights do not follow from the signed chain; the message says where."""


def model_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """The model's tensors from model.safetensors or its sharded index."""
    from safetensors.torch import load_file

    index = directory / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return {name: t for shard in shards for name, t in load_file(directory / shard).items()}
    if not (directory / "model.safetensors").is_file():
        raise ReleaseInvalid(
            f"{directory} has no model.safetensors; pass a directory `decentrl export` wrote"
        )
    return load_file(directory / "model.safetensors")


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


def verify_release(directory: Path) -> Provenance:
    from safetensors.torch import load_file

    from decentrl.model import lora
    from decentrl.weights.codec import state_hash
    from decentrl.weights.manifest import Manifest

    facts_path = directory / DIRECTORY / FACTS_FILE
    if not facts_path.is_file():
        raise ReleaseInvalid(
            f"{directory} has no {DIRECTORY}/{FACTS_FILE}; pass a directory `decentrl export` wrote"
        )
    facts = Provenance.model_validate_json(facts_path.read_text())
    manifests = [
        Manifest.model_validate_json((directory / DIRECTORY / "manifests" / name).read_bytes())
        for name in facts.route
    ]
    check_route(facts, manifests)
    state = load_file(directory / DIRECTORY / STATE_FILE)
    if state_hash(state) != facts.state_sha256:
        raise ReleaseInvalid(
            f"{DIRECTORY}/{STATE_FILE} does not hash to the signed state of v{facts.version}"
        )
    model = model_tensors(directory)
    merged = lora.merge(state)
    for name, tensor in merged.items():
        if name not in model:
            raise ReleaseInvalid(f"model.safetensors lacks {name}")
        # Bit-exact: the export wrote merge(state) itself; float32 addmm of the same inputs on the
        # same kind of CPU gives the same bits.
        if not torch.equal(model[name], tensor.to(model[name].dtype)):
            diff = (model[name].float() - tensor.float()).abs().max().item()
            raise ReleaseInvalid(
                f"model.safetensors {name} differs from the signed state (max |diff| {diff:.3g})"
            )
    extra = set(model) - set(merged) - {"lm_head.weight"}  # a tied head is not published separately
    if extra:
        raise ReleaseInvalid(f"model.safetensors has tensors the signed state lacks: {sorted(extra)[:5]}")
    return facts


def main_verify(directory: Path) -> int:
    try:
        facts = verify_release(directory)
    except ReleaseInvalid as exc:
        print(f"decentrl: verify-release: FAILED: {exc}")
        return 1
    print(
        f"ok: {directory} is v{facts.version} of run {facts.run_id} (state {facts.state_sha256[:16]}), "
        f"rebuilt by {len(facts.route)} manifests signed by trainer key {facts.trainer_public_key[:16]}..."
    )
    return 0
