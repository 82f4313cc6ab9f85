"""Typed configuration: one pydantic model per component; defaults < TOML file < CLI overrides.

The pydantic defaults are the production defaults: every role started without `--config` runs on
them. The demo's settings (a tiny model, an easy task with a flawed teacher, LoRA) live in
`decentrl/configs/demo.toml`, shipped with the package and read only by `decentrl demo` (and by
files that say `extends = "demo"`). Overrides are `section.field=value` strings, the value parsed
as TOML (so `trainer.lr=3e-4`, `demo.num_workers=3`, `model.path="/ckpt"`). Any mistake is a
`ConfigError` whose message names the fix; the CLI prints it as one line. Imports no torch.

The sections by topic: `base.py` (the one base class, `Section`, and `ConfigError`; imports nothing
from decentrl), `run.py` (`RunConfig` and what every role shares: model, task, warm start, LoRA),
`roles.py` (each role's own section, evaluation, monitoring, launching), `trust.py` (workers,
weights, sandbox), `algorithm.py` (`[algorithm]`: advantage, loss, correction) and `rewards.py`
(`[reward]`: the rubric and the reward-hacking monitors). Reading and writing in `load.py`, the
checks across sections in `checks.py`; every public name of the run's sections is importable from
`decentrl.config`. Config files: the packaged ones in `decentrl/configs/` (`--config demo`), the
examples in the repository's `configs/`.
"""

from decentrl.config.base import ConfigError, Section
from decentrl.config.checks import check_ranks, check_together
from decentrl.config.envd import EnvdConfig
from decentrl.config.load import (
    COORDINATOR_SECTIONS,
    DEMO_CONFIG,
    adopt_coordinator_sections,
    documented_toml,
    dump_toml,
    load_config,
)
from decentrl.config.roles import (
    CoordinatorConfig,
    DemoConfig,
    EvalConfig,
    MonitorConfig,
    RayConfig,
    RoleResources,
    ServiceConfig,
    TrainerConfig,
    WorkerConfig,
)
from decentrl.config.run import (
    SECRET_FIELDS,
    LoraConfig,
    ModelConfig,
    RunConfig,
    SFTConfig,
    TaskConfig,
    redact,
    shareable,
)
from decentrl.config.trust import LOOPBACK_NETWORKS, SandboxConfig, TrustConfig, WeightsConfig

__all__ = [
    "COORDINATOR_SECTIONS",
    "ConfigError",
    "CoordinatorConfig",
    "DEMO_CONFIG",
    "DemoConfig",
    "EnvdConfig",
    "LOOPBACK_NETWORKS",
    "EvalConfig",
    "LoraConfig",
    "ModelConfig",
    "MonitorConfig",
    "RayConfig",
    "RoleResources",
    "RunConfig",
    "SECRET_FIELDS",
    "SFTConfig",
    "SandboxConfig",
    "Section",
    "ServiceConfig",
    "TaskConfig",
    "TrainerConfig",
    "TrustConfig",
    "WeightsConfig",
    "WorkerConfig",
    "adopt_coordinator_sections",
    "check_ranks",
    "check_together",
    "documented_toml",
    "dump_toml",
    "load_config",
    "redact",
    "shareable",
]
