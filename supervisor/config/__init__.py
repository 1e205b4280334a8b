"""Reading and checking the config file; where things are.

    schema     the tables as frozen attrs classes, their validators, the model-name rule
    convert    the one strict cattrs converter; errors as ``key.path: what`` lines; load, loads
    checks     the checks that need more than one field, or the file system
    reload     which keys a running daemon takes, ``reload(old, new)``, and ``source``
    origins    hosts and origins: bind addresses, loopback names, ``server.cors_origins`` entries
    locate     where the model, the llama-server binary and the runtime directories are
    modelspec  each model of a config and the one-model config its decoder runs under

The config file's surface is here: ``from supervisor.config import Config, load``.
"""

from .checks import check
from .convert import converter, load, loads, structure, unstructure
from .reload import Reload, live_keys, reload, source
from .schema import (
    Config,
    ExecProviderConfig,
    HealthPolicy,
    HybridConfig,
    LlamaServerProviderConfig,
    ModelConfig,
    ProviderConfig,
    RestartPolicy,
    ServerConfig,
    WorkerProviderConfig,
    model_name,
)

__all__ = [
    "Config",
    "ExecProviderConfig",
    "HealthPolicy",
    "HybridConfig",
    "LlamaServerProviderConfig",
    "ModelConfig",
    "ProviderConfig",
    "Reload",
    "RestartPolicy",
    "ServerConfig",
    "WorkerProviderConfig",
    "check",
    "converter",
    "live_keys",
    "load",
    "loads",
    "model_name",
    "reload",
    "source",
    "structure",
    "unstructure",
]
