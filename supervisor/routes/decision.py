"""Which route a request takes, and what a failure on the way degrades it to.  Pure decisions.

    route   who prefills                          handoff
    plain   the decoder                           none
    file    a provider, into a slot state file     POST /slots/S?action=restore
    share   a provider, into the decoder's KV      ?action=share, then ?action=adopt

The fallback boundary (from the upstream hybrid-route change): a failure *before* any provider wrote
anything degrades to the next hybrid route that still keeps the prompt off the decoder; a failure
*after* a provider did its prefill degrades to plain, because retrying another hybrid route there
would pay for the prefill twice.  ``DEGRADE`` below is that table; nothing else decides it: a
handoff returns an :class:`Outcome` naming the step that failed, and ``Completions`` looks the next
route up here (:func:`degrade`).
"""

from __future__ import annotations

import enum

import attrs

from ..reasons import Reason
from .contention import Busy
from .rates import PrefillCost
from .slowdown import Shared


class Route(enum.Enum):
    PLAIN = "plain"
    FILE = "file"
    SHARE = "share"


class Step(enum.Enum):
    """Where on a hybrid route a failure happened."""

    FILE_PREFILL = "file-prefill"  # the provider failed or claimed the wrong count
    RESTORE = "restore"  # the decoder refused the state file
    SHARE_HANDSHAKE = "share-handshake"  # listen, ?action=share, the decoder's connect + header
    SHARE_PREFILL = "share-prefill"  # the provider failed after it may have written the region
    ADOPT = "adopt"  # the decoder refused to adopt the cells


# A handshake failure happens before any prefill: the file route still spares the decoder the
# prompt.  Everything after a provider ran goes plain: never pay for a prefill twice.
DEGRADE: dict[Step, Route] = {
    Step.FILE_PREFILL: Route.PLAIN,
    Step.RESTORE: Route.PLAIN,
    Step.SHARE_HANDSHAKE: Route.FILE,
    Step.SHARE_PREFILL: Route.PLAIN,
    Step.ADOPT: Route.PLAIN,
}


@attrs.frozen
class Outcome:
    """What one hybrid route's effects did: the route reached, or the step that failed and why.

    Handoffs return this and write nothing else: the owner of the request logs ``why`` once, records
    the reason in the route line's fallback chain, and asks :func:`degrade` where to go next."""

    route: Route  # the route that was tried
    failed: Step | None = None  # None: the slot holds the prompt
    reason: Reason | None = None
    why: str = ""  # for the log: what happened, in the decoder's or the provider's words
    prefill_ms: float | None = None  # the provider's own figure where it gave one, else measured
    restore_ms: float | None = None
    share_ms: float | None = None
    evaluated: int | None = None  # prompt tokens the provider evaluated (its cache held the rest)
    state_bytes: int | None = None  # the state moved (file route)
    handoff_ms: float | None = None  # moving it: the job's time beyond the prefill, plus the restore
    answered: bool = False  # the provider answered its prefill with an error of its own
    memory: str | None = None  # share-refused: the memory layout of the decoder that refused

    @property
    def ok(self) -> bool:
        return self.failed is None


def degrade(outcome: Outcome) -> Route:
    """The route a request continues on after ``outcome``: itself when it worked, else DEGRADE's row."""
    return outcome.route if outcome.failed is None else DEGRADE[outcome.failed]


@attrs.frozen
class Costs:
    """What a route costs, as far as onebitd knows when the request has its slot.

    The prefill costs are fitted from the children's own ``timings`` (supervisor/routes/rates.py:
    configured priors where nothing near the size was measured); the handoff's cost is the save and
    restore of the prompt's state."""

    decoder_cached: int  # prompt tokens the decoder would reuse: its slot's, its prompt cache's, a restore's
    provider_cached: int  # prompt tokens the provider's cache already holds
    decoder: PrefillCost
    provider: PrefillCost
    handoff_ms: float  # saving and restoring (or sharing) the whole prompt's state
    streams_decoding: int  # other requests the decoder is prefilling or generating for right now
    # The provider computes apart from the decoder (supervisor/routes/compute.py): only then does
    # moving a prefill off the decoder spare the streams it decodes.
    apart: bool = False
    # The prefills running on the decoder and the provider now (routes/contention.py): a new one shares them.
    busy: Busy = attrs.field(factory=Busy)
    # Other requests the decoder has to answer now, a slot held or not yet (routes/completion.py's
    # ``answering``): each prefills (there or on a provider) and then decodes, beside a provider's
    # prefill on the decoder's cores.
    others: int = 0
    # On shared cores, the share of the other child's prefill that slows a child's while both run, and
    # of the decoder's replies that slows a provider's prefill (routes/slowdown.py's ``Shared``).
    shared: Shared = attrs.field(factory=Shared)


@attrs.frozen
class Policy:
    """The knobs of the decision (``[hybrid]`` in the config)."""

    # Near-ties go to the hybrid route: moving a prefill off the decoder keeps it free for the streams
    # it decodes.  Hybrid is taken while its estimate is at most (1 + prefer_margin) x plain's.
    prefer_margin: float = 0.15
    # A plain prefill stalls the streams being decoded for about as long as it takes; longer than
    # this and the prefill goes to a provider even when that is slower for this request.
    max_stall_ms: float = 500.0
    # A prompt shorter than this stays plain, and so does one whose slot lacks fewer than this many
    # tokens: no prefill worth moving.
    min_prompt_tokens: int = 256


@attrs.frozen
class Estimate:
    plain_ms: float
    hybrid_ms: float
    # Both prefills' per-token terms were measured near the sizes asked for (else a prior stands in).
    sure: bool = True
    # What each route's prefill would put in flight (routes/contention.py): the tokens the decoder
    # evaluates on plain, and the provider's prefill on the hybrid route, its part of ``hybrid_ms``.
    plain_n: int = attrs.field(default=0, eq=False)
    provider_n: int = attrs.field(default=0, eq=False)
    provider_ms: float = attrs.field(default=0.0, eq=False)
    # Each side's prefill estimated as if the other child were idle, and how long the other child's
    # prefills overlap it, and the decoder's replies the provider's (0 on compute apart): what
    # Rates.observe_shared learns the slowdowns from.
    plain_alone: float = attrs.field(default=0.0, eq=False)
    plain_overlap: float = attrs.field(default=0.0, eq=False)
    provider_alone: float = attrs.field(default=0.0, eq=False)
    provider_overlap: float = attrs.field(default=0.0, eq=False)
    provider_decoding: float = attrs.field(default=0.0, eq=False)
    # On shared cores: how long the handoff waits for the decoder's prefills in flight before its
    # provider is asked (routes/contention.py's ``settle``), part of ``hybrid_ms``.
    wait_ms: float = attrs.field(default=0.0, eq=False)

    def decoder_job(self, route: Route) -> tuple[int, float]:
        """What ``route`` has the decoder evaluate when it is sent there: tokens, estimated ms."""
        if route is Route.PLAIN:
            return self.plain_n, self.plain_ms
        return 1, self.hybrid_ms - self.wait_ms - self.provider_ms


def estimate(prompt_tokens: int, costs: Costs) -> Estimate:
    """Time to the first token on each route, prefill only (the decode is the same on both).

    Plain: the decoder evaluates what it would not reuse.  Hybrid: the provider prefills what its
    cache lacks, the state moves, the decoder evaluates the last token.  Each waits for what already
    runs on its child (``costs.busy``: batched or queued with it), and on shared cores is slowed by
    its share (``costs.shared.prefill``) of what runs on the other child while both run; the restore
    waits for what is left of the decoder's.  On shared cores a provider's prefill is slowed too by
    the other requests the decoder has to answer (``costs.others``; ``costs.shared.decode``): they
    decode beside the rest of it (one planned, queued, prefilling or handed over decodes after; an
    agent's next request follows its reply).  A plain prefill is priced as paying nothing for them:
    it is batched with them in the decoder's own steps.  With nothing in flight these terms are 0.

    On shared cores a handoff may first wait for the decoder's prefills in flight (``wait_ms``,
    routes/contention.py's ``settle``), its provider then running beside none of them: it waits where
    that costs its own first token less than the slowdown it spares the decoder's requests (the
    overlap times ``shared.prefill``), so that the first tokens sum no more (a tie waits: the
    decoder's requests then run as they were estimated).  Their replies still decode beside it.
    With the provider's prefill P outlasting the decoder's rest d and nothing decoding, from a share
    of 0.5 on; with d longer, the restore waits for d anyway, and waiting would add P."""
    plain_n = max(1, prompt_tokens - costs.decoder_cached)
    provider_n = max(1, prompt_tokens - costs.provider_cached)
    busy, apart, shared = costs.busy, costs.apart, costs.shared
    own_plain = costs.decoder.ms(plain_n, prompt_tokens - plain_n)
    plain_overlap = 0.0 if apart else min(own_plain, busy.provider_ms)
    plain_alone = own_plain + busy.decoder_ms
    plain = plain_alone + shared.prefill * plain_overlap
    own_prefill = costs.provider.ms(provider_n, prompt_tokens - provider_n)
    last = costs.handoff_ms + costs.decoder.ms(1, prompt_tokens - 1)
    # Beside the decoder's prefills in flight: slowed by them, and the restore waits for their rest;
    # beside its replies for the rest of the prefill.
    decodes = not apart and costs.others > 0
    provider_overlap = 0.0 if apart else min(own_prefill, busy.decoder_ms)
    decoding = own_prefill - provider_overlap if decodes else 0.0
    provider_alone = own_prefill + busy.provider_ms
    prefill = provider_alone + shared.prefill * provider_overlap + shared.decode * decoding
    hybrid = prefill + max(0.0, busy.decoder_ms - prefill) + last
    wait = 0.0
    if provider_overlap:
        # After them: the provider asked once they are over, its own queue run meanwhile.
        waited_alone = own_prefill + max(0.0, busy.provider_ms - busy.decoder_ms)
        waited_decoding = own_prefill if decodes else 0.0
        waited = waited_alone + shared.decode * waited_decoding
        if busy.decoder_ms + waited + last <= hybrid + shared.prefill * provider_overlap:
            wait, provider_alone, provider_overlap, decoding = busy.decoder_ms, waited_alone, 0.0, waited_decoding
            prefill = waited
            hybrid = wait + prefill + last
    sure = costs.decoder.sure(plain_n) and costs.provider.sure(provider_n)
    return Estimate(
        plain,
        hybrid,
        sure,
        plain_n=plain_n,
        provider_n=provider_n,
        provider_ms=prefill,
        plain_alone=plain_alone,
        plain_overlap=plain_overlap,
        provider_alone=provider_alone,
        provider_overlap=provider_overlap,
        provider_decoding=decoding,
        wait_ms=wait,
    )


def _alone(reason: Reason | None) -> tuple[Reason, ...]:
    return () if reason is None or reason is Reason.DISABLED else (reason,)


@attrs.frozen
class Choice:
    route: Route
    reason: Reason | None = None  # set when a cheaper-for-the-decoder route was not taken
    estimate: Estimate | None = None  # set when the cost decision ran
    # The route line's fallback chain as the request starts, in its order: the reason alone (none
    # for ``disabled``, which is no fallback), or with ``stored`` after it.
    reasons: tuple[Reason, ...] = attrs.field()
    memory: str | None = None  # share-refused-earlier: the memory layout of the decoder that refused

    @reasons.default
    def _reason_alone(self) -> tuple[Reason, ...]:
        return _alone(self.reason)


@attrs.frozen
class Ask:
    """What a request brings to the decision, once it holds its slot (routes/plan.py's ``Plan``)."""

    prompt_tokens: int | None  # None: not tokenized (``kept`` says why)
    # What keeps the prompt itself from any provider: over-context, unsupported-request, tokenize-failed.
    kept: Reason | None = None
    # Why no provider was picked when it came: no-provider, provider-swapping, provider-other-model.
    unpicked: Reason | None = None
    restored: bool = False  # the prefix store restored a prefix of it into the slot


@attrs.frozen
class Offer:
    """What the model offers the request: the hybrid routes and what stands behind them now."""

    enabled: bool  # the hybrid routes are on
    share: bool = False  # the share route is on
    provider_ready: bool = True  # the provider picked is ready now
    # This decoder process refused to share before: its memory layout (gguf.Shape.memory), else None.
    share_refused: str | None = None
    restorable: bool = True  # the model's restores spare a prompt (supervisor/routes/capability.py)
    store: bool = False  # a prefix store is configured


def choose(ask: Ask, offer: Offer, costs: Costs | None = None, policy: Policy = Policy()) -> Choice:
    """The route a request starts on, and every reason it is kept plain; nothing else decides them.

    The first that holds decides, in this order (a prompt no provider could take is named so, whether
    or not its provider is still there):

        kept over-context          plain  over-context
        not restorable             plain  restore-unusable (with the hybrid routes or a store on)
        not enabled                plain  (disabled: no fallback)
        unpicked                   plain  its reason (no-provider, provider-swapping, ...)
        kept, or not tokenized     plain  its reason (unsupported-request), else tokenize-failed
        not provider_ready         plain  no-provider
        under min_prompt_tokens    plain  short-prompt
        the costs                  plain  cached or plain-cheaper
        share and share_refused    file   share-refused-earlier
        otherwise                  share or file

    With ``costs`` the hybrid route must also pay (:func:`_costs_keep_plain`).  A plain request that
    the prefix store served says ``stored`` last, after what else kept it plain; ``cached`` is then
    the store's doing, not the slot's, and is left out."""

    def plain(reason: Reason | None, guess: Estimate | None = None) -> Choice:
        if not ask.restored:
            return Choice(Route.PLAIN, reason, guess)
        kept = tuple(r for r in _alone(reason) if r is not Reason.CACHED)
        return Choice(Route.PLAIN, reason, guess, (*kept, Reason.STORED))

    if ask.kept is Reason.OVER_CONTEXT:
        return plain(Reason.OVER_CONTEXT)
    if not offer.restorable and (offer.enabled or offer.store):
        return plain(Reason.RESTORE_UNUSABLE)
    if not offer.enabled:
        return plain(Reason.DISABLED)
    if ask.unpicked is not None:
        return plain(ask.unpicked)
    if ask.kept is not None or ask.prompt_tokens is None:
        return plain(ask.kept or Reason.TOKENIZE_FAILED)
    prompt_tokens = ask.prompt_tokens
    if not offer.provider_ready:
        return plain(Reason.NO_PROVIDER)
    if prompt_tokens < policy.min_prompt_tokens:
        return plain(Reason.SHORT_PROMPT)
    guess = None
    if costs is not None:
        guess, reason = _costs_keep_plain(prompt_tokens, costs, policy, restored=ask.restored)
        if reason is not None:
            return plain(reason, guess)
    if offer.share and offer.share_refused is not None:
        # This decoder process refused to share before: asking again costs a round trip per request.
        return Choice(Route.FILE, Reason.SHARE_REMEMBERED, guess, memory=offer.share_refused)
    return Choice(Route.SHARE if offer.share else Route.FILE, None, guess)


def _costs_keep_plain(
    prompt_tokens: int, costs: Costs, policy: Policy, *, restored: bool
) -> tuple[Estimate, Reason | None]:
    """The estimates, and why the costs keep a request plain (None: the hybrid route pays).

        the slot lacks fewer than min_prompt_tokens      plain  cached
        an unsure estimate, the slot holds half or more  plain  cached
        the store restored a prefix (``restored``)       hybrid only when cheaper
        the provider computes apart from the decoder     hybrid when within prefer_margin of plain,
                                                         or streams decode and plain > max_stall_ms
        it shares the decoder's compute                  hybrid only when cheaper

    Otherwise plain, ``cached`` when the decoder already holds half of the prompt or more,
    ``plain-cheaper`` else.  A handoff overwrites what the slot holds, a restore included, so after a
    restore only a handoff cheaper than the decoder's evaluating the rest is taken.  An unsure
    estimate (a prior standing in for what was not measured near the size) cannot rule out a
    provider far slower than believed: with the slot holding half the prompt or more, plain
    evaluates at most that half, and is the route that cannot be much worse.  A prefill moved to a
    provider on the same cores spares the decoder's streams nothing, so only the first token's cost
    decides there."""
    guess = estimate(prompt_tokens, costs)
    holds_most = 2 * costs.decoder_cached >= prompt_tokens
    why_plain = Reason.CACHED if holds_most else Reason.PLAIN_CHEAPER
    # The floor is on the prefill a handoff would spare: a prompt whose slot already holds all
    # but a few tokens (a chat's next turn) leaves nothing worth moving.
    if prompt_tokens - costs.decoder_cached < policy.min_prompt_tokens:
        return guess, Reason.CACHED
    if not guess.sure and holds_most:
        return guess, Reason.CACHED
    if restored or not costs.apart:
        return guess, None if guess.hybrid_ms < guess.plain_ms else why_plain
    worth_it = guess.hybrid_ms <= guess.plain_ms * (1 + policy.prefer_margin)
    spares_streams = costs.streams_decoding > 0 and guess.plain_ms > policy.max_stall_ms
    return guess, None if worth_it or spares_streams else why_plain


def claim_matches(claimed: int | None, expected: int) -> bool:
    """A claim that does not say is not an error (the state is the result); a wrong count is."""
    return claimed is None or claimed == expected


def state_claimed(claimed: int | None, lent: int) -> bool:
    """A share that lends recurrent state rows needs a claim that it wrote every one: the staging
    region is reused per slot, so a row left unwritten is another conversation's state."""
    return lent == 0 or claimed == lent


def restore_used(decoder_prompt_n: int | None, check_tokens: int) -> bool:
    """On a hybrid route the decoder should evaluate about one prompt token, not the prompt."""
    return decoder_prompt_n is None or decoder_prompt_n <= check_tokens


def worth_restoring(*, entry_tokens: int, decoder_cached: int, decoder_ms_per_token: float, restore_ms: float) -> bool:
    """Restore a stored prefix into the slot when the prefill it spares costs more than the restore."""
    spared = entry_tokens - decoder_cached
    return spared > 0 and spared * decoder_ms_per_token > restore_ms
