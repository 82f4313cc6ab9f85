"""Every file of a release is signed, or it is not there.

`transformers` reads more than the weights: `config.json` (architecture, `tie_word_embeddings`,
dtype), `generation_config.json`, the tokenizer files, the chat template, an index that redirects
to other shards, `adapter_config.json` with its adapter weights (loaded on top when `peft` is
installed), `*.py` with remote code. Rather than track that list, the provenance hashes every file
the export wrote, and verification refuses any file the signature does not cover. The only files
outside it: the card (checked by rendering it from the signed facts), the provenance and its
signatures themselves, and what a Hub download adds and `transformers` never reads.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

from decentrl.release.provenance import DIRECTORY, FACTS_FILE, SIGNATURE_FILE, ReleaseInvalid

CARD = "README.md"
UNSIGNED = {CARD, f"{DIRECTORY}/{FACTS_FILE}", f"{DIRECTORY}/{SIGNATURE_FILE}", ".gitattributes"}
STAGE_SIGNATURE = re.compile(rf"{DIRECTORY}/stage-\d+\.sig")
"""Each later stage trainer's signature of the provenance (a run of stage trainers)."""
HUB_METADATA = ".cache/huggingface/"
"""Where `hf download --local-dir` keeps its own bookkeeping."""


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def _walk(directory: Path) -> list[str]:
    """Every file under `directory`, as POSIX paths relative to it (file links followed)."""
    found = []
    for root, subdirectories, names in os.walk(directory):
        for name in subdirectories:
            if (Path(root) / name).is_symlink():  # its files would escape the listing
                raise ReleaseInvalid(f"{Path(root, name).relative_to(directory)} is a link to a directory")
        found += [(Path(root) / name).relative_to(directory).as_posix() for name in names]
    return sorted(
        path
        for path in found
        if path not in UNSIGNED and not path.startswith(HUB_METADATA) and not STAGE_SIGNATURE.fullmatch(path)
    )


def release_files(directory: Path) -> dict[str, str]:
    """The SHA-256 of every file the provenance signs."""
    return {name: file_sha256(directory / name) for name in _walk(directory)}


def check_files(directory: Path, signed: dict[str, str]) -> None:
    """Raise ReleaseInvalid unless the directory holds exactly the signed files, byte for byte."""
    present = _walk(directory)
    extra = [name for name in present if name not in signed]
    if extra:
        raise ReleaseInvalid(
            f"{', '.join(extra[:5])}: not in the signed provenance (transformers may read it; remove it "
            "or re-export)"
        )
    missing = sorted(set(signed) - set(present))
    if missing:
        raise ReleaseInvalid(f"{', '.join(missing[:5])}: signed in the provenance but missing")
    for name in present:
        if file_sha256(directory / name) != signed[name]:
            raise ReleaseInvalid(f"{name} is not the file the trainer's key signed (its SHA-256 differs)")
