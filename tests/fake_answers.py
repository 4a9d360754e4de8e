"""A scripted stand-in for the engine's `Answer` (`mlx_kvcache.serving.engine.answer`), for
tests of the agent routes' wire and builders without a model."""

from __future__ import annotations

from typing import Any, Callable, List, Optional

from mlx_kvcache.serving.engine.answer import NOTHING, Finished, Started
from mlx_kvcache.serving.routes.agents.generation import Accounting


class ScriptedAnswer:
    """The events of ``script`` in order — `NOTHING` (an interval passed in silence) where it
    says None — then the end; `close` is recorded (``closed``)."""

    def __init__(self, script: List[Any], prompt_tokens: int = 5, cached_tokens: int = 0,
                 on_close: Optional[Callable[[], None]] = None) -> None:
        self._script = list(script)
        self.prompt_tokens, self.cached_tokens = prompt_tokens, cached_tokens
        self.closed = False
        self.output_tokens = 0
        self.prompt: List[int] = []
        self._on_close = on_close

    @property
    def ended(self) -> bool:
        return not self._script

    def started(self, timeout: Optional[float] = None) -> Started:
        return Started(self.prompt_tokens, self.cached_tokens)

    def next_event(self, timeout: Optional[float]) -> Any:
        if not self._script:
            return None
        ev = self._script.pop(0)
        return NOTHING if ev is None else ev

    def close(self) -> None:
        if not self.closed and self._on_close is not None:
            self._on_close()
        self.closed = True


class EndlessAnswer(ScriptedAnswer):
    """Gives ``event`` for ever (a client must leave to end it)."""

    def __init__(self, event: Any, **kw: Any) -> None:
        super().__init__([], **kw)
        self._event = event

    @property
    def ended(self) -> bool:
        return self.closed

    def next_event(self, timeout: Optional[float]) -> Any:
        return None if self.closed else self._event


class ScriptedCache:
    """The prompt cache a scripted run stands in for: foresight off, its idle work real
    (nothing is cached: nothing is foreseen or retired)."""

    def __init__(self) -> None:
        from mlx_kvcache.serving.cache.foresight import Foresight
        from mlx_kvcache.serving.cache.idle_work import IdleWork
        self.foresight = Foresight(enabled=False)
        self.idle_work = IdleWork(self.foresight, lambda tokens: None, lambda: None)


class ScriptedGenerator:
    """The generator a scripted run stands in for: what the wire counts refusals in, and
    its prompt cache."""

    def __init__(self) -> None:
        from mlx_kvcache.serving.guards.lifecycle import Lifecycle
        self.lifecycle = Lifecycle()
        self.prompt_cache = ScriptedCache()


def finished(reason: str = "stop", prompt: int = 5, cached: int = 0, output: int = 2,
             stop_sequence: Optional[str] = None) -> Finished:
    """A `Finished` event with these counts."""
    return Finished(reason, stop_sequence, prompt, cached, output)


def runs(answer: Any, accounting: Accounting = Accounting(0, False)) -> Callable[..., Any]:
    """A ``run`` for `wire.serve` answering every call with ``answer``."""
    def run(generator, call, waiting=None, every=None):
        return answer, accounting
    return run


class FakeGenerator:
    """What the agent routes' rendering (`generation.prepare`, `count_tokens`) asks of the
    server's generator, for a ``tokenizer`` and no model: the served model and the options
    (ours at their defaults — the app's own parser — and mlx-lm's the routes read)."""

    def __init__(self, tokenizer: Any, processor: Any = None, **options: Any) -> None:
        import argparse

        from mlx_kvcache.serving.app import add_options
        from mlx_kvcache.serving.engine.requests import ServedModel

        parser = argparse.ArgumentParser()
        add_options(parser)
        self.cli_args = parser.parse_args([])
        for k, v in dict(model=None, chat_template_args={}, max_tokens=512, temp=0.0,
                         top_p=1.0, top_k=0, min_p=0.0, num_draft_tokens=3,
                         context_length=None, **options).items():
            setattr(self.cli_args, k, v)
        self._served = ServedModel.of(None, tokenizer, processor)

    def served_model(self):
        return self._served

    def generation_available(self) -> bool:
        return True
