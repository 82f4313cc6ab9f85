"""The weights a release gives its users: loaded by `transformers` itself, then compared.

Reading the safetensors files by hand would answer a different question from the one that
matters: `transformers` picks `model.safetensors` before an index, follows the index to its
shards, ties `lm_head.weight` to the embeddings or loads its own by `tie_word_embeddings`, and casts
to the dtype in `config.json`. So the check loads the directory with
`AutoModelForCausalLM.from_pretrained` (a vision-language model with
`AutoModelForImageTextToText.from_pretrained`), as a user does, and compares every tensor of the
loaded model with the signed state, bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import torch

from decentrl.release.provenance import ReleaseInvalid


def loaded_state(directory: Path) -> dict[str, torch.Tensor]:
    """The model's state as `transformers` loads it (tied tensors share storage)."""
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging

    from decentrl.model.vision import policy_class

    hf_logging.disable_progress_bar()
    try:
        model = policy_class(AutoConfig.from_pretrained(directory)).from_pretrained(directory)
    except (OSError, ValueError) as exc:  # the signed files do not make a model transformers loads
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else exc.__class__.__name__
        raise ReleaseInvalid(f"transformers cannot load {directory}: {first}") from None
    return model.state_dict()


def check_loaded(directory: Path, merged: dict[str, torch.Tensor]) -> None:
    """Raise ReleaseInvalid unless what `transformers` loads is `merged` (the signed state with its
    adapters merged): every signed tensor bit for bit, and nothing else but aliases of them."""
    loaded = loaded_state(directory)
    for name, tensor in merged.items():
        if name not in loaded:
            raise ReleaseInvalid(f"the model transformers loads has no {name}, a tensor of the signed state")
        # Bit-exact: the export wrote merge(state) itself; float32 addmm of the same inputs on the
        # same kind of CPU gives the same bits.
        if not torch.equal(loaded[name], tensor.to(loaded[name].dtype)):
            diff = (loaded[name].float() - tensor.float()).abs().max().item()
            raise ReleaseInvalid(
                f"{name} as transformers loads it differs from the signed state (max |diff| {diff:.3g})"
            )
    signed_storage = {loaded[name].untyped_storage().data_ptr() for name in merged}
    for name, tensor in loaded.items():
        # A tied head shares the embeddings' storage; a head of its own is a tensor nobody signed.
        if name not in merged and tensor.untyped_storage().data_ptr() not in signed_storage:
            raise ReleaseInvalid(f"transformers loads {name}, which is not in the signed state")
