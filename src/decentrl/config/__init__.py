"""Typed configuration: one pydantic model per component; defaults < TOML file < CLI overrides.

The pydantic defaults are the production defaults: every role started without `--config` runs on
them. The demo's settings (a tiny model, an easy task with a flawed teacher, LoRA) live in
`decentrl/configs/demo.toml`, shipped with the package and read only by `decentrl demo` (and by
files that say `extends = "demo"`). Overrides are `section.field=value` strings, the value parsed
as TOML (so `trainer.lr=3e-4`, `demo.num_workers=3`, `model.path="/ckpt"`). Any mistake is a
`ConfigError` whose message names the fix; the CLI prints it as one line. Imports no torch.

The sections are in `sections.py` and `run.py`, reading and writing in `load.py`, the checks
across sections in `checks.py`; every public name is importable from `decentrl.config`.
"""

from decentrl.config.checks import check_ranks, check_together
from decentrl.config.load import (
    COORDINATOR_SECTIONS,
    DEMO_CONFIG,
    adopt_coordinator_sections,
    documented_toml,
    dump_toml,
    load_config,
)
from decentrl.config.run import (
    LOOPBACK_NETWORKS,
    SECRET_FIELDS,
    DemoConfig,
    EvalConfig,
    MonitorConfig,
    RayConfig,
    RoleResources,
    RunConfig,
    SandboxConfig,
    TrustConfig,
    WeightsConfig,
    redact,
    shareable,
)
from decentrl.config.sections import (
    ConfigError,
    CoordinatorConfig,
    LoraConfig,
    ModelConfig,
    Section,
    ServiceConfig,
    SFTConfig,
    TaskConfig,
    TrainerConfig,
    WorkerConfig,
)

__all__ = [
    "COORDINATOR_SECTIONS",
    "ConfigError",
    "CoordinatorConfig",
    "DEMO_CONFIG",
    "DemoConfig",
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
