"""Requests open at once, advanced, closed and abandoned from any thread, in any order.

Every answer must equal a cold mlx-lm run (log-probs to 1e-4) and nothing wrong may enter
the trie: after each scenario the trie's invariants hold, and a clean request for every
prompt involved (restored from what the scenario stored) equals a cold run too.
"""

import gc
import random
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from models import V
from reference import (  # noqa: F401  (track_snapshots is an autouse fixture)
    MARGIN, TOK, assert_same, check_no_leaks, cold, interleaved, model, new_cache, run,
    track_snapshots,
)

NAMES = ["llama", "gemma3_text", "qwen3_next"]
N = 4  # tokens per answer


def prompts(seed, lengths, shared=6):
    rng = random.Random(seed)
    head = [rng.randrange(V) for _ in range(shared)]
    return [head + [rng.randrange(V) for _ in range(k)] for k in lengths]


def collect(gen):
    return [(r.token, r.logprobs) for r in gen]


def verify_clean(pc, m, ps):
    """The trie is sound and serves every prompt exactly as a cold run would."""
    check_no_leaks(pc)
    for p in ps:
        got, _ = run(pc, p, N)
        assert_same(cold(m, p, N), got)
        check_no_leaks(pc)


@pytest.mark.parametrize("name", NAMES)
def test_interleaved_generators_on_one_thread(name):
    """What an asyncio server streaming two answers does: alternate next() on one thread."""
    m = model(name)
    pc = new_cache(m, pre_end_margin=MARGIN, snapshot_interval=8)
    for seed, lengths in enumerate([(5, 3), (14, 9), (2, 20), (11, 11)]):
        ps = prompts(seed, lengths)
        run(pc, ps[0][:8], 2)  # something in the trie to restore from
        outs = interleaved([pc.stream_generate(TOK, p, N) for p in ps])
        for p, got in zip(ps, outs):
            assert_same(cold(m, p, N), got)
        verify_clean(pc, m, ps)


@pytest.mark.parametrize("name", NAMES)
def test_next_alternates_between_pool_threads(name):
    """A thread-pool streaming server resumes each generator on whichever worker is free."""
    m = model(name)
    pc = new_cache(m, pre_end_margin=MARGIN, snapshot_interval=8)
    ps = prompts(10, (12, 7, 17))
    gens = [pc.stream_generate(TOK, p, N) for p in ps]
    outs = [[] for _ in ps]
    pools = [ThreadPoolExecutor(1), ThreadPoolExecutor(1)]
    try:
        step, live = 0, list(range(len(ps)))
        while live:
            for i in list(live):
                r = pools[step % 2].submit(next, gens[i], None).result(timeout=60)
                step += 1
                if r is None:
                    live.remove(i)
                else:
                    outs[i].append((r.token, r.logprobs))
    finally:
        for p in pools:
            p.shutdown()
    for p, got in zip(ps, outs):
        assert_same(cold(m, p, N), got)
    verify_clean(pc, m, ps)


def in_thread(fn, timeout=60):
    """Run ``fn`` on a new thread; its result, or its exception re-raised; fail on a hang."""
    box = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as e:  # pragma: no cover - re-raised below
            box["error"] = e
    t = threading.Thread(target=target)
    t.start()
    t.join(timeout=timeout)
    assert not t.is_alive(), "blocked: a request waits on another one forever"
    if "error" in box:
        raise box["error"]
    return box.get("value")


@pytest.mark.parametrize("name", NAMES)
def test_close_and_gc_on_another_thread(name):
    """Closed, or garbage collected, on another thread: no error, no hang, work recorded,
    and requests from yet other threads go on."""
    m = model(name)
    pc = new_cache(m, pre_end_margin=MARGIN, snapshot_interval=8)
    ps = prompts(20, (15, 9))
    g = pc.stream_generate(TOK, ps[0], 10)
    got = [next(g), next(g)]
    in_thread(g.close)
    assert_same(cold(m, ps[0], 2), [(r.token, r.logprobs) for r in got])

    holder = [pc.stream_generate(TOK, ps[1], 10)]
    next(holder[0])

    def drop():
        holder.clear()
        gc.collect()
    in_thread(drop)
    # Both recorded what they computed: their prompts (and first answer tokens) restore,
    # here asked from another thread again.
    for p in ps:
        s = in_thread(lambda p=p: run(pc, p, 1)[1])
        assert s.restored_tokens >= len(p) - (1 if name == "llama" else MARGIN + 1)
    in_thread(lambda: verify_clean(pc, m, ps))


@pytest.mark.parametrize("name", NAMES)
def test_abandoned_generator_blocks_nobody(name):
    """A thread parks a half-read generator and exits; other threads keep going."""
    m = model(name)
    pc = new_cache(m, pre_end_margin=MARGIN, snapshot_interval=8)
    ps = prompts(30, (10, 13, 8, 16))
    parked = []

    def park():
        g = pc.stream_generate(TOK, ps[0], 10)
        next(g)
        parked.append(g)
    t = threading.Thread(target=park)
    t.start()
    t.join(timeout=60)
    results, errors = {}, []

    def worker(i):
        try:
            results[i] = run(pc, ps[i], N)[0]
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)
    threads = [threading.Thread(target=worker, args=(i,)) for i in (1, 2, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a request blocked behind an abandoned one"
    assert not errors, errors
    for i in (1, 2, 3):
        assert_same(cold(m, ps[i], N), results[i])
    parked.clear()  # finally abandoned for good
    gc.collect()
    verify_clean(pc, m, ps)


@pytest.mark.parametrize("name", NAMES)
def test_clear_mid_stream(name):
    """clear() while a generator is suspended: its answer stays right; nothing stale is stored."""
    m = model(name)
    pc = new_cache(m, pre_end_margin=MARGIN, snapshot_interval=8)
    ps = prompts(40, (14, 6))
    run(pc, ps[1], 2)
    g = pc.stream_generate(TOK, ps[0], N)
    got = [next(g), next(g)]
    pc.clear()
    got += list(g)
    assert_same(cold(m, ps[0], N), [(r.token, r.logprobs) for r in got])
    assert pc.stats.snapshot_bytes == 0  # the request started before the clear recorded nothing
    verify_clean(pc, m, ps)


def test_finaliser_inside_a_critical_section_is_deferred():
    """A generator finalised while its thread holds the trie (the garbage collector can run
    a finaliser anywhere) must neither deadlock nor touch the trie mid-section."""
    m = model("qwen3_next")
    pc = new_cache(m, pre_end_margin=MARGIN)
    p = prompts(50, (12,))[0]
    g = pc.stream_generate(TOK, p, 10)
    first = next(g)
    done = []

    def inside():
        before = (pc.manager.trie.nbytes, pc.manager.trie.clock)
        g.close()  # its finally runs checkin on this thread, inside this critical section
        done.append((pc.manager.trie.nbytes, pc.manager.trie.clock) == before)
    t = threading.Thread(target=lambda: pc.manager.run(inside))
    t.start()
    t.join(timeout=60)
    assert not t.is_alive(), "deadlock"
    assert done == [True]  # deferred: the trie did not change inside the section
    got, s = run(pc, p, N)  # the next section runs the deferred check-in first
    assert s.restored_tokens >= len(p) - MARGIN - 1
    assert_same(cold(m, p, N), got)
    assert first.token == got[0][0]
    verify_clean(pc, m, [p])


def test_many_threads_share_a_system_prompt():
    m = model("llama")
    pc = new_cache(m)
    ps = prompts(60, [5 + i for i in range(8)], shared=30)
    refs = [cold(m, p, N) for p in ps]
    with ThreadPoolExecutor(4) as ex:
        outs = list(ex.map(lambda p: run(pc, p, N), ps, timeout=120))
    for ref, (got, _) in zip(refs, outs):
        assert_same(ref, got)
    assert sum(s.restored_tokens for _, s in outs) >= 30 * 4  # most hit the shared head
    verify_clean(pc, m, ps[:2])
