"""Where `mlx-kvcache serve` meets mlx-lm's server, and the check that the seam is there.

mlx-lm's server has no plug-in hook for its prompt cache: ``run()`` builds an
``LRUPromptCache`` and hands it to ``ResponseGenerator``. We reuse everything else
unchanged and replace only that, through module attributes ``main()`` looks up when it
runs: its ``argparse`` (so our options join the server's own parser, ``--help`` included),
its ``run`` (so our prompt cache, response generator and HTTP handler are used), its
``load`` and ``sharded_load`` (a model runs its own code only when it is one of the
operator's, under ``--trust-remote-code``: `model_names.trusted`; the ``--draft-model``
gets the target's flag) — and
``stream_generate``, which the sequential path looks up per request (`stream`: mlx-lm's
own except with a draft model, where ours decodes exactly on every cache kind), and
``_make_logits_processors``, which both paths call per request (a request's reasoning
budget joins its processors: `reasoning_budget`), ``_make_sampler``, likewise (a request's
prompt lookup rides on its sampler: `lookup_request`), and ``mlx_lm.generate``'s
``GenerationBatch`` (a batch of one row verifies lookup proposals: `lookup_batch`).
Nothing of mlx-lm's code is copied. Before touching anything the seam is probed; a
version whose seam changed gets one clear line instead of a server that misbehaves.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
from contextlib import contextmanager
from typing import Callable, Iterator, List, Optional

from ..caches.protocol import untested_note



class SeamError(RuntimeError):
    """mlx-lm's server does not offer the seam `mlx-kvcache serve` plugs into."""


class DraftLoadError(RuntimeError):
    """The ``--draft-model`` did not load (the message names it)."""


def check() -> Optional[str]:
    """Raise `SeamError` if mlx-lm's server lacks what we use; return a note when the
    version is outside the tested range but the seam is intact."""
    import mlx_lm
    from mlx_lm import server as S

    missing = [name for name in ("main", "run", "argparse", "load", "sharded_load",
                                 "ResponseGenerator", "APIHandler",
                                 "ModelProvider", "LRUPromptCache", "ThreadingHTTPServer",
                                 "get_system_fingerprint", "stream_generate",
                                 "CompletionRequest", "process_message_content", "convert_chat")
               if not hasattr(S, name)]
    if missing:
        raise SeamError(f"mlx_lm {mlx_lm.__version__}: mlx_lm.server has no "
                        f"{', '.join(missing)}")
    gone = [m for m in ("generation_available", "stop_and_join", "join")
            if not callable(getattr(S.ResponseGenerator, m, None))]
    if gone:
        raise SeamError(f"mlx_lm {mlx_lm.__version__}: ResponseGenerator has no {', '.join(gone)}")
    params = list(inspect.signature(S.ResponseGenerator.__init__).parameters)
    if params[1:3] != ["model_provider", "prompt_cache"]:
        raise SeamError(f"mlx_lm {mlx_lm.__version__}: ResponseGenerator takes {params[1:]}, "
                        f"not (model_provider, prompt_cache)")
    tok = getattr(S.ResponseGenerator, "_tokenize", None)
    if tok is None or list(inspect.signature(tok).parameters) != ["self", "tokenizer", "request", "args"]:
        raise SeamError(f"mlx_lm {mlx_lm.__version__}: ResponseGenerator._tokenize changed")
    # What the stop, the shared commands and the request checks override (`generator`,
    # `handler`) and what the padding check reuses (`padding`).
    for owner, name, params in (
            (S.ResponseGenerator, "_next_request", ["self", "timeout"]),
            (S.ResponseGenerator, "_serve_single", ["self", "request", "stream"]),
            (S.ResponseGenerator, "_share_object", ["self", "obj"]),
            (S.ResponseGenerator, "_log_cache_stats", ["self"]),
            (S.ResponseGenerator, "_await_response", ["self", "response_queue"]),
            (S.ResponseGenerator, "generate", ["self", "request", "generation_args",
                                              "progress_callback"]),
            (S.ResponseGenerator, "_make_state_machine", ["self", "model_key", "tokenizer",
                                                         "stop_words"]),
            (S.APIHandler, "validate_model_parameters", ["self"]),
            (S.APIHandler, "handle_models_request", ["self"]),
            (S.APIHandler, "_set_completion_headers", ["self", "status_code"]),
            (S.APIHandler, "handle_completion", ["self", "request", "stop_words"]),
            (S.APIHandler, "do_POST", ["self"]),
            (S.APIHandler, "handle_chat_completions", ["self"])):
        fn = getattr(owner, name, None)
        if fn is None or list(inspect.signature(fn).parameters)[:len(params)] != params:
            raise SeamError(f"mlx_lm {mlx_lm.__version__}: {owner.__name__}.{name} changed")
    gen = getattr(S.APIHandler, "generate_response", None)
    if gen is None or list(inspect.signature(gen).parameters)[:3] != ["self", "text", "finish_reason"]:
        raise SeamError(f"mlx_lm {mlx_lm.__version__}: APIHandler.generate_response changed")
    # The front door (`engine.answer`) builds mlx-lm's generation arguments itself and reads
    # each request's context and responses from its queue.
    import dataclasses
    for cls_name, names in (
            ("GenerationArguments", {"model", "sampling", "logits", "stop_words", "max_tokens",
                                     "num_draft_tokens", "logprobs", "top_logprobs", "seed",
                                     "chat_template_kwargs"}),
            ("SamplingArguments", {"temperature", "top_p", "top_k", "min_p",
                                   "xtc_probability", "xtc_threshold"}),
            ("LogitsProcessorArguments", {"logit_bias", "repetition_penalty",
                                          "repetition_context_size", "presence_penalty",
                                          "presence_context_size", "frequency_penalty",
                                          "frequency_context_size"}),
            ("ModelDescription", {"model", "draft", "adapter"}),
            ("GenerationContext", {"prompt", "prompt_cache_count", "initial_state"}),
            ("Response", {"text", "token", "finish_reason"})):
        cls = getattr(S, cls_name, None)
        have = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
        if not names <= have:
            raise SeamError(f"mlx_lm {mlx_lm.__version__}: mlx_lm.server.{cls_name} has no "
                            f"{', '.join(sorted(names - have))}")
    if not callable(getattr(getattr(S, "GenerationContext", None), "stop", None)):
        raise SeamError(f"mlx_lm {mlx_lm.__version__}: mlx_lm.server has no GenerationContext.stop")
    G = importlib.import_module("mlx_lm.generate")  # ``mlx_lm.generate`` is also a function
    if not hasattr(G, "PromptProcessingBatch"):
        raise SeamError(f"mlx_lm {mlx_lm.__version__}: mlx_lm.generate has no PromptProcessingBatch")
    single = inspect.getsource(S.ResponseGenerator._serve_single)
    if "stream_generate(" not in single or "draft_model=" not in single:
        raise SeamError(f"mlx_lm {mlx_lm.__version__}: ResponseGenerator._serve_single no "
                        f"longer calls stream_generate(draft_model=...)")
    if "load(draft_model_path)" not in inspect.getsource(S.ModelProvider._load):
        raise SeamError(f"mlx_lm {mlx_lm.__version__}: ModelProvider._load no longer loads "
                        f"the draft model with load(draft_model_path)")
    batched = inspect.getsource(S.ResponseGenerator._generate)
    if not callable(getattr(S, "_make_logits_processors", None)) or any(
            "_make_logits_processors(args)" not in body for body in (single, batched)):
        raise SeamError(f"mlx_lm {mlx_lm.__version__}: mlx_lm.server no longer makes each "
                        f"request's logits processors with _make_logits_processors(args)")
    # A request's cache namespace rides on its token list (`cache.namespace`): the batch
    # must hand each insert a slice of the very list it was given, grown in place.
    gen_src = inspect.getsource(G)
    if any(needle not in batched for needle in (
            "all_tokens=[prompt[:prompt_cache_count]]", "r.all_tokens[:]", "cache_key[:]")) \
            or "sti += ti" not in gen_src or "sti.append(ti)" not in gen_src:
        raise SeamError(f"mlx_lm {mlx_lm.__version__}: the batch path no longer keeps each "
                        f"request's token list from its admission to its inserts")
    # Work in flight (`engine.flight_batch`): the server builds its batch by the module's
    # name, in the thread `_run_generate` runs; a request's remaining segments are one list,
    # unprocessed and in the prompt batch, cut by the step and reported at each end.
    run_gen = getattr(S.ResponseGenerator, "_run_generate", None)
    batch_src = "".join(inspect.getsource(getattr(G.BatchGenerator, name, len))
                        for name in ("_next", "_make_batch", "insert_segments"))
    if run_gen is None or list(inspect.signature(run_gen).parameters) != ["self"] \
            or "= BatchGenerator(" not in batched or "r.end_of_segment" not in batched \
            or any(needle not in batch_src for needle in (
                "self._currently_processing.append(", "[sequence[1], 0,", "segments = seq[0]",
                "segments[0] = segments[0][n:]", "response.progress = (seq[1], seq[2])",
                "self._prompt_batch.uids[i]", "self._unprocessed_sequences.extend(pending)")):
        raise SeamError(f"mlx_lm {mlx_lm.__version__}: mlx-lm's batch no longer keeps each "
                        f"request's remaining prompt segments the way work in flight reads them")
    # Prompt lookup (`engine.lookup_request`, `engine.lookup_batch`): each request's
    # sampler is made by _make_sampler(args, tokenizer) on both paths, and every batch
    # mlx-lm makes is a GenerationBatch looked up in mlx_lm.generate when it is made.
    if not callable(getattr(S, "_make_sampler", None)) or any(
            "_make_sampler(args," not in body for body in (single, batched)):
        raise SeamError(f"mlx_lm {mlx_lm.__version__}: mlx_lm.server no longer makes each "
                        f"request's sampler with _make_sampler(args, tokenizer)")
    problem = _generation_batch_problem(G)
    if problem:
        raise SeamError(f"mlx_lm {mlx_lm.__version__}: {problem}")
    src = inspect.getsource(S.main)
    if "argparse.ArgumentParser(" not in src or "run(" not in src:
        raise SeamError(f"mlx_lm {mlx_lm.__version__}: mlx_lm.server.main no longer builds "
                        f"its parser and calls run() the way this build expects")
    return untested_note("its server seam")


def _generation_batch_problem(G) -> Optional[str]:
    """What of mlx-lm's ``GenerationBatch`` `engine.lookup_batch.LookupBatch` relies on is
    missing (None: all of it is there): the class made by name where batches are made,
    the per-row state a step keeps (the pending token and its log-probs, the tokens fed,
    the penalties' context, the tokens emitted, the stop matchers) and the verbs a
    finished row goes through."""
    B = getattr(G, "GenerationBatch", None)
    if B is None or not all(callable(getattr(B, m, None)) for m in (
            "next", "extract_cache", "filter", "extend", "empty")) or not hasattr(B, "Response"):
        return "mlx_lm.generate.GenerationBatch changed"
    if "GenerationBatch(" not in inspect.getsource(G.PromptProcessingBatch.generate) or \
            "GenerationBatch.empty(" not in inspect.getsource(G.BatchGenerator.__init__):
        return "mlx_lm.generate no longer makes its batches as GenerationBatch"
    state = inspect.getsource(B)
    missing = [a for a in ("self._next_tokens", "self._next_logprobs", "self._token_context",
                           "self._num_tokens", "self._matchers", "self._current_tokens",
                           "self._current_logprobs", "self.tokens", "self.samplers",
                           "self.fallback_sampler", "self.logits_processors",
                           "self.max_tokens", "self.prompt_cache", "update_and_fetch(")
               if a not in state]
    if missing or not hasattr(getattr(G, "TokenBuffer", None), "tokens"):
        return f"mlx_lm.generate.GenerationBatch no longer keeps {', '.join(missing) or 'TokenBuffer.tokens'}"
    return None


@contextmanager
def patched(add_options: Callable[[argparse.ArgumentParser], None],
            run: Callable, argv: List[str]) -> Iterator[None]:
    """While inside: ``mlx_lm.server.main()`` parses ``argv`` with our options added and
    calls ``run`` instead of its own, and the sequential path's ``stream_generate`` is
    ours (`stream`: mlx-lm's, except with prompt lookup or a draft model), each
    request's logits processors get its reasoning budget (`reasoning_budget`), its
    sampler its prompt lookup (`lookup_request`), and mlx-lm's batches are
    `lookup_batch.LookupBatch`; everything is put back afterwards."""
    import sys

    from mlx_lm import server as S

    from .engine.lookup_batch import LookupBatch
    from .engine.lookup_request import with_lookup
    from .engine.reasoning_budget import with_budgets
    from .engine.stream import make_stream_generate
    from .routes.model_names import trusted

    parsed: List[argparse.Namespace] = []

    class Parser(argparse.ArgumentParser):
        def parse_args(self, args=None, namespace=None):
            add_options(self)
            out = super().parse_args(args, namespace)
            parsed.append(out)
            return out

    stock_load, stock_sharded_load = S.load, S.sharded_load

    def trust(path, kwargs) -> bool:
        # Remote code runs only for the operator's models (`model_names.trusted`): a model
        # a request names loads with it off, model and tokenizer, whatever the flag says.
        ok = bool(parsed) and trusted(parsed[-1], str(path))
        kwargs["trust_remote_code"] = ok and bool(kwargs.get("trust_remote_code", True))
        kwargs["tokenizer_config"] = {**(kwargs.get("tokenizer_config") or {}),
                                      "trust_remote_code": kwargs["trust_remote_code"]}
        return ok

    def load(path, *args, **kwargs):
        # mlx-lm loads a draft model with no options (``load(draft_model_path)``): it gets
        # the target's --trust-remote-code when it is the operator's, and its failure
        # names it.
        if args or kwargs or not parsed:
            if parsed and not args:
                trust(path, kwargs)
            return stock_load(path, *args, **kwargs)
        trust(path, kwargs)
        try:
            return stock_load(path, **kwargs)
        except Exception as e:
            raise DraftLoadError(f"the draft model {path} does not load: "
                                 f"{str(e).strip().splitlines()[0] if str(e).strip() else e!r}"
                                 ) from e

    def sharded_load(repo, *args, **kwargs):
        trust(repo, kwargs)
        return stock_sharded_load(repo, *args, **kwargs)

    G = importlib.import_module("mlx_lm.generate")
    saved = (S.argparse, S.run, S.stream_generate, S.load, S.sharded_load,
             S._make_logits_processors, S._make_sampler, G.GenerationBatch, sys.argv)
    shim = argparse.Namespace(**{k: getattr(argparse, k) for k in dir(argparse)
                                 if not k.startswith("_")})
    shim.ArgumentParser = Parser
    S.argparse, S.run, S.load, S.sharded_load, sys.argv = shim, run, load, sharded_load, argv
    S.stream_generate = make_stream_generate(S.stream_generate)
    S._make_logits_processors = with_budgets(S._make_logits_processors)
    S._make_sampler = with_lookup(S._make_sampler)
    G.GenerationBatch = LookupBatch
    try:
        yield
    finally:
        (S.argparse, S.run, S.stream_generate, S.load, S.sharded_load,
         S._make_logits_processors, S._make_sampler, G.GenerationBatch, sys.argv) = saved
