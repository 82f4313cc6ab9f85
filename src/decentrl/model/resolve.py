"""Which model directory a role starts from: an explicit one, `model.path`, or the warm start."""

from __future__ import annotations

from pathlib import Path

from decentrl.config import ConfigError, RunConfig


def resolve_model_dir(config: RunConfig, explicit: str | None) -> Path:
    """--model-dir, else model.path (a local dir, or a hub id when online), else model.gguf (converted
    once, cached), else the warm start."""
    if explicit:
        path = Path(explicit)
        if not (path / "config.json").is_file():
            raise ConfigError(
                f"--model-dir {explicit!r} has no config.json; pass a Hugging Face model directory"
            )
        return check_policy_dir(path, "--model-dir")
    if config.model.path:
        path = Path(config.model.path)
        if path.is_dir():
            return check_policy_dir(path, "model.path")
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(config.model.path))
        except Exception as exc:  # offline, unknown id, ...: the user must point at a local copy
            raise ConfigError(
                f"model.path {config.model.path!r} is neither a local directory nor downloadable ({exc.__class__.__name__}); "
                "pass a local model directory"
            ) from None
    if config.model.gguf:
        from decentrl.model.gguf_import import SMOLLM2_PACKAGE, import_gguf

        packaged = config.model.gguf.replace("-", "_") == SMOLLM2_PACKAGE
        return import_gguf(None if packaged else Path(config.model.gguf))
    from decentrl.model.warmstart_cache import cached_warm_start

    cached = cached_warm_start(config.model, config.task, config.sft)
    if cached is not None:  # no need for torch, which only training one needs
        return cached
    from decentrl.model.warmstart import warm_start

    return warm_start(config.model, config.task, config.sft)


def check_policy_dir(path: Path, option: str) -> Path:
    """A directory a policy can be trained and served from: a causal LM, or a supported
    vision-language model with its processor, with a fast tokenizer."""
    import json

    from decentrl.envs.image_tokens import VISION_ARCHITECTURES, read_image_tokens

    try:
        model_config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{option} {str(path)!r}: unreadable config.json ({exc})") from None
    architectures = model_config.get("architectures") or []
    vision = [name for name in architectures if name in VISION_ARCHITECTURES]
    if architectures and not vision and not any(name.endswith("ForCausalLM") for name in architectures):
        raise ConfigError(
            f"{option} {str(path)!r} holds a {', '.join(architectures)}, not a causal LM (*ForCausalLM) "
            f"or a vision-language model decentrl runs ({', '.join(VISION_ARCHITECTURES)}); "
            "pass a causal language model's directory"
        )
    if vision:
        try:
            found = read_image_tokens(path)
        except ValueError as exc:
            raise ConfigError(f"{option} {str(path)!r}: {exc}") from None
        if found is None:
            raise ConfigError(
                f"{option} {str(path)!r} holds a {vision[0]} without its processor (processor_config.json); "
                "save it there (processor.save_pretrained(DIR))"
            )
    if not (path / "tokenizer.json").is_file():
        raise ConfigError(
            f"{option} {str(path)!r} has no tokenizer.json (a fast tokenizer); save the tokenizer there "
            "(tokenizer.save_pretrained(DIR)) or pass the model's full directory"
        )
    return path


# Fields of config.json that make two checkpoints incompatible (weights of one do not load into
# the other, or token ids mean different things).
ARCHITECTURE_FIELDS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "tie_word_embeddings",
    "eos_token_id",
    "text_config",  # a vision-language model: its language model's and vision tower's sizes
    "vision_config",
)


def join_run(
    config: RunConfig, url: str, token: str, role: str, explicit: str | None
) -> tuple[RunConfig, Path]:
    """The config and model directory of a trainer or verifier joining the coordinator at `url`:
    the coordinator's model, task and warm-start sections (or a ConfigError when the role's own
    differ), then its model directory, refused when its architecture is not the coordinator's."""
    import json

    from decentrl.client import CoordinatorClient, RequestRejected
    from decentrl.config import adopt_coordinator_sections

    with CoordinatorClient(url, token) as client:
        try:
            info = client.info()
        except RequestRejected as exc:
            if exc.status != 401:
                raise
            raise ConfigError(
                f"the coordinator at {url} refused the {role}'s token; pass --token=TRAINER_TOKEN, the "
                "trainer_token of tokens.json in the coordinator's run directory"
            ) from None
        theirs = json.loads(client.model_file("config.json"))
    config = adopt_coordinator_sections(config, info.sections, role)
    model_dir = resolve_model_dir(config, explicit)
    ours = json.loads((model_dir / "config.json").read_text())
    differing = [
        f"{key} {ours.get(key)!r} vs {theirs.get(key)!r}"
        for key in ARCHITECTURE_FIELDS
        if ours.get(key) != theirs.get(key)
    ]
    if differing:
        raise ConfigError(
            f"the {role}'s model {str(model_dir)!r} is not the coordinator's ({', '.join(differing[:3])}); "
            "pass --model-dir with the coordinator's model"
        )
    return config, model_dir
