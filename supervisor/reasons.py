"""Why a request did not take (or did not stay on) the route it could have taken: the route line's
``fallback=`` values, which the route decisions (supervisor/routes/decision.py) and the providers
that refuse a job (supervisor/providers/) both name."""

from __future__ import annotations

import enum


class Reason(enum.Enum):
    """Why a request did not take (or did not stay on) the route it could have taken.

    Values are the route line's ``fallback=`` field."""

    DISABLED = "disabled"  # hybrid off: not logged as a fallback
    SHORT_PROMPT = "short-prompt"
    NO_PROVIDER = "no-provider"
    # A provider several models name runs for one at a time (supervisor/providers/seat.py): it is
    # being restarted for this request's model, or it runs for another model that is busy.
    PROVIDER_SWAPPING = "provider-swapping"
    PROVIDER_OTHER_MODEL = "provider-other-model"
    UNSUPPORTED = "unsupported-request"  # a prompt shape we cannot hand over (several prompts, ...)
    TOKENIZE_FAILED = "tokenize-failed"
    PROVIDER_FAILED = "provider-failed"
    SHORT_CLAIM = "short-claim"
    RESTORE_REFUSED = "restore-refused"
    SHARE_REFUSED = "share-refused"
    SHARE_REMEMBERED = "share-refused-earlier"
    SHARE_UNSUPPORTED = "share-unsupported"  # the provider cannot write a shared region
    ADOPT_REFUSED = "adopt-refused"
    # A hybrid model's share whose claim does not say it wrote every recurrent state row the decoder
    # lent (``state_rows``): the staging region may hold another share's state, so nothing is adopted.
    SHARE_STATE_UNCLAIMED = "share-state-unclaimed"
    # The handoff answered success but the decoder re-evaluated the prompt (ggml-org/llama.cpp#26676):
    # the route stays what it was, and the chain says the work was done twice.
    RESTORE_UNUSED = "restore-unused"
    # The model's restores cannot spare a prompt in this llama.cpp (its load's probe found so, or a
    # restore it passed was not used: supervisor/routes/capability.py): plain, no provider job.
    RESTORE_UNUSABLE = "restore-unusable"
    # A hybrid model's prompt whose state nothing keeps: its chat template renders the messages
    # otherwise without the generation prompt, so no point of it is one the next turn still matches
    # (supervisor/routes/boundary.py).  Its next turn, after a restart or a swap back, restores nothing.
    NO_BOUNDARY = "no-boundary"
    # Plain because it is clearly cheaper: the decoder already holds most of the prompt (``cached``),
    # or the handoff costs more than the prefill it spares (``plain-cheaper``).
    CACHED = "cached"
    PLAIN_CHEAPER = "plain-cheaper"
    # Plain because a prefix restored from the prefix store gave the decoder most of the prompt.
    STORED = "stored"
    # The prompt does not fit a slot's context (model.ctx_size / model.parallel tokens): nothing is
    # handed over or stored, and the decoder answers its own 400 exceed_context_size_error.
    OVER_CONTEXT = "over-context"
