"""Work in flight, in process: the registry's choices and bounds (`cache.inflight`), a
prompt's remaining segments cut in place (`engine.segments`), and mlx-lm's own
`BatchGenerator` whose running requests are flights (`engine.flight_batch`) — a cut made
while a request prefills stops it exactly there and stores caches equal to a cold
prefill's (KV, hybrid and sliding-window layers), and changes nothing of its answer. The
servers: test_agents_inflight.py."""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import make_prompt_cache

from mlx_kvcache.serving.cache.inflight import MIN_SHARED, InFlight, steps_for
from mlx_kvcache.serving.engine.flight_batch import FlightBatchGenerator, FlightHooks, attached
from mlx_kvcache.serving.engine.segments import cut_remaining
from models import V, model


def _key(n, seed=0, head=()):
    rng = random.Random(seed)
    return np.asarray(list(head) + [rng.randrange(1, 100) for _ in range(n - len(head))],
                      dtype=np.int64)


# -- the registry ---------------------------------------------------------------------------------
def test_a_request_shares_the_flight_it_has_most_in_common_with_and_nothing_unrelated():
    fl = InFlight()
    shared = _key(300, 1)
    a = fl.begin(np.concatenate([shared[:200], _key(100, 2)]), 0, model="m")
    b = fl.begin(np.concatenate([shared[:250], _key(50, 3)]), 0, model="m")
    mine = np.concatenate([shared, _key(40, 4)])
    share = fl.best(mine, 0, 16, "m")
    assert share.flight is b and share.offset == 250 and share.tokens == 250
    # what the trie gives already is not waited for; too little beyond it is not either
    b.advanced(240)
    assert fl.best(mine, 250 - MIN_SHARED, 16, "m").flight is b
    assert fl.best(mine, 250 - MIN_SHARED + 1, 16, "m") is None
    assert fl.best(_key(300, 9, head=[101]), 0, 16, "m") is None  # unrelated: never held
    assert fl.best(mine, 0, 16, "other model") is None
    assert fl.best(mine, 0, 16, "m", holds=True) is None  # neither is a batch's flight
    b.end()
    assert fl.best(mine, 0, 16, "m").flight is a and fl.running() == 1


def test_the_shared_point_stops_short_of_either_prompt_end():
    fl = InFlight()
    p = _key(200, 5)
    fl.begin(p, 0)
    assert fl.best(p, 0, 8).offset == 199  # the same prompt: a token left to compute
    assert fl.best(p[:120], 0, 8).offset == 119
    assert fl.best(np.concatenate([p, _key(30, 6)]), 0, 8).offset == 199  # the flight's end


def test_the_wait_is_bounded_by_what_computing_the_part_would_take():
    fl = InFlight()
    f = fl.begin(_key(400, 7), 0, holds=True)
    f.advanced(100)
    mine = np.concatenate([_key(400, 7)[:300], _key(20, 8)])
    # The flight needs 200 more tokens (25 steps of 8); the request would compute 300
    # itself: the 100 the flight is ahead (13 steps, one for a shortened chunk) and those.
    share = fl.best(mine, 0, 8, holds=True)
    assert share.budget == 25 + steps_for(100, 8) == 25 + 14
    # A flight behind what the trie already gives the request is not waited for.
    assert fl.best(mine, 150, 8) is None
    assert f.cut(share.offset)
    hold = fl.hold("item", share)
    assert fl.report()["holding"] == 1
    for _ in range(share.budget - 1):
        fl.prefill_step()
        f.advanced(f.at + 4)  # half a step's worth: a flight that lags
    assert hold.state(fl.steps) is None
    assert f.cut(280)  # a cut below its point, for another request, costs a step more
    fl.prefill_step()
    assert hold.state(fl.steps) is None
    fl.prefill_step()
    assert hold.state(fl.steps) == "bound"
    waited = fl.release(hold, "bound")
    assert waited.how == "bound" and fl.report()["released"]["bound"] == 1
    assert waited.note(0).endswith("as long as computing it takes: computed here")


def test_a_hold_ends_when_its_flight_stores_the_point_or_ends():
    fl = InFlight()
    f = fl.begin(_key(300, 1), 10, holds=True)
    share = fl.best(_key(300, 1)[:200], 10, 64, holds=True)
    hold = fl.hold("x", share)
    assert hold.state(fl.steps) is None
    f.advanced(199)
    assert hold.state(fl.steps) == "stored"
    g = fl.begin(_key(300, 2), 0, holds=True)
    other = fl.hold("y", fl.best(_key(300, 2)[:250], 0, 64, holds=True))
    g.end()
    assert other.state(fl.steps) == "ended" and fl.running() == 1
    assert fl.best(_key(300, 2)[:250], 0, 64) is None  # an ended flight is no one's to wait for
    w = fl.release(hold, "stored")
    assert fl.fetched(w, 199) == 189 and fl.report()["shared_tokens"] == 189
    assert "read 189 tok computed for another request" in w.note(199)


def test_a_flight_without_a_computing_side_records_the_stops_asked_for():
    fl = InFlight()
    f = fl.begin(_key(100, 3), 20)
    f.advanced(40)
    assert not f.cut(30) and not f.cut(20) and not f.cut(100)  # passed, restored, the end
    assert f.cut(70) and f.cut(50) and f.cut(70)
    assert f.stops_in(40, 99) == [50, 70] and f.stops_in(50, 60) == []
    assert fl.report()["cuts"] == 2
    f.end()
    assert not f.cut(80) and fl.report()["running"] == 0


def test_a_disabled_registry_has_no_one_to_wait_for():
    fl = InFlight(enabled=False)
    fl.begin(_key(200, 1), 0)
    assert fl.best(_key(200, 1), 0, 8) is None and fl.report()["enabled"] is False


# -- segments cut in place ----------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 9), min_size=1, max_size=6), st.integers(0, 20),
       st.integers(0, 80))
def test_a_cut_keeps_the_prompt_and_ends_a_segment_exactly_there(lengths, pos, offset):
    segments = [[pos + sum(lengths[:i]) + j for j in range(n)] for i, n in enumerate(lengths)]
    before = [t for s in segments for t in s]
    n = len(segments)
    ends, made = cut_remaining(segments, pos, offset)
    assert [t for s in segments for t in s] == before and all(segments)
    bounds = np.cumsum([len(s) for s in segments])[:-1] + pos  # ends but the prompt's
    assert ends == (offset in set(bounds.tolist()))
    assert len(segments) == n + made
    assert segments[-1] == before[-lengths[-1]:]  # the prompt's last segment is never cut


# -- mlx-lm's batch, its requests as flights ------------------------------------------------------
class _Store:
    def __init__(self):
        self.stored = []

    def __call__(self, tokens, cache):
        self.stored.append((list(tokens), cache))


def _hooks(store, anywhere=False):
    fl = InFlight()
    return FlightHooks(fl, lambda t: np.asarray(list(t), dtype=np.int64), lambda: "m", store,
                       lambda: anywhere)


def _run(gen, uids):
    """Step ``gen`` to the end; each uid's (tokens, log-probs of the tokens)."""
    out = {u: ([], []) for u in uids}
    while any(len(out[u][0]) < 4 for u in uids):
        _, gen_responses = gen.next()
        for r in gen_responses:
            out[r.uid][0].append(r.token)
            out[r.uid][1].append(float(r.logprobs[r.token]))
    return out


def _cold_logits(m, tokens):
    return m(mx.array(tokens)[None], cache=make_prompt_cache(m))[0, -1]


@pytest.mark.parametrize("kind", ["llama", "qwen3_next", "gemma3_text"])
def test_a_cut_made_while_a_request_prefills_stores_its_caches_there_exactly(kind):
    m = model(kind)
    prompt = [random.Random(11).randrange(1, V) for _ in range(90)]
    store = _Store()
    with attached(_hooks(store)):
        gen = FlightBatchGenerator(m, max_tokens=4, prefill_step_size=8, prefill_batch_size=4)
    flights = gen.hooks.flights
    # two segments of mlx-lm's own: its server stores at 30 itself
    (uid,) = gen.insert_segments([[prompt[:30], prompt[30:]]], max_tokens=[4], all_tokens=[[]])
    (flight,) = [f for f in flights._flights]
    responses = []
    for _ in range(3):
        responses += gen.next()[0]
    assert flight.at == 24 and flights.steps == 3
    assert flight.cut(61) and flight.cut(30)  # inside a segment: cut; a segment end: already
    assert flight.steps_to(61, 8) == 1 + 4  # 24 -> 30, then 31 tokens in chunks of 8
    assert not flight.cut(20)  # passed, on a model that restores only at stored states
    while flight.at < 61:
        responses += gen.next()[0]
    assert flight.at == 61 and [t for t, _ in store.stored] == [prompt[:61]]
    ends = {r.progress[0] for r in responses if r.end_of_segment}
    assert ends == {30}  # mlx-lm's own segment end stays its; the cut is ours (stored here)
    got = m(mx.array(prompt[61:70])[None], cache=store.stored[0][1])[0, -1]
    assert float(mx.max(mx.abs(got - _cold_logits(m, prompt[:70])))) < 1e-4
    out = _run(gen, [uid])
    assert flights.running() == 0  # its prompt is computed: no longer in flight
    # The same request in mlx-lm's own batch, never cut: the same answer.
    plain = BatchGenerator(m, max_tokens=4, prefill_step_size=8, prefill_batch_size=4)
    (p,) = plain.insert_segments([[prompt[:30], prompt[30:]]], max_tokens=[4], all_tokens=[[]])
    ref = _run(plain, [p])
    assert out[uid][0] == ref[p][0]
    assert np.allclose(out[uid][1], ref[p][1], atol=1e-4)


def test_a_kv_request_past_the_cut_is_stored_where_it_is_and_a_removed_one_ends():
    m = model("llama")
    prompt = [random.Random(12).randrange(1, V) for _ in range(60)]
    store = _Store()
    with attached(_hooks(store, anywhere=True)):
        gen = FlightBatchGenerator(m, max_tokens=4, prefill_step_size=8, prefill_batch_size=4)
    gen.insert_segments([[prompt]], max_tokens=[4], all_tokens=[[]])
    (uid,) = gen.insert_segments([[prompt[:1] + [5] * 50]], max_tokens=[4], all_tokens=[[]])
    a, b = gen.hooks.flights._flights
    for _ in range(3):
        gen.next()
    assert a.at == 24 and a.cut(20)  # KV layers restore anywhere: stored from 24 at once
    assert [t for t, _ in store.stored] == [prompt[:24]]
    gen.remove([uid])  # its client left
    assert b.ended and gen.hooks.flights.running() == 1


def test_a_batch_on_a_thread_without_hooks_is_mlx_lms_own():
    gen = FlightBatchGenerator(model("llama"), max_tokens=2, prefill_step_size=8)
    assert gen.hooks is None
    (uid,) = gen.insert_segments([[[1, 2, 3, 4, 5]]], max_tokens=[2], all_tokens=[[]])
    assert not gen.cut(uid, 3)
    assert _run_short(gen, uid) == 2


def _run_short(gen, uid):
    n = 0
    while True:
        _, responses = gen.next()
        for r in responses:
            n += 1
            if r.finish_reason is not None:
                return n


def test_a_cut_made_before_a_request_is_prefilled_stops_its_first_chunks_there():
    m = model("qwen3_next")
    prompt = [random.Random(13).randrange(1, V) for _ in range(40)]
    store = _Store()
    with attached(_hooks(store)):
        gen = FlightBatchGenerator(m, max_tokens=2, prefill_step_size=16, prefill_batch_size=4)
    gen.insert_segments([[prompt]], max_tokens=[2], all_tokens=[[]])
    (flight,) = gen.hooks.flights._flights
    # Inserted, not prefilled yet (two requests fetched before either prefills): a cut.
    assert flight.steps_to(21, 16) == 2 and flight.cut(21)
    gen.next()
    assert flight.at == 16 and not store.stored
    gen.next()
    assert flight.at == 21 and [t for t, _ in store.stored] == [prompt[:21]]
    got = m(mx.array(prompt[21:30])[None], cache=store.stored[0][1])[0, -1]
    assert float(mx.max(mx.abs(got - _cold_logits(m, prompt[:30])))) < 1e-4


def test_the_admission_line_shows_what_waits_without_taking_it():
    from queue import Queue

    from mlx_kvcache.serving.guards.admission import AdmissionQueue, DecodeJob
    from mlx_kvcache.serving.guards.memory import MemoryGuard

    for guard in (MemoryGuard(limit=None), MemoryGuard(limit=1 << 40)):
        q = AdmissionQueue(guard, lambda item: (10, 1), lambda item: item[1] == "cmd")
        for what in ("a", "cmd", "b"):
            q.put((Queue(), what, None))
        q.put((Queue(), DecodeJob(lambda: 1, 0), None))
        assert [item[1] for item in q.waiting()] == ["a", "b"]
        got = [q.get(timeout=1)[1] for _ in range(3)]
        assert sorted(got, key=str) == ["a", "b", "cmd"] and q.waiting() == []
