"""A request's story: what each step of it returned, kept as the request goes, and its route line
built from them once, when it ends (:meth:`Story.line`).

The steps return values and write nothing of the line: the prompt's length (routes/plan.py), the
slot, the prefix store's restore (routes/stored.py's ``Restored``), the route chosen
(routes/decision.py's ``Choice``), the walk down the hybrid routes (routes/handover.py's ``Walk``),
the relay's timings and how it ended (routes/relay.py's ``Relayed``), the model and its load
(models/registry.py's hold), and how the client left (api/).  This is the only module that gives a
:class:`~supervisor.routeline.RouteLine` its fields (tests/unit/repo/test_imports.py holds it so); the line
itself is frozen.  While the request runs, :attr:`Story.route` and :attr:`Story.slot` say where it
is (``onebitctl status``'s in-flight requests).
"""

from __future__ import annotations

from typing import TypeVar

from ..llama.answers import Evaluated
from ..reasons import Reason
from ..routeline import RequestOutcome, RouteLine
from .decision import Choice, Route
from .handover import Walk
from .relay import Relayed
from .stored import Marked, Restored

N = TypeVar("N", int, float)


def _plus(relayed: N | None, before: N | None) -> N | None:
    """The decoder's count or time for the reply's prompt, with what it evaluated before it."""
    return relayed if relayed is None or before is None else relayed + before


def fallback_chain(reasons: list[Reason]) -> str | None:
    """Every reason a request left a route, in order: ``share-refused>provider-failed``."""
    return ">".join(reason.value for reason in reasons) or None


class Story:
    """One request's story, told by the front (its model, its end) and by its completion (the rest)."""

    __slots__ = (
        "_choice",
        "_error",
        "_held",
        "_later",
        "_marked",
        "_outcome",
        "_planned",
        "_reached",
        "_relayed",
        "_restored",
        "_slot",
        "_waited",
        "_walk",
        "endpoint",
        "req",
    )

    def __init__(self, req: str, endpoint: str) -> None:
        self.req = req
        self.endpoint = endpoint
        self._slot: int | None = None
        self._held: tuple[str | None, float | None] = (None, None)
        self._planned: int | None = None
        self._restored: Restored | None = None
        self._choice: Choice | None = None
        self._walk: Walk | None = None
        self._waited = 0.0
        self._reached: Route | None = None
        self._relayed: Relayed | None = None
        self._later: list[Reason] = []  # reasons found after the route was chosen and walked
        self._marked: Evaluated | None = None
        self._outcome = RequestOutcome.OK
        self._error: str | None = None

    # -- what the steps returned, in the order they return it -------------------------------------

    def held(self, model: str | None, load_ms: float | None) -> None:
        """The model that served it, and how long it waited for its load (None: it did not)."""
        self._held = (model, load_ms)

    def planned(self, prompt_tokens: int | None) -> None:
        """The prompt's length where onebitd tokenized it."""
        self._planned = prompt_tokens

    def holds(self, slot: int) -> None:
        """The decoder slot it was given (a request whose endpoint ignores ``id_slot`` names none)."""
        self._slot = slot

    def restored(self, restored: Restored) -> None:
        """What the prefix store restored into the slot before the route was chosen."""
        self._restored = restored

    def chose(self, choice: Choice) -> None:
        self._choice = choice

    def walks(self, walk: Walk) -> None:
        """The walk down the hybrid routes, as it goes (routes/handover.py is its one writer)."""
        self._walk = walk

    def waited(self, ms: float) -> None:
        """How long the handoff waited for the decoder's prefills in flight (shared cores)."""
        self._waited = ms

    def reached(self, route: Route) -> None:
        """The route the reply is relayed on."""
        self._reached = route

    def job(self, provider: bool = False) -> tuple[int, float]:
        """What the route chosen (reached, for the decoder) has the decoder, or the provider, prefill:
        its tokens and estimated ms (routes/contention.py); (0, 0.0) where the route was not priced."""
        guess = self._choice.estimate if self._choice is not None else None
        if guess is None:
            return 0, 0.0
        return (guess.provider_n, guess.provider_ms) if provider else guess.decoder_job(self._reached or Route.PLAIN)

    def shared_sample(self, prompt_ms: float | None) -> tuple[float, float, float, float] | None:
        """What this prefill says of the slowdowns on shared cores (routes/slowdown.py's ``Shared``):
        ``(its estimate alone, its overlap with the other child's prefills, with the decoder's
        replies, its actual ms)`` on the route it was estimated for, the decoder's ``prompt_ms`` or
        the provider's prefill; None where the route was not the one priced."""
        choice = self._choice
        guess = None if choice is None else choice.estimate
        if choice is None or guess is None or self._reached is not choice.route:
            return None
        if self._reached is Route.PLAIN:
            if prompt_ms is None or self._marked is not None:
                return None
            return guess.plain_alone, guess.plain_overlap, 0.0, prompt_ms
        if self._walk is None:
            return None
        return guess.provider_alone, guess.provider_overlap, guess.provider_decoding, self._walk.ms()[0]

    def marked(self, marked: Marked | None) -> None:
        """The state kept at the prompt's boundary (routes/boundary.py): what the decoder evaluated
        up to it before the rest is counted in the decoder's prompt on the line."""
        self._marked = None if marked is None else marked.prefilled

    def relayed(self, relayed: Relayed) -> None:
        """What the decoder said it did, and whether its reply was an error."""
        self._relayed = relayed
        if relayed.error is not None:
            self._outcome, self._error = RequestOutcome.ERROR, relayed.error

    def fell_back(self, reason: Reason) -> None:
        """A reason found after the route was walked (``restore-unused``), on a request no route
        takes (``unsupported-request``), or on a prompt nothing of which is kept (``no-boundary``)."""
        self._later.append(reason)

    def failed(self, error: str) -> None:
        """It ended by an error onebitd answered (or could no longer answer) the client."""
        self._outcome, self._error = RequestOutcome.ERROR, error

    def stopped(self, error: str) -> None:
        """Its detached stream was stopped (api/hangup.py): said, without changing the outcome."""
        self._error = error

    def left(self, *, detached: bool, why: str | None) -> None:
        """How the client's leaving ended it: its stream ``detached`` into its conversation's session,
        or cancelled while the answer was unfinished (``why``: the server's reason, ``""`` for none;
        None: the client did not leave before the answer was whole)."""
        if detached:
            if self._outcome is RequestOutcome.OK:
                self._outcome = RequestOutcome.DETACHED
        elif why is not None:
            self._outcome = RequestOutcome.CANCELLED
            if why:
                self._error = why

    # -- what it says -------------------------------------------------------------------------------

    @property
    def route(self) -> str:
        """The route it is on: the one reached, else the one its walk is trying, else plain."""
        if self._reached is not None:
            return self._reached.value
        if self._walk is not None:
            return self._walk.trying.value
        return Route.PLAIN.value

    @property
    def slot(self) -> int | None:
        return self._slot

    @property
    def began(self) -> bool:
        """The decoder began its reply (its first token came): the slot holds the whole prompt."""
        return self._relayed is not None and self._relayed.timings.began

    @property
    def prompt_tokens(self) -> int | None:
        """The prompt's length: onebitd's count, else the decoder's."""
        if self._planned is not None:
            return self._planned
        return None if self._relayed is None else self._relayed.timings.prompt_tokens()

    def reasons(self) -> list[Reason]:
        """The fallback chain's reasons: the choice's, the walk's (a walk the client cut short has
        no end to explain: none of its own), then any found later."""
        reasons = [] if self._choice is None else list(self._choice.reasons)
        walk = self._walk
        if walk is not None and walk.reached is not None:
            reasons += walk.reasons()
        return reasons + self._later

    def _refused_memory(self) -> str | None:
        """The memory layout of the decoder whose refusal to share sent it elsewhere: remembered by
        the choice (``share-refused-earlier``), or said by the walk (``share-refused``)."""
        if self._choice is not None and self._choice.memory is not None:
            return self._choice.memory
        return None if self._walk is None else self._walk.memory()

    def line(self, *, status: int, first_byte_ms: float | None, total_ms: float | None) -> RouteLine:
        """The route line, once the request ended: ``status`` as sent, and its times."""
        restored, choice, walk, relayed = self._restored, self._choice, self._walk, self._relayed
        marked_n, marked_ms = (None, None) if self._marked is None else (self._marked.prompt_n, self._marked.prompt_ms)
        estimate = None if choice is None else choice.estimate
        timings = None if relayed is None else relayed.timings
        entry = None if restored is None else restored.entry
        restore_ms = 0.0 if restored is None else 0.0 + restored.ms
        prefill_ms, share_ms, provider = 0.0, 0.0, None
        if walk is not None:
            provider = walk.provider
            prefill_ms, walk_restore_ms, share_ms = walk.ms()
            restore_ms += walk_restore_ms
        return RouteLine(
            route=self.route,
            req=self.req,
            endpoint=self.endpoint,
            status=status,
            outcome=self._outcome,
            fallback=fallback_chain(self.reasons()),
            memory=self._refused_memory(),
            prompt_tokens=self.prompt_tokens,
            prefill_ms=prefill_ms,
            restore_ms=restore_ms,
            share_ms=share_ms,
            wait_ms=self._waited,
            first_byte_ms=first_byte_ms,
            total_ms=total_ms,
            decoder_prompt_n=_plus(None if timings is None else timings.prompt_n, marked_n),
            decoder_prompt_ms=_plus(None if timings is None else timings.prompt_ms, marked_ms),
            provider_prompt_n=None if walk is None else walk.evaluated(),
            restored_tokens=None if entry is None else entry.n_tokens,
            origin_host=None if entry is None else entry.origin_host,
            cached_tokens=None if timings is None else timings.cache_n,
            decoded_n=None if timings is None else timings.predicted_n,
            decode_ms=None if timings is None else timings.predicted_ms,
            est_plain_ms=None if estimate is None else estimate.plain_ms,
            est_hybrid_ms=None if estimate is None else estimate.hybrid_ms,
            slot=self._slot,
            provider=None if provider is None else provider.name,
            engine=None if provider is None else provider.engine,
            device=None if provider is None else provider.device,
            model=self._held[0],
            load_ms=self._held[1],
            error=self._error,
        )
