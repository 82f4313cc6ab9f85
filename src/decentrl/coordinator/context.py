"""What every coordinator module shares: the run's context and the model's vocabulary.

The coordinator never imports torch or transformers: it reads `config.json` and `tokenizer.json`
of the model directory with the `tokenizers` library only, which is enough to encode prompts,
bound token ids and decode completions for the trusted reward.
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from tokenizers import Tokenizer

from decentrl.config import ConfigError, CoordinatorConfig, RunConfig
from decentrl.coordinator.db.disk import DiskGuard
from decentrl.coordinator.db.open import open_store
from decentrl.coordinator.db.store import Database, get_meta, set_meta
from decentrl.coordinator.pipeline.scoring import RewardScoring
from decentrl.coordinator.role_watch import RoleWatch
from decentrl.coordinator.wakeup import Wakeup
from decentrl.envs import Environment, environment_from_config
from decentrl.envs.chat import ChatFormat, read_chat_template, read_special_tokens
from decentrl.envs.image_tokens import ImageTokens, read_image_tokens
from decentrl.model.special import read_config, read_eos_token_ids, read_max_context
from decentrl.protocol import SamplingParams
from decentrl.stage_map import StageMap
from decentrl.trust.logprob_tolerance import ToleranceTable
from decentrl.writable_dir import writable_dir

log = logging.getLogger(__name__)

# Non-weight files a worker may download; anything else (weights, paths) is never served.
CHALLENGE_KEY_META = "challenge_key"
TOLERANCES_META = "logprob_tolerances"
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "processor_config.json",
    "preprocessor_config.json",
)


@dataclass(frozen=True)
class ModelInfo:
    tokenizer: Tokenizer
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    """Every id that ends a generation (config.json's, then generation_config.json's), all of
    them advertised in `/v1/info`."""
    pad_token_id: int
    files: tuple[str, ...]
    max_context: int | None = None
    """The model's context length (config.json's `max_position_embeddings`): a prompt plus the
    token budget must fit in it. None when the config does not say."""
    image_tokens: ImageTokens | None = None
    """A vision-language model's image tokens (`envs/image_tokens.py`); None for a text model."""


def load_model_info(model_dir: Path) -> ModelInfo:
    tokenizer_path = model_dir / "tokenizer.json"
    if not tokenizer_path.is_file():
        raise ConfigError(
            f"{tokenizer_path} not found: the model directory needs a fast tokenizer (tokenizer.json)"
        )
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    config = read_config(model_dir)
    # The engines stop at any of these, so the check of a "stop" finish accepts any of them too.
    eos_ids = tuple(read_eos_token_ids(model_dir))
    pad_id = config.get("pad_token_id")
    return ModelInfo(
        tokenizer=tokenizer,
        vocab_size=int(config.get("vocab_size") or tokenizer.get_vocab_size()),
        eos_token_ids=eos_ids,
        pad_token_id=int(pad_id) if pad_id is not None else eos_ids[0],
        files=tuple(name for name in MODEL_FILES if (model_dir / name).is_file()),
        max_context=read_max_context(model_dir),
        image_tokens=read_image_tokens(model_dir),
    )


@dataclass
class Context:
    """The coordinator's state: configuration, durable store, environment and model vocabulary."""

    run: RunConfig
    run_dir: Path
    model_dir: Path
    store: Database
    model: ModelInfo
    env: Environment
    clock: Callable[[], float]
    started: float = field(init=False)
    run_id: str = field(init=False)
    scoring: RewardScoring = field(init=False)
    """Rewards, scored in a pool of processes after ingestion commits (`pipeline/scoring.py`)."""
    disk: DiskGuard = field(init=False)
    """Free space of the run directory (`db/disk.py`): 507 for new work when it runs low."""
    challenge_key: bytes = field(init=False, default=b"")
    """The run's secret that authenticates registration challenges (`trust/auth.issue_challenge`)."""
    tolerances: ToleranceTable = field(init=False)
    """Log-prob tolerance per engine class, as stored with the run (`trust/logprob_tolerance.py`)."""
    room: Wakeup = field(init=False, default_factory=Wakeup)
    """Notified after a commit that may let a lease be granted (a batch acked, leases expired)."""
    ready: Wakeup = field(init=False, default_factory=Wakeup)
    """Notified after a commit that may make groups ready (rewards stored, rollouts accepted,
    verdicts released held ones): the trainer's long poll for a batch (`wakeup.py`)."""
    roles: RoleWatch = field(init=False)
    """Which trusted roles are connected and what work waits on one that is not (`role_watch.py`)."""

    def __post_init__(self) -> None:
        self.disk = DiskGuard(self.run_dir, self.run.service.min_free_disk_mb << 20)
        self.started = self.clock()
        self.roles = RoleWatch(self.clock, self.run_dir)
        self.scoring = RewardScoring(self.run, self.store, self.env, self.clock)
        self.scoring.on_stored = self.ready.notify
        with self.store.transaction() as db:
            run_id = get_meta(db, "run_id")
            key = get_meta(db, CHALLENGE_KEY_META)
            if key is None:  # made once per run, so challenges stay valid across a restart
                key = secrets.token_hex(32)
                set_meta(db, CHALLENGE_KEY_META, key)
            # The table the run started with is stored, so a restart under a newer decentrl keeps
            # the calibration the run was judged by; the run's own entries apply over it each start.
            stored = get_meta(db, TOLERANCES_META)
            self.tolerances = ToleranceTable.for_run(
                self.run.trust.logprob_tolerances,
                json.loads(stored) if stored else None,
                self.run.trust.loosest_tolerance,
            )
            set_meta(db, TOLERANCES_META, json.dumps(self.tolerances.as_dict()))
        assert run_id is not None, "Store writes the run id when it creates the database"
        self.run_id = run_id
        self.challenge_key = bytes.fromhex(key)

    @property
    def config(self) -> CoordinatorConfig:
        return self.run.coordinator

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(
            temperature=self.config.temperature,
            max_new_tokens=self.config.max_new_tokens,
            max_context=self.model.max_context,
        )

    @cached_property
    def chat(self) -> ChatFormat:
        """Prompts and environment turns as token ids, exactly as workers build them."""
        # The same special tokens (BOS, ...) as the workers' renderer, so prompt ids agree.
        return ChatFormat(
            self.model.tokenizer,
            read_chat_template(self.model_dir),
            self.model.eos_token_ids,
            read_special_tokens(self.model_dir),
            self.model.image_tokens,
        )

    @cached_property
    def env_args(self) -> dict:
        """`task.args` as workers load the environment (`/v1/info`): an environment that reads a
        file on this machine (`envs/dataset.py`) names instead what it serves them, by hash."""
        worker_args = getattr(self.env, "worker_args", None)
        return worker_args() if worker_args else self.run.task.args

    def data_file(self, digest: str) -> bytes | None:
        """The served file with this sha256 (None when the environment serves no such file)."""
        if getattr(self.env, "worker_digest", None) != digest:
            return None
        return self.env.worker_payload  # type: ignore[attr-defined]  # an env that has worker_digest

    @cached_property
    def stage_map(self) -> StageMap | None:
        """The run's pipeline stages (`model.num_stages`), fixed for the run; None when unstaged."""
        model = self.run.model
        config = json.loads((self.model_dir / "config.json").read_text())
        return StageMap.for_model(model.num_stages, model.stage_layers, config)

    @property
    def weights_dir(self) -> Path:
        return self.run_dir / "weights"


# How many train problems the start-up check renders: the first ones of the stream
PROMPT_CHECK_PROBLEMS = 16


def check_prompts_fit(context: Context) -> None:
    """Refuse to start when none of the first train prompts leaves room for the token budget in
    the model's context (a one-line ConfigError naming the fix); warn when some do not. Leasing
    skips every prompt that does not fit, with an event each (`pipeline/leasing.py`)."""
    limit = context.model.max_context
    if limit is None:
        return
    budget = context.config.max_new_tokens
    lengths = [
        len(context.chat.prompt_ids(context.env.problem(seed, "train").prompt, context.env.tools or None))
        for seed in range(PROMPT_CHECK_PROBLEMS)
    ]
    over = [n for n in lengths if n + budget > limit]
    if len(over) == len(lengths):
        raise ConfigError(
            f"task {context.run.task.env!r}: its prompts take {min(lengths)}-{max(lengths)} tokens, and with "
            f"coordinator.max_new_tokens = {budget} none fits the model's context of {limit} tokens "
            "(config.json max_position_embeddings; model.max_positions for a built-in model): "
            "raise it or lower max_new_tokens"
        )
    if over:
        log.warning(
            "%d of the first %d train prompts leave no room for %d new tokens in the model's context of %d; "
            "leasing skips such prompts (events of kind prompt_skipped)",
            len(over),
            len(lengths),
            budget,
            limit,
        )


def check_task_images(context: Context, problems: int) -> None:
    """Refuse to start (a one-line ConfigError) when the first train problems draw images a
    text-only policy cannot see, more than the run's image limits allow, or a different number
    than their prompts have image placeholders for."""
    config, env = context.config, context.env
    tokens = context.model.image_tokens
    for seed in range(problems):
        problem = env.problem(seed, "train")
        images = problem.images
        if not images:
            continue
        if tokens is None:
            raise ConfigError(
                f"task {context.run.task.env!r} draws images but the policy is text-only: set [model.vision] "
                "for the tiny model, or model.path to a vision-language model (docs/trainer.md)"
            )
        pixels = sum(image.num_pixels for image in images)
        if len(images) > config.max_images_per_rollout or pixels > config.max_image_pixels:
            raise ConfigError(
                f"task {context.run.task.env!r} draws {len(images)} images of {pixels} pixels, over "
                "coordinator.max_images_per_rollout or max_image_pixels: raise them"
            )
        placed = tokens.count(context.chat.prompt_ids(problem.prompt, env.tools or None))
        if placed != len(images):
            raise ConfigError(
                f"task {context.run.task.env!r}: a prompt places {placed} images but its problem draws "
                f"{len(images)}; the prompt needs one image part per image"
            )


def build_context(run: RunConfig, run_dir: Path, model_dir: Path, clock: Callable[[], float]) -> Context:
    writable_dir(run_dir)
    env = environment_from_config(run.task, run.sandbox)
    context = Context(
        run=run,
        run_dir=run_dir,
        model_dir=model_dir,
        store=open_store(run_dir, run.coordinator.store),
        model=load_model_info(model_dir),
        env=env,
        clock=clock,
    )
    check_prompts_fit(context)
    check_task_images(context, PROMPT_CHECK_PROBLEMS)
    return context
