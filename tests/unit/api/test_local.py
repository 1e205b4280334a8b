"""``/health``'s answer as a table: the decoder's state, the providers' first starts, draining, stopping."""

from __future__ import annotations

import pytest

from supervisor.api.local import ProviderReadiness, health
from supervisor.supervise.child import ChildState

SETTLED = ProviderReadiness()
LOADING = ProviderReadiness(settled=False, not_ready=("npu",))


@pytest.mark.parametrize(
    ("state", "providers", "draining", "stopping", "answer"),
    [
        (ChildState.READY, SETTLED, False, False, (200, {"status": "ok"})),
        (
            ChildState.READY,
            ProviderReadiness(not_ready=("npu",)),
            False,
            False,
            (200, {"status": "ok", "providers_not_ready": ["npu"]}),
        ),
        (ChildState.READY, LOADING, False, False, (503, {"status": "loading", "providers_not_ready": ["npu"]})),
        (ChildState.READY, SETTLED, True, False, (503, {"status": "draining"})),
        (ChildState.FAILED, SETTLED, False, False, (503, {"status": "failed"})),
        (ChildState.STOPPING, SETTLED, False, True, (503, {"status": "stopping"})),
        (ChildState.STOPPED, SETTLED, False, False, (503, {"status": "loading"})),
        (ChildState.STARTING, SETTLED, False, False, (503, {"status": "loading"})),
    ],
)
def test_health_is_ok_only_with_the_decoder_ready_and_every_provider_settled(
    state: ChildState,
    providers: ProviderReadiness,
    draining: bool,
    stopping: bool,
    answer: tuple[int, dict[str, object]],
) -> None:
    assert health(state, providers, draining=draining, stopping=stopping) == answer
