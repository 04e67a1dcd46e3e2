"""Every user-facing knob, as frozen dataclasses validated once in ``__post_init__``.

The CLI is generated from these fields (see ``fluidserve/cli_args.py``): the help text of a
flag is the ``help`` metadata of its field, so a knob is documented exactly once. The engine's
knobs live in ``engine`` (TetriInfer's in ``disagg``), the server's and the evaluation's in
``serving``, the other subcommands' in ``commands``.
"""

from fluidserve.config.base import (  # noqa: F401
    DTYPES,
    SCHEDULERS,
    SLO_SCHEDULERS,
    ConfigError,
    is_config_error,
    knob,
)
from fluidserve.config.commands import (  # noqa: F401
    BuildModelConfig,
    GenerateConfig,
    PredictorTrainConfig,
    ProfileConfig,
    SimConfig,
)
from fluidserve.config.disagg import (  # noqa: F401
    DECODE_ADMISSIONS,
    DISPATCHERS,
    KV_TRANSFER_GRANULARITIES,
    KV_TRANSPORTS,
    LENGTH_PREDICTORS,
    PREFILL_POLICIES,
    DisaggConfig,
)
from fluidserve.config.engine import (  # noqa: F401
    EXECUTOR_BACKENDS,
    SECTIONS,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from fluidserve.config.serving import (  # noqa: F401
    DELAY_METRICS,
    SLO_KINDS,
    SLO_PERCENTILES,
    BenchConfig,
    CapacityConfig,
    ServerConfig,
)
