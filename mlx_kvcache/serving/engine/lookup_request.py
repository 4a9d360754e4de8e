"""A request's prompt lookup as it travels through mlx-lm's server.

The HTTP thread decides whether a request decodes with prompt lookup and how far a round
may draft (`RequestLookup`: ``--prompt-lookup-num-tokens`` or the request's own
``prompt_lookup_num_tokens``; 0 with ``--no-prompt-lookup``) and puts it on the request's
generation arguments (`attach`). On the generation thread mlx-lm makes each request's
sampler with ``_make_sampler(args, tokenizer)`` on both of its paths; `seam.patched`
wraps that (`with_lookup`) so the sampler carries the request's `RequestLookup`
(`LookupSampler`) wherever mlx-lm takes it — into a batch row (`lookup_batch`), or into
``stream_generate`` on the sequential path (`stream`). The counters (`RequestStats`:
tokens drafted and accepted, forward passes) are kept there, and read back by usage
and the log (`decoding`).

Each model's `LookupLength` (what a round verifies, learned from every request of that
model) is one per model (`lengths_for`), held weakly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Tuple

from ...generation.draft_length import LookupLength, LookupTally
from ...generation.lookup import LookupPlan, PromptLookup
from ...generation.per_model import PerModel
from ...prefix.stats import RequestStats

__all__ = ["RequestLookup", "LookupSampler", "attach", "lookup_of", "with_lookup",
           "lengths_for", "plan_for", "lookup_tokens", "with_predictions", "BODY_FIELD"]

#: A request's own setting, named as mlx-lm's server names its draft options
#: (``num_draft_tokens``) and as Hugging Face's ``generate`` names prompt lookup.
BODY_FIELD = "prompt_lookup_num_tokens"

#: The attribute of mlx-lm's per-request ``GenerationArguments`` (and of its
#: ``GenerationContext``, for the routes) that holds the request's `RequestLookup`.
ATTR = "mlx_kvcache_lookup"


@dataclass
class RequestLookup:
    """One request's prompt lookup: at most ``most`` tokens a round (0: off), its
    counters, and on the batch path its drafter and the time of its last round.
    ``make_drafter`` and ``length`` (None: the model's, `lengths_for`) are what the
    request proposes with and how it picks a round's length (tests script them)."""

    most: int
    stats: RequestStats = field(default_factory=RequestStats)
    drafter: Optional[Any] = None
    last: Optional[float] = None
    make_drafter: Callable[[Any], Any] = PromptLookup
    length: Optional[LookupLength] = None
    tally: LookupTally = field(default_factory=LookupTally)
    #: A round whose rejection left a carry: ``(k, seconds)``, its cost measured once the
    #: round that feeds the carry is done (a hybrid's rejection costs both).
    unsettled: Optional[Tuple[int, float]] = None

    def length_on(self, model: Any) -> LookupLength:
        """The `LookupLength` this request follows on ``model``."""
        return self.length if self.length is not None else lengths_for(model)


def attach(args: Any, lookup: RequestLookup) -> None:
    """Put ``lookup`` on mlx-lm's generation arguments (or context) ``args``."""
    setattr(args, ATTR, lookup)


def lookup_of(args: Any) -> Optional[RequestLookup]:
    """The `RequestLookup` on mlx-lm's generation arguments or context, if any."""
    found = getattr(args, ATTR, None)
    return found if isinstance(found, RequestLookup) else None


class LookupSampler:
    """mlx-lm's sampler of one request, carrying its `RequestLookup` (``request``)."""

    def __init__(self, sampler: Callable, request: RequestLookup) -> None:
        self.sampler, self.request = sampler, request

    def __call__(self, logprobs):
        return self.sampler(logprobs)


def with_lookup(make: Callable[[Any, Any], Callable]) -> Callable[[Any, Any], Callable]:
    """mlx-lm's ``_make_sampler(args, tokenizer)``, whose sampler carries the request's
    `RequestLookup` where it has one."""

    def make_sampler(args, tokenizer):
        sampler = make(args, tokenizer)
        lookup = lookup_of(args)
        return sampler if lookup is None else LookupSampler(sampler, lookup)
    make_sampler.__wrapped__ = make
    return make_sampler


#: Each live model's `LookupLength` (one per model: `generation.per_model`).
lengths_for: "PerModel[LookupLength]" = PerModel(lambda model: LookupLength())


def plan_for(model: Any, sampler: Any) -> Optional[LookupPlan]:
    """The `LookupPlan` of a request decoding with ``sampler`` on ``model`` (None: the
    request has prompt lookup off, or is not one of ours)."""
    if not isinstance(sampler, LookupSampler) or sampler.request.most <= 0:
        return None
    req = sampler.request
    return LookupPlan(req.most, req.length_on(model), req.make_drafter)


def lookup_tokens(body: Any) -> Optional[int]:
    """A request body's `BODY_FIELD` (None: absent); ValueError naming a bad one."""
    if not isinstance(body, dict) or body.get(BODY_FIELD) is None:
        return None
    v = body[BODY_FIELD]
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"{BODY_FIELD} must be an integer >= 0 (0 turns prompt lookup off "
                         f"for this request), got {v!r}")
    return v


def with_predictions(response: Any, ctx: Any) -> Any:
    """An OpenAI response whose ``usage`` gains the request's proposals (from its context
    ``ctx``): ``completion_tokens_details.accepted_prediction_tokens`` (proposed and
    emitted) and ``rejected_prediction_tokens`` (proposed and not), as OpenAI reports
    Predicted Outputs — here the proposals are prompt lookup's or a draft model's."""
    lookup = lookup_of(ctx) if ctx is not None else None
    usage = response.get("usage") if isinstance(response, dict) else None
    if lookup is None or not isinstance(usage, dict):
        return response
    st = lookup.stats
    details = dict(usage.get("completion_tokens_details") or {})
    details.update(accepted_prediction_tokens=st.accepted_tokens,
                   rejected_prediction_tokens=st.drafted_tokens - st.accepted_tokens)
    usage["completion_tokens_details"] = details
    return response
