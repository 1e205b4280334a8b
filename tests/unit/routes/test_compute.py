"""Whether a provider computes apart from the decoder: a device of its own, or CPU sets that do not
overlap; on one machine with neither pinned, the cores are shared."""

from __future__ import annotations

import pytest

from supervisor.routes.compute import Placement, apart


@pytest.mark.parametrize(
    ("device", "provider_cpus", "decoder_cpus", "expected"),
    [
        (None, (), (), False),  # both unpinned: every core is both's
        ("CPU", (), (), False),
        ("CPU", (1,), (), False),  # the decoder runs on every core, the provider's too
        ("CPU", (), (0,), False),
        ("CPU", (0, 1), (1, 2), False),  # overlapping sets
        ("CPU", (1,), (0,), True),  # sets apart
        (None, (2, 3), (0, 1), True),  # an exec provider pinned apart
        ("NPU", (), (), True),
        ("GPU", (), (), True),
        ("GPU.1", (0,), (0,), True),  # the device computes; its host thread's core matters little
    ],
)
def test_a_provider_is_apart_only_on_a_device_or_on_cpus_the_decoder_does_not_use(
    device: str | None, provider_cpus: tuple[int, ...], decoder_cpus: tuple[int, ...], expected: bool
) -> None:
    assert apart(device, provider_cpus, decoder_cpus) is expected


class Named:
    def __init__(self, name: str, device: str | None) -> None:
        self.name, self.device = name, device


def test_the_placement_asks_of_the_provider_as_it_runs_now() -> None:
    placement = Placement(decoder_cpus=(0,), provider_cpus={"p0": (0, 1), "p1": (1,)})
    assert not placement.apart(Named("p0", "CPU"))  # type: ignore[arg-type]
    assert placement.apart(Named("p1", "CPU"))  # type: ignore[arg-type]
    assert placement.apart(Named("p0", "NPU"))  # type: ignore[arg-type]
    assert not Placement().apart(Named("p2", None))  # type: ignore[arg-type]
