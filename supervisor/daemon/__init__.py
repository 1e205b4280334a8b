"""onebitd: the root of the supervision tree (:mod:`.root`) and its command line (:mod:`.cli`).

onebitd (trio.run; cli.py) ─ nursery
├── signals                     SIGTERM/SIGINT: stop; SIGHUP: reload
└── Daemon.run (root.py)        the models, the admin socket, the front, READY=1
"""

from ..config.locate import DEFAULT_CONFIG
from ..models.model import SHARE_CONNECT_TIMEOUT_S, share_enabled
from .cli import leaves, local_url, main
from .root import Daemon, Started
from .rundir import LOCK_NAME, lock_runtime_dir

__all__ = [
    "DEFAULT_CONFIG",
    "LOCK_NAME",
    "SHARE_CONNECT_TIMEOUT_S",
    "Daemon",
    "Started",
    "leaves",
    "local_url",
    "lock_runtime_dir",
    "main",
    "share_enabled",
]
