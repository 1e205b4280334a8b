"""``/health``'s answer as a table: the decoder's state, the providers' first starts, draining, stopping."""

from __future__ import annotations

import pytest

from supervisor.api.local import ProviderReadiness, health
from supervisor.providers import ProviderStatistics
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
        (
            ChildState.READY,
            ProviderReadiness(refused=(("ov", "OpenVINO refused, the ggml engine instead: prefill 4 ms a token"),)),
            False,
            False,
            (
                200,
                {
                    "status": "ok",
                    "providers_refused": {"ov": "OpenVINO refused, the ggml engine instead: prefill 4 ms a token"},
                },
            ),
        ),
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


def test_health_names_each_provider_refused_at_start_and_each_engine_auto_fell_back_with_why() -> None:
    def stats(
        name: str, *, ready: bool, refused: str | None = None, fell_back: str | None = None
    ) -> ProviderStatistics:
        return ProviderStatistics(name, "llama-server", ready, 0, 0, 0, None, refused=refused, fell_back=fell_back)

    providers = [
        stats("ov", ready=True, fell_back="OpenVINO refused, the ggml engine instead: prefill 4 ms a token"),
        stats("npu", ready=False, refused="device NPU is not among the runtime's devices (CPU)"),
        stats("cpu", ready=True),
    ]
    readiness = ProviderReadiness.of(True, providers)
    assert readiness.not_ready == ("npu",)
    assert health(ChildState.READY, readiness, draining=False, stopping=False)[1]["providers_refused"] == {
        "ov": "OpenVINO refused, the ggml engine instead: prefill 4 ms a token",
        "npu": "device NPU is not among the runtime's devices (CPU)",
    }
