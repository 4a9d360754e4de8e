"""The server's engine (`serving/engine/`), in process: prompt segments split at the
cache's checkpoints, the wait for an answer, the stop command, and a draft model set aside
when it can never pay."""

from __future__ import annotations

import threading
import types

import pytest

from mlx_kvcache.serving import TriePromptCache
from mlx_kvcache.serving.engine.segments import split_segments
from models import build


def test_split_segments():
    segs, kinds = split_segments([[1, 2, 3], [4, 5, 6, 7, 8], [9]], ["system", "user", "assistant"],
                                 [2, 3, 5, 7, 9, 20])
    assert segs == [[1, 2], [3], [4, 5], [6, 7], [8], [9]]
    assert kinds == ["system", "system", "user", "user", "user", "assistant"]
    assert split_segments([[1, 2]], ["user"], []) == ([[1, 2]], ["user"])


def test_a_stream_whose_client_left_while_it_waited_ends_once_it_starts():
    from queue import Queue

    from mlx_kvcache.serving.engine.generator import ServerResponseGenerator
    from mlx_kvcache.serving.guards.lifecycle import (Lifecycle, Ticket, set_client_watch,
                                                      set_stream_waiting, set_ticket)

    # Its stream opened while it waited to be taken; the next keep-alive finds the client
    # gone. The wait goes on (the request is in the line: raising would leave it to run
    # unwatched), and once it starts, its answer ends at once, as for a client that
    # leaves later.
    g = ServerResponseGenerator.__new__(ServerResponseGenerator)
    g.lifecycle = Lifecycle()
    g.generation_available = lambda: True
    left, writes = threading.Event(), []

    def gone():
        writes.append(1)
        raise BrokenPipeError("the client left")
    set_client_watch(left)
    set_stream_waiting(gone)
    try:
        ticket = Ticket()
    finally:
        set_client_watch(None)
        set_stream_waiting(None)
    q: Queue = Queue()
    set_ticket(ticket)
    try:
        timer = threading.Timer(0.5, q.put, ("ctx",))  # taken after some 0.1 s waits
        timer.start()
        assert g._await_response(q) == "ctx"
        assert writes == [1] and left.is_set() and ticket.keepalive is None
        ticket.started = True
        q.put("a token")
        assert g._await_response(q) is None  # its answer ends here
    finally:
        set_ticket(None)


class _HeldProvider:
    """A model provider with no model, for mlx-lm's generation loop alone: ``reset``, which
    the loop calls on its thread once it has left (after the turn it took the stop in),
    holds the thread until `leave` is set, as the rest of that turn would."""

    def __init__(self, hold: bool) -> None:
        self.cli_args = types.SimpleNamespace(prefill_step_size=64)
        self.model = self.tokenizer = self.processor = self.model_key = None
        self.leaving = threading.Event()
        self.leave = threading.Event()
        if not hold:
            self.leave.set()

    def load_default(self) -> None:
        pass

    def reset(self) -> None:
        self.leaving.set()
        self.leave.wait(timeout=120)  # (a cap against a stuck test only)


def test_a_stop_answers_once_the_generation_thread_has_ended():
    """mlx-lm's loop finishes the turn it takes the stop in before it ends — on a sharded
    model a round of the batch, the model's collectives, which every rank runs. Rank 0
    exited at the stop's answer and left the other ranks inside one of them for good
    (test_distributed's stop): the stop answers once the generation thread has ended, and
    a thread that does not end in time is a `TimeoutError` (rank 0 exits 1)."""
    from mlx_kvcache.serving.engine.generator import ServerResponseGenerator

    held = _HeldProvider(hold=True)
    gen = ServerResponseGenerator(held, TriePromptCache(held))
    try:
        with pytest.raises(TimeoutError):  # (the thread holds until `leave`)
            gen.command("stop", timeout=1)
        assert held.leaving.wait(timeout=120)  # the loop took the stop and left
        assert gen.lifecycle.stopped.is_set() and gen.generation_available()
    finally:
        held.leave.set()
    gen.join()
    free = _HeldProvider(hold=False)
    gen = ServerResponseGenerator(free, TriePromptCache(free))
    assert gen.command("stop") is None
    assert free.leaving.is_set() and not gen.generation_available()


class _Provider:
    """mlx-lm's ``ModelProvider`` as `draft_use` sees it: ``load`` (re)loads the target and
    the draft only when the key changes."""

    def __init__(self, target, drafts):
        self.model, self.draft_model, self.model_key = None, None, None
        self._target, self._drafts = target, drafts

    def load(self, model_path, adapter_path=None, draft_model_path=None):
        key = (model_path, adapter_path, draft_model_path)
        if key != self.model_key:
            self.model_key, self.model = key, self._target
            self.draft_model = self._drafts.get(draft_model_path)
        return self.model, "tok"


def test_a_draft_that_could_never_pay_is_set_aside_when_it_loads(monkeypatch, caplog):
    from mlx_kvcache.serving.engine import draft_use

    weighed = []
    real = draft_use.draft_set_aside
    monkeypatch.setattr(draft_use, "draft_set_aside",
                        lambda *a: weighed.append(a[2]) or real(*a))
    target, small = build("llama"), build("llama", hidden_size=32, intermediate_size=64)
    same = build("llama")
    prov = _Provider(target, {"same": same, "small": small})
    draft_use.install(prov, "adaptive")
    with caplog.at_level("WARNING", logger="mlx_kvcache"):
        for _ in range(3):  # every request goes through load
            assert prov.load("m", None, "same") == (target, "tok")
            assert prov.draft_model is None
    said = [r.getMessage() for r in caplog.records if "is not used" in r.getMessage()]
    assert said == ["mlx_kvcache: the draft model same is not used: a step of the draft model "
                    "costs 1.00 of a step of the model (their weight bytes), so drafting can "
                    "never pay for itself; requests are served by the model alone, one at a "
                    "time (--draft-policy fixed drafts with it anyway)"]
    # a draft that may pay is kept, and weighed once, not every request
    for _ in range(3):
        prov.load("m", None, "small")
        assert prov.draft_model is small
    assert weighed == [same, small]
    # fixed keeps whatever it is given
    fixed = _Provider(target, {"same": same})
    draft_use.install(fixed, "fixed")
    fixed.load("m", None, "same")
    assert fixed.draft_model is same


def test_each_live_model_has_one_lookup_length_dropped_with_it():
    """`lookup_request.lengths_for` (a `generation.per_model.PerModel`): one length policy
    per model, the same object each time; another model gets its own; the entry goes
    when the model does, and a newer model under the freed id starts afresh."""
    import gc

    import mlx.nn as nn

    from mlx_kvcache.serving.engine.lookup_request import lengths_for

    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    la = lengths_for(a)
    assert lengths_for(a) is la and lengths_for(b) is not la
    seen = len(lengths_for)
    del a
    gc.collect()
    assert len(lengths_for) == seen - 1
