"""The job config: one typed tree, strict keys, validated once at the boundary.

schema.py (the sections), loader.py (YAML, overrides, write-back), checks.py (across sections),
secrets.py, resume.py (what a resume may change, marked on the fields); this facade is what the
rest of oomless imports.
"""

from trainer.core.config.checks import build_config, check_run_time_extras
from trainer.core.config.debug import (
    DebugConfig,
    InjectOomConfig,
    ProfileConfig,
    SlowRank0Config,
)
from trainer.core.config.loader import (
    MAX_CONFIG_BYTES,
    MAX_YAML_VALUES,
    YamlLimitError,
    apply_overrides,
    dump_config,
    load_config,
    read_config_text,
    read_yaml,
    write_config,
)
from trainer.core.config.resume import MATH_KEYS, resume_differences, semantic_hash
from trainer.core.config.schema import (
    LEARNED,
    DataConfig,
    DeepSpeedConfig,
    DistConfig,
    EscalationConfig,
    FinetuneConfig,
    FsdpConfig,
    HardwareConfig,
    JobConfig,
    K8sConfig,
    LoraConfig,
    MemoryConfig,
    ModelConfig,
    ObjectiveConfig,
    PlanConfig,
    RunConfig,
    SlurmConfig,
    TrainConfig,
)
from trainer.core.config.secrets import SECRET_ENV_VARS
from trainer.core.errors import ConfigError
from trainer.core.units import parse_size

__all__ = [
    "check_run_time_extras",
    "LEARNED",
    "MATH_KEYS",
    "MAX_CONFIG_BYTES",
    "MAX_YAML_VALUES",
    "SECRET_ENV_VARS",
    "ConfigError",
    "DataConfig",
    "DebugConfig",
    "DeepSpeedConfig",
    "DistConfig",
    "EscalationConfig",
    "FinetuneConfig",
    "FsdpConfig",
    "HardwareConfig",
    "InjectOomConfig",
    "JobConfig",
    "LoraConfig",
    "MemoryConfig",
    "ModelConfig",
    "ObjectiveConfig",
    "PlanConfig",
    "ProfileConfig",
    "RunConfig",
    "SlowRank0Config",
    "K8sConfig",
    "SlurmConfig",
    "TrainConfig",
    "YamlLimitError",
    "apply_overrides",
    "build_config",
    "dump_config",
    "load_config",
    "parse_size",
    "read_config_text",
    "read_yaml",
    "resume_differences",
    "semantic_hash",
    "write_config",
]
