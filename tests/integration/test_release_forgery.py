"""Forged releases: every way to make `transformers` load a different model (or the card say
something else) from a directory `decentrl verify-release` accepts. Each starts from the real
export of the short demo's run (the `short_demo` fixture, conftest.py), changes one thing, and
must be refused; a release an attacker signs with a key of their own is named as theirs and
refused once the trainer's key is pinned."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from safetensors.torch import load_file, save_file

from decentrl.config import ConfigError, load_config
from decentrl.model import lora
from decentrl.release import signature
from decentrl.release.card import model_card
from decentrl.release.export import export_run
from decentrl.release.files import release_files
from decentrl.release.loaded import check_loaded
from decentrl.release.provenance import Provenance, ReleaseInvalid
from decentrl.release.verify import verify_release
from decentrl.weights.manifest import Manifest
from decentrl.weights.signing import load_or_create_key, public_key_hex, sign

pytestmark = pytest.mark.integration


@pytest.fixture
def genuine(short_demo) -> Path:
    return Path(short_demo[1]["export_dir"])


@pytest.fixture
def release(genuine, tmp_path) -> Path:
    """A copy of the genuine export to tamper with."""
    shutil.copytree(genuine, tmp_path / "release")
    return tmp_path / "release"


def signed_state(directory: Path) -> dict[str, torch.Tensor]:
    return lora.merge(load_file(directory / "provenance" / "state.safetensors"))


def edit_json(path: Path, change) -> None:
    body = json.loads(path.read_text())
    change(body)
    path.write_text(json.dumps(body, indent=2))


def untied_head(directory: Path) -> None:
    """An lm_head of the attacker's, loaded because the config unties it from the embeddings."""
    edit_json(directory / "config.json", lambda config: config.update(tie_word_embeddings=False))
    tensors = load_file(directory / "model.safetensors")
    tensors["lm_head.weight"] = torch.randn_like(tensors["model.embed_tokens.weight"])
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})


def index_to_genuine_copy(directory: Path) -> None:
    """An index pointing at an untouched copy, while model.safetensors (what transformers reads
    first) is changed."""
    shutil.copy(directory / "model.safetensors", directory / "model-00001-of-00001.safetensors")
    tensors = load_file(directory / "model.safetensors")
    names = sorted(tensors)
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": dict.fromkeys(names, "model-00001-of-00001.safetensors")})
    )
    tensors[names[0]] = tensors[names[0]] * 1.5
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})


def test_a_head_of_its_own_is_refused(release):
    untied_head(release)
    with pytest.raises(ReleaseInvalid, match="config.json is not the file the trainer's key signed"):
        verify_release(release)
    # and, under the file hashes, the tensors transformers loads are checked too
    with pytest.raises(ReleaseInvalid, match="transformers loads lm_head.weight, which is not in the signed"):
        check_loaded(release, signed_state(release))


def test_an_index_to_a_genuine_copy_does_not_hide_tampered_weights(release):
    index_to_genuine_copy(release)
    with pytest.raises(ReleaseInvalid, match="not in the signed provenance"):
        verify_release(release)
    with pytest.raises(ReleaseInvalid, match="as transformers loads it differs from the signed state"):
        check_loaded(release, signed_state(release))


@pytest.mark.parametrize(
    ("name", "change"),
    [
        ("config.json", lambda path: edit_json(path, lambda c: c.update(rms_norm_eps=0.5))),
        ("generation_config.json", lambda path: edit_json(path, lambda c: c.update(eos_token_id=3))),
        ("tokenizer.json", lambda path: edit_json(path, lambda t: t["model"]["vocab"].update({"~~": 1}))),
        ("tokenizer_config.json", lambda path: edit_json(path, lambda t: t.update(eos_token="<|user|>"))),
        ("chat_template.jinja", lambda path: path.write_text(path.read_text() + "{{ 'obey' }}")),
        ("model.safetensors", lambda path: path.write_bytes(path.read_bytes()[:-1] + b"\x00")),
    ],
)
def test_an_edit_to_any_file_transformers_reads_is_refused(release, name, change):
    change(release / name)
    with pytest.raises(ReleaseInvalid, match=f"{name} is not the file the trainer's key signed"):
        verify_release(release)


def test_an_adapter_next_to_the_weights_is_refused(release):
    # with peft installed, from_pretrained loads adapter_config.json's adapter on top of the weights
    (release / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    save_file({"x": torch.zeros(2)}, release / "adapter_model.safetensors")
    with pytest.raises(
        ReleaseInvalid, match="adapter_config.json, adapter_model.safetensors: not in the signed"
    ):
        verify_release(release)


def test_card_and_provenance_facts_are_signed(release, genuine):
    card = (release / "README.md").read_text()
    facts = Provenance.model_validate_json((release / "provenance" / "provenance.json").read_bytes())
    accepted = f"rollouts: {facts.counts.rollouts_accepted} accepted"
    assert accepted in card and f"run {facts.run_id}" in card
    (release / "README.md").write_text(
        card.replace(accepted, f"rollouts: {10 * facts.counts.rollouts_accepted + 7} accepted")
    )
    with pytest.raises(ReleaseInvalid, match="README.md is not the model card the signed provenance renders"):
        verify_release(release)
    shutil.copy(genuine / "README.md", release / "README.md")
    edit_json(
        release / "provenance" / "provenance.json",
        lambda p: p["counts"].update(workers_quarantined=0, rollouts_rejected=0),
    )
    with pytest.raises(ReleaseInvalid, match="provenance.json is not signed by the key it names"):
        verify_release(release)


def sign_as(directory: Path, key: Ed25519PrivateKey, card_key: str | None = None) -> str:
    """Re-sign a release with `key` (its manifests and its provenance), as a forger with decentrl
    would; `card_key`: the key the card claims instead. Returns the key's hex."""
    public = public_key_hex(key)
    for path in (directory / "provenance" / "manifests").glob("*.json"):
        path.write_text(sign(Manifest.model_validate_json(path.read_bytes()), key).model_dump_json())
    facts = Provenance.model_validate_json((directory / "provenance" / "provenance.json").read_bytes())
    facts = facts.model_copy(update={"trainer_public_key": public, "files": release_files(directory)})
    body = facts.model_dump_json(indent=2).encode()
    (directory / "provenance" / "provenance.json").write_bytes(body)
    (directory / "provenance" / "provenance.sig").write_text(signature.sign(body, key))
    card = model_card(facts)
    (directory / "README.md").write_text(card if card_key is None else card.replace(public, card_key))
    return public


def test_a_forger_s_own_signature_is_named_and_refused_when_the_key_is_pinned(release, genuine):
    victim = Provenance.model_validate_json((genuine / "provenance" / "provenance.json").read_bytes())
    victim_print = signature.fingerprint(victim.trainer_public_key)
    tensors = load_file(release / "model.safetensors")
    first = sorted(tensors)[0]
    tensors[first] = tensors[first] + 1
    save_file(tensors, release / "model.safetensors", metadata={"format": "pt"})
    forger = Ed25519PrivateKey.generate()
    # a card that claims the victim's run and key
    sign_as(release, forger, card_key=victim.trainer_public_key)
    with pytest.raises(ReleaseInvalid, match="README.md is not the model card"):
        verify_release(release)
    # a card that names the forger's key: signed, so only pinning tells it apart
    forger_key = sign_as(release, forger)
    with pytest.raises(
        ReleaseInvalid, match=f"signed by trainer key {forger_key}.*not the one --trainer-key pins"
    ):
        verify_release(release, victim_print)
    with pytest.raises(ReleaseInvalid, match="not the one --trainer-key pins"):
        verify_release(release, victim.trainer_public_key)
    done = cli("verify-release", str(genuine), "--trainer-key", victim_print)
    assert done.returncode == 0 and victim_print in done.stdout and "not pinned" not in done.stdout, (
        done.stdout
    )


def test_the_trainer_s_own_key_cannot_vouch_for_weights_outside_its_chain(short_demo, genuine, tmp_path):
    trainer = Provenance.model_validate_json((genuine / "provenance" / "provenance.json").read_bytes())
    key = signature.load_signing_key(
        short_demo[0] / "trainer" / "signing_key.pem", trainer.trainer_public_key
    )
    for name, refusal in (
        ("model.safetensors", "as transformers loads it differs from the signed state"),
        ("provenance/state.safetensors", "does not hash to the signed state"),
    ):
        release = shutil.copytree(genuine, tmp_path / name.replace("/", "-"))
        tensors = load_file(release / name)
        first = sorted(tensors)[0]
        tensors[first] = tensors[first] * 1.5
        save_file(tensors, release / name, metadata={"format": "pt"})
        assert sign_as(release, key) == public_key_hex(key)
        with pytest.raises(ReleaseInvalid, match=refusal):
            verify_release(release)


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "decentrl", *args], capture_output=True, text=True, timeout=300
    )


def test_a_manifest_name_outside_the_directory_is_one_line(release, tmp_path):
    (tmp_path / "outside.json").write_text("{}")
    edit_json(
        release / "provenance" / "provenance.json", lambda p: p["route"].append("../../../outside.json")
    )
    done = cli("verify-release", str(release))
    assert done.returncode == 1 and "Traceback" not in done.stdout + done.stderr, done.stdout + done.stderr
    assert done.stdout.count("\n") == 1 and "is not a manifest file name" in done.stdout


def test_export_needs_the_run_s_trainer_key(short_demo, tmp_path):
    run_dir, _ = short_demo
    config = load_config(run_dir / "config.json")
    with pytest.raises(
        ConfigError, match="does not exist; run it where the trainer ran or pass --signing-key"
    ):
        export_run(config, run_dir, tmp_path / "a", evaluate=False, signing_key=tmp_path / "absent.pem")
    other = tmp_path / "other.pem"
    load_or_create_key(other)
    with pytest.raises(ConfigError, match="is not the key this run's trainer signed with"):
        export_run(config, run_dir, tmp_path / "b", evaluate=False, signing_key=other)


def test_no_store_password_leaves_in_the_card_or_the_provenance(short_demo, tmp_path):
    run_dir, _ = short_demo
    config = load_config(
        run_dir / "config.json", ["coordinator.store='postgresql://run:hunter2@db.internal/run'"]
    )
    out = tmp_path / "export"
    export_run(config, run_dir, out, evaluate=False)
    for path in [out / "README.md", out / "provenance" / "provenance.json"]:
        text = path.read_text()
        assert "postgresql://run:***@db.internal/run" in text and "hunter2" not in text, path
    assert verify_release(out).config["coordinator"]["store"] == "postgresql://run:***@db.internal/run"
