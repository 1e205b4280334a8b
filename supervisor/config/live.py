"""The running config: one frozen :class:`~supervisor.config.Config`, swapped whole by a reload.

The daemon holds one :class:`Settings`; every part that honours a live key (the front, the
scheduler, each model's slots, completions and start-time checks) is handed it and reads the value
it needs at each use, so a reload is one assignment and no part keeps a copy that goes stale.
"""

from __future__ import annotations

from .schema import Config, HybridConfig, ServerConfig


class Settings:
    def __init__(self, config: Config) -> None:
        self._config = config

    def __call__(self) -> Config:
        """The config now."""
        return self._config

    def swap(self, config: Config) -> None:
        self._config = config

    def server(self) -> ServerConfig:
        return self._config.server

    def hybrid(self) -> HybridConfig:
        return self._config.hybrid

    def queue_limit(self) -> int:
        return self._config.server.queue_limit
