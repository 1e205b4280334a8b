"""What is known of a completion request before it takes a slot: the prompt's key (slot affinity), its
tokens where a provider or the prefix store may use them, the provider picked, and what keeps the
prompt from any provider whatever the costs.  The route itself is chosen once the slot is held
(routes/decision.py's ``choose``, called by routes/completion.py).
"""

from __future__ import annotations

import logging

import attrs

from ..errors import DecoderError
from ..llama.decoder import DecoderClient
from ..llama.slots import PromptKey
from ..providers import Provider, Providers
from ..reasons import Reason
from .decision import Ask
from .prompt import Chat, Prompt, Text, Tokens, Unsupported, tokens_of
from .stored import StoredPrefixes

log = logging.getLogger("onebit.hybrid")


@attrs.frozen
class Plan:
    """What is known before a slot is taken, and what :func:`~supervisor.routes.decision.choose`
    weighs once it is held: the prompt's key (its tokens where tokenized), the provider picked (or
    why none was), and what keeps the prompt from any provider whatever the costs."""

    key: PromptKey
    provider: Provider | None
    # What keeps the prompt from any provider: over-context, unsupported-request, tokenize-failed.
    kept: Reason | None = None
    # None picked because a shared provider runs for another model (providers/seat.py): why.
    away: Reason | None = None
    n_tokens: int | None = None  # the prompt's length where it was tokenized (over a slot's context too)
    # False for a prompt the decoder will refuse (its own 400): its slot keeps the memory of what it holds.
    remember: bool = True
    prompt: Chat | Text | Tokens | None = None  # the prompt as read, where it was tokenized
    # For a model whose state cannot be cut back: how many of the tokens a state kept for the
    # conversation's next request holds (routes/prompt.py's ``boundary``); None: none is kept.
    boundary: int | None = None

    @property
    def tokens(self) -> tuple[int, ...] | None:
        return self.key.tokens

    @property
    def beyond_boundary(self) -> int:
        """The prompt's tokens after its boundary: what a decoder given the state up to the boundary
        evaluates, beyond the token or two of any handoff."""
        return len(self.tokens) - self.boundary if self.tokens is not None and self.boundary is not None else 0

    def ask(self, *, restored: bool) -> Ask:
        """What the plan brings to the decision, ``restored``: the prefix store restored a prefix."""
        unpicked = None if self.provider is not None else self.away or Reason.NO_PROVIDER
        tokens = None if self.tokens is None else len(self.tokens)
        return Ask(tokens, kept=self.kept, unpicked=unpicked, restored=restored)


async def plan_prompt(
    prompt: Prompt,
    req: str,
    *,
    client: DecoderClient,
    providers: Providers | None,
    stored: StoredPrefixes | None,
    slot_context: int | None,
) -> Plan:
    """Pick a provider, and tokenize the prompt (read once by routes/prompt.py's ``parse``) when one
    can take it, or the prefix store may hold or keep it; the route is chosen once the request has
    its slot (what the slot holds is a cost).  A Messages or Responses request is read in the chat
    form llama-server converts it into."""
    provider = providers.pick() if providers is not None else None
    away = providers.away() if providers is not None and provider is None else None
    if away is not None:
        planned = await plan_with(None, prompt, req, client=client, stored=stored, slot_context=slot_context)
        log.info("hybrid: %s goes without its provider (%s); the backend prefills it", req, away.value)
        return attrs.evolve(planned, away=away)
    return await plan_with(provider, prompt, req, client=client, stored=stored, slot_context=slot_context)


async def plan_with(
    provider: Provider | None,
    prompt: Prompt,
    req: str,
    *,
    client: DecoderClient,
    stored: StoredPrefixes | None,
    slot_context: int | None,
) -> Plan:
    """:func:`plan_prompt` with the provider already picked (or none): no other is asked for."""
    text = prompt.text
    if isinstance(prompt, Unsupported):
        if prompt.refused:
            # llama-server refuses it too, with its own 400, which is relayed: nothing to route.
            log.info("hybrid: %s is not a request llama-server converts (%s); relayed for its answer", req, prompt.why)
            return Plan(PromptKey(text), provider, Reason.UNSUPPORTED, remember=False)
        if provider is not None:
            log.info("hybrid: %s cannot be handed over (%s); the backend prefills it", req, prompt.why)
        return Plan(PromptKey(text), provider, Reason.UNSUPPORTED)
    if provider is None and (stored is None or not stored.may_hold(text)):
        return Plan(PromptKey(text), None)
    try:
        tokens = await tokens_of(client, prompt)
    except DecoderError as exc:
        log.warning("hybrid: tokenizing %s failed (%s); the backend prefills it", req, exc.message)
        return Plan(PromptKey(text), provider, Reason.TOKENIZE_FAILED)
    if slot_context is not None and len(tokens) >= slot_context:
        # No room for the prompt and a token of reply: the decoder refuses it with its own 400
        # (exceed_context_size_error, with n_prompt_tokens and n_ctx), which is relayed.  Before
        # any handoff or store restore, so neither a provider nor a slot's memory takes it.
        log.info(
            "hybrid: %s has %d prompt tokens, over a slot's context of %d (model.ctx_size / model.parallel)",
            req,
            len(tokens),
            slot_context,
        )
        return Plan(PromptKey(text), provider, Reason.OVER_CONTEXT, n_tokens=len(tokens), remember=False)
    return Plan(PromptKey(text, tuple(tokens)), provider, n_tokens=len(tokens), prompt=prompt)
