"""What prefill and handoffs cost here, learnt from the children's own reports.

The decoder's and each provider's milliseconds per prompt token come from their ``timings``
(``prompt_ms / prompt_n``); a handoff's from its measured save and restore, per MiB of state.  Each is
an exponential moving average, reset when the child it describes restarts (a new process may run on
other cores or with other flags), and a configured prior stands in until the first measurement.
"""

from __future__ import annotations

import attrs

# Weight of a new measurement: about the last ten requests count.
ALPHA = 0.2
# A prefill of fewer tokens is mostly fixed cost (scheduling, the HTTP round trip) and says little
# about the per-token rate.
MIN_TOKENS = 8
MIB = 1 << 20


@attrs.define
class Average:
    prior: float
    value: float | None = None
    generation: int = -1
    samples: int = 0

    def get(self, generation: int) -> float:
        return self.value if self.value is not None and generation == self.generation else self.prior

    def observe(self, sample: float, generation: int) -> None:
        if generation != self.generation:
            self.value, self.generation, self.samples = None, generation, 0
        self.value = sample if self.value is None else (1 - ALPHA) * self.value + ALPHA * sample
        self.samples += 1


@attrs.frozen
class RateStatistics:
    decoder_ms_per_token: float
    providers_ms_per_token: dict[str, float]
    handoff_ms_per_mib: float
    state_bytes_per_token: float


class Rates:
    def __init__(
        self,
        *,
        decoder_ms_per_token: float,
        provider_ms_per_token: float,
        handoff_ms_per_mib: float,
        state_bytes_per_token: float,
    ) -> None:
        self.decoder = Average(decoder_ms_per_token)
        self._provider_prior = provider_ms_per_token
        self.providers: dict[str, Average] = {}
        self.handoff = Average(handoff_ms_per_mib)
        self.state = Average(state_bytes_per_token)

    def provider(self, name: str) -> Average:
        return self.providers.setdefault(name, Average(self._provider_prior))

    def prefill(self, generation: int, provider: str) -> tuple[float, float]:
        """The decoder's and ``provider``'s ms per token, for comparing them.

        A rate measured on one side only is compared with the other side's prior scaled by the same
        factor: a loaded or slow machine slows both, and a measured rate against a bare prior would
        make whichever side was measured first look the slower."""
        decoder, other = self.decoder, self.provider(provider)
        decoder_measured = decoder.value is not None and decoder.generation == generation
        other_measured = other.value is not None
        d, p = decoder.get(generation), other.get(0)
        if decoder_measured and not other_measured:
            p = d * other.prior / decoder.prior
        elif other_measured and not decoder_measured:
            d = p * decoder.prior / other.prior
        return d, p

    def observe_decoder(self, generation: int, prompt_n: int | None, prompt_ms: float | None) -> None:
        if prompt_n is not None and prompt_ms is not None and prompt_n >= MIN_TOKENS:
            self.decoder.observe(prompt_ms / prompt_n, generation)

    def observe_provider(self, name: str, evaluated: int | None, prefill_ms: float | None) -> None:
        # Providers without a child generation (exec) are one population; 0 stands for it.
        if evaluated is not None and prefill_ms is not None and evaluated >= MIN_TOKENS:
            self.provider(name).observe(prefill_ms / evaluated, 0)

    def observe_handoff(self, n_tokens: int, state_bytes: int | None, handoff_ms: float | None) -> None:
        if state_bytes is None or handoff_ms is None or state_bytes <= 0 or n_tokens <= 0:
            return
        self.handoff.observe(handoff_ms / (state_bytes / MIB), 0)
        self.state.observe(state_bytes / n_tokens, 0)

    def handoff_ms(self, n_tokens: int) -> float:
        """The estimated cost of moving ``n_tokens`` tokens' state from a provider to the decoder."""
        return self.handoff.get(0) * n_tokens * self.state.get(0) / MIB

    def statistics(self, generation: int) -> RateStatistics:
        return RateStatistics(
            decoder_ms_per_token=self.decoder.get(generation),
            providers_ms_per_token={name: avg.get(0) for name, avg in self.providers.items()},
            handoff_ms_per_mib=self.handoff.get(0),
            state_bytes_per_token=self.state.get(0),
        )
