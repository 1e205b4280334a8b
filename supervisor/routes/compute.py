"""Whether a provider computes apart from the decoder: the one question the cost decision asks of
where the children run.

A provider on other compute (an OpenVINO device other than the CPU, or CPU sets that do not
overlap the decoder's) takes a prefill off the cores the decoder decodes on: moving a long prompt
there spares the streams being decoded.  A provider on the same cores (both unpinned on one
machine, or pinned to sets that overlap) takes the same CPU time the decoder would have: moving
the prefill spares nothing, and the route is chosen on the first token's cost alone
(routes/decision.py's ``_costs_keep_plain``).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import attrs

from ..providers import Provider


def apart(device: str | None, provider_cpus: Collection[int], decoder_cpus: Collection[int]) -> bool:
    """Whether a provider on ``device`` (None: not known, taken as the CPU), pinned to
    ``provider_cpus``, computes apart from a decoder pinned to ``decoder_cpus`` (empty: unpinned,
    every CPU)."""
    if device is not None and device.split(".")[0].upper() != "CPU":
        return True
    return bool(provider_cpus) and bool(decoder_cpus) and not set(provider_cpus) & set(decoder_cpus)


@attrs.frozen
class Placement:
    """The CPU sets the config pins the decoder and each provider to (``cpu_affinity``)."""

    decoder_cpus: tuple[int, ...] = ()
    provider_cpus: Mapping[str, tuple[int, ...]] = attrs.field(factory=dict)

    def apart(self, provider: Provider) -> bool:
        """:func:`apart` for ``provider`` as it runs now (an engine "auto" may have gone from an
        OpenVINO device to the CPU since it started)."""
        return apart(provider.device, self.provider_cpus.get(provider.name, ()), self.decoder_cpus)
