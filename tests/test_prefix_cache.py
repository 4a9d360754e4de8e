"""PrefixCache: exact outputs vs cold mlx-lm runs, reuse bounds, dedup, budget, threads, failures."""

import random
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mlx_kvcache as mk
from mlx_kvcache.prefix.planner import guess_spacing, stops
from models import OpaqueStateCache, V, build
from reference import (  # noqa: F401  (track_snapshots is an autouse fixture)
    MARGIN, TOK, assert_same, check_no_leaks, cold, model, new_cache, run, track_snapshots,
)

# -- random multi-turn / branching workloads -------------------------------------------------
ACTIONS = st.lists(
    st.tuples(
        st.sampled_from(["extend", "extend", "branch", "repeat", "drop", "new"]),
        st.integers(1, 12),
        st.integers(0, 10**6),
    ),
    min_size=3,
    max_size=7,
)


@pytest.mark.parametrize("name", ["llama", "gemma3_text", "qwen3_next"])
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(actions=ACTIONS)
def test_random_workloads_match_cold_runs(name, actions):
    m = model(name)
    pc = new_cache(m, max_bytes=1 << 30, pre_end_margin=MARGIN, snapshot_interval=16)
    convs = [[5, 6, 7, 8, 9, 10, 11, 12]]  # every conversation shares a "system prompt"
    for action, k, seed in actions:
        rng = random.Random(seed)
        base = convs[rng.randrange(len(convs))]
        if action == "extend":
            prompt = base + [rng.randrange(V) for _ in range(k)]
        elif action == "branch":
            cut = rng.randrange(1, len(base) + 1)
            prompt = base[:cut] + [rng.randrange(V) for _ in range(k)]
        elif action == "repeat":
            prompt = list(base)
        elif action == "drop":  # drop the last turn(s)
            prompt = base[: max(1, len(base) - k)] + [rng.randrange(V)]
        else:
            prompt = [rng.randrange(V) for _ in range(k + 8)]
        ref = cold(m, prompt, 3)
        got, stats = run(pc, prompt, 3)
        assert_same(ref, got)
        assert stats.restored_tokens <= stats.matched_tokens <= len(prompt) - 1
        assert stats.restored_tokens + stats.prefilled_tokens == len(prompt)
        check_no_leaks(pc)
        convs.append(prompt + [t for t, _ in got])


# -- reuse bounds ----------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["llama", "gemma3_text", "qwen3_next", "mamba"])
def test_reuse_bounds(name):
    m = model(name)
    pc = new_cache(m, pre_end_margin=MARGIN)
    rng = random.Random(0)
    conv = [rng.randrange(V) for _ in range(30)]  # longer than gemma's window (8): it wraps
    slack = 1 if name == "llama" else MARGIN + 1
    for turn in range(3):
        got, s = run(pc, conv, 5)
        if turn:
            assert s.prefilled_tokens <= new + slack, s
        new = 7
        conv = conv + [t for t, _ in got] + [rng.randrange(V) for _ in range(new)]

    # An identical repeated prompt reprocesses one token.
    got1, _ = run(pc, conv, 4)
    got2, s = run(pc, conv, 4)
    assert s.prefilled_tokens == 1 and s.restored_tokens == len(conv) - 1
    assert_same(got1, got2)

    # A prompt diverging inside an earlier one: llama restores to the divergence point at
    # once; the others land short and schedule a branch-point snapshot that the next
    # divergence there hits — where it saves enough (`guess_spacing`), else they land
    # where they landed before.
    d = 20
    p1 = conv[:d] + [1, 2, 3]
    ref = cold(m, p1, 3)
    got, s = run(pc, p1, 3)
    assert_same(ref, got)
    assert s.matched_tokens == d
    short = s.restored_tokens
    if name == "llama":
        assert short == d and s.reason is None
    else:
        assert short < d and s.reason
    p2 = conv[:d] + [4, 5, 6]
    got, s = run(pc, p2, 3)
    assert_same(cold(m, p2, 3), got)
    branch = name == "llama" or d - short >= guess_spacing(MARGIN)
    assert s.matched_tokens == d and s.restored_tokens == (d if branch else short)
    check_no_leaks(pc)


def test_guessed_stops_are_taken_where_they_pay():
    """The branch point and the stop before the prompt's end are snapshotted only when
    they lie `guess_spacing` tokens above the restore and every other stop below them;
    the client's own marks, the interval and the last token always are."""
    gap = guess_spacing(MARGIN)
    kw = dict(whole_state=True, pre_end_margin=MARGIN, snapshot_interval=0)
    # an agent's turn: restored one token short of the branch, its input's end marked
    n = 300
    assert stops(n, 200, 201, extra=[n - 17], **kw) == [n - 17, n - 1]
    # no mark: the stop before the end pays (far above the restore)
    assert stops(n, 200, 201, **kw) == [n - MARGIN, n - 1]
    # ... unless the caller knows the next request goes on past the end (`templates`)
    assert stops(n, 200, 201, guess_end=False, **kw) == [n - 1]
    assert stops(n, 100, 100 + gap, guess_end=False, **kw) == [100 + gap, n - 1]
    # a branch far above the restore is taken
    assert stops(n, 100, 100 + gap, **kw) == [100 + gap, n - MARGIN, n - 1]
    assert stops(n, 100, 100 + gap - 1, **kw) == [n - MARGIN, n - 1]
    # ... and measured from the stops below it, not only the restore
    assert stops(n, 0, 130, extra=[120], **kw) == [120, n - MARGIN, n - 1]
    assert stops(n, 0, 130, extra=[100], **dict(kw, snapshot_interval=64)) == [
        64, 100, 128, 192, 256, n - MARGIN, n - 1]
    # a state the trie already holds counts like a stop below
    assert stops(n, 0, 130, known=[120], **kw) == [n - MARGIN, n - 1]
    assert stops(n, 0, 130, known=[100], **kw) == [130, n - MARGIN, n - 1]
    # the stop before the end, next to an interval stop
    assert stops(270, 0, 0, **dict(kw, snapshot_interval=64)) == [64, 128, 192, 256, 269]
    assert stops(290, 0, 0, **dict(kw, snapshot_interval=64)) == [64, 128, 192, 256, 286, 289]
    # KV-only models: the client's marks alone
    assert stops(n, 0, 130, extra=[120, 500], whole_state=False, pre_end_margin=MARGIN,
                 snapshot_interval=64) == [120]


@pytest.mark.parametrize("name", ["qwen3_next", "gemma3_text"])
def test_a_branch_far_above_the_restore_is_snapshotted_and_hit(name):
    m = model(name)
    pc = new_cache(m, pre_end_margin=MARGIN, snapshot_interval=0)
    rng = random.Random(1)
    conv = [rng.randrange(V) for _ in range(60)]
    run(pc, conv, 2)
    d = 40
    p1 = conv[:d] + [1, 2, 3]
    got, s = run(pc, p1, 3)
    assert_same(cold(m, p1, 3), got)
    assert s.matched_tokens == d and d - s.restored_tokens >= guess_spacing(MARGIN)
    p2 = conv[:d] + [4, 5, 6]
    got, s = run(pc, p2, 3)
    assert_same(cold(m, p2, 3), got)
    assert s.restored_tokens == d
    check_no_leaks(pc)


# -- dedup -----------------------------------------------------------------------------------
def test_shared_system_prompt_is_held_once():
    m = model("llama")
    pc = new_cache(m)
    rng = random.Random(1)
    system = [rng.randrange(V) for _ in range(200)]
    stored = set()
    for i in range(8):
        prompt = system + [rng.randrange(V) for _ in range(10)]
        got, s = run(pc, prompt, 3)
        if i:
            assert s.restored_tokens >= len(system)
        seq = prompt + [t for t, _ in got][:-1]  # the last sampled token is never fed
        stored.update(tuple(seq[:j]) for j in range(1, len(seq) + 1))
    per_token = 2 * 2 * 2 * 16 * 4  # layers * (k, v) * kv heads * head dim * float32
    ideal = len(stored) * per_token  # distinct prefixes == distinct trie positions
    assert pc.stats.snapshot_bytes <= 1.1 * ideal, (pc.stats.snapshot_bytes, ideal)
    check_no_leaks(pc)


# -- budget ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["llama", "qwen3_next"])
def test_budget_holds_and_shared_prefix_survives(name):
    m = model(name)
    budget = 40_000 if name == "llama" else 200_000
    pc = new_cache(m, max_bytes=budget, pre_end_margin=MARGIN, snapshot_interval=16)
    rng = random.Random(2)
    system = [rng.randrange(V) for _ in range(24)]
    for i in range(14):
        prompt = system + [rng.randrange(V) for _ in range(rng.randrange(4, 30))]
        got, s = run(pc, prompt, 3)
        assert_same(cold(m, prompt, 3), got)
        assert pc.nbytes <= budget
        check_no_leaks(pc)
    assert pc.stats.evicted_bytes > 0
    # The shared system prompt is still a restore point.
    _, s = run(pc, system + [1, 2, 3], 2)
    assert s.restored_tokens >= len(system) - (0 if name == "llama" else MARGIN + 1) or s.restored_tokens >= 16


# -- threads ---------------------------------------------------------------------------------
def test_threads_stay_correct():
    m = model("qwen3_next")
    pc = new_cache(m, pre_end_margin=MARGIN)
    rng = random.Random(3)
    prompts = [[1, 2, 3, 4, 5, 6] + [rng.randrange(V) for _ in range(rng.randrange(3, 12))] for _ in range(8)]
    refs = [cold(m, p, 4) for p in prompts]
    results, errors = {}, []

    def worker(idx):
        try:
            for i in idx:
                results[i] = run(pc, prompts[i], 4)[0]
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(range(j, 8, 4),)) for j in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for i, ref in enumerate(refs):
        assert_same(ref, results[i])
    check_no_leaks(pc)


# -- failures --------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["llama", "qwen3_next"])
def test_cancel_and_failures_keep_trie_valid(name):
    m = model(name)
    pc = new_cache(m, pre_end_margin=MARGIN)
    prompt = list(range(40, 80))

    # The consumer stops iterating after two tokens.
    gen = pc.stream_generate(TOK, prompt, 10)
    next(gen), next(gen)
    gen.close()
    check_no_leaks(pc)

    # A logits processor raises mid-generation; then a KeyboardInterrupt.
    for exc in (RuntimeError("boom"), KeyboardInterrupt()):
        calls = []

        def proc(tokens, logits, exc=exc):
            calls.append(1)
            if len(calls) == 3:
                raise exc
            return logits

        with pytest.raises(type(exc)):
            list(pc.stream_generate(TOK, prompt + [1, 2], 10, logits_processors=[proc]))
        check_no_leaks(pc)

    # The next request works and hits the snapshots already taken.
    got, s = run(pc, prompt + [3], 4)
    assert_same(cold(m, prompt + [3], 4), got)
    assert s.restored_tokens >= len(prompt) - MARGIN - 1
    check_no_leaks(pc)



def test_unsnapshottable_cache_state_warns_and_still_generates(tmp_path):
    from mlx_kvcache.prefix.null import NullManager
    m = build("llama")
    m.make_cache = lambda: [OpaqueStateCache() for _ in m.layers]
    with pytest.warns(RuntimeWarning, match="cannot be reused") as told:
        pc = mk.PrefixCache(m, cache_dir=str(tmp_path / "c"))
    assert len(told) == 1  # no disk tier was tried: nothing is ever stored
    assert isinstance(pc.manager, NullManager) and pc.store is None
    for _ in range(2):  # caching off: the repeat computes its whole prompt again
        rs = list(pc.stream_generate(TOK, [1, 2, 3, 4], 3))
        assert rs[-1].cache.reason and "OpaqueStateCache" in rs[-1].cache.reason
        assert rs[-1].cache.prefilled_tokens == 4 and rs[-1].cache.restored_tokens == 0
        assert rs[-1].cache.reuse is None and rs[-1].cache.cache_bytes == 0
    s = pc.stats
    assert (s.nodes, s.bytes_held, s.snapshot_bytes, s.live_bytes, s.disk_bytes) == (0, 0, 0, 0, 0)
    assert s.requests == 2 and pc.nbytes == 0
    assert pc.save() == 0 and pc.load() == 0 and not (tmp_path / "c").exists()
    pc.clear()
    assert pc.stats.nodes == 0


def test_prompt_as_text_and_generate():
    m = model("llama")
    pc = new_cache(m)
    with pytest.raises(ValueError):
        list(pc.stream_generate(TOK, [], 3))
    with pytest.raises(ValueError):
        pc.generate(TOK, [1, 2], 0)
    text = pc.generate(TOK, [1, 2, 3], 3)
    assert text.count("<") == 3
    assert pc.last_request.generated_tokens == 3


def test_snapshot_at_message_boundaries_makes_first_divergence_exact():
    m = model("qwen3_next")
    pc = new_cache(m, pre_end_margin=MARGIN)
    rng = random.Random(4)
    conv = [rng.randrange(V) for _ in range(40)]
    run(pc, conv, 3, snapshot_at=[20])
    p = conv[:20] + [1, 2, 3]
    got, s = run(pc, p, 3)
    assert_same(cold(m, p, 3), got)
    assert s.matched_tokens == 20 and s.restored_tokens == 20 and s.reason is None
    check_no_leaks(pc)


@pytest.mark.parametrize("name", ["llama", "qwen3_next"])
def test_interrupt_right_after_a_forward_keeps_its_work(name):
    """A KeyboardInterrupt between the forward pass and its bookkeeping loses nothing."""
    m = model(name)
    pc = new_cache(m, pre_end_margin=MARGIN)
    prompt = list(range(10, 50))
    real = pc.model

    class Interrupting:
        def __call__(self, *a, **k):
            out = real(*a, **k)
            raise KeyboardInterrupt

    pc.model = Interrupting()
    with pytest.raises(KeyboardInterrupt):
        list(pc.stream_generate(TOK, prompt, 4))
    pc.model = real
    check_no_leaks(pc)
    got, s = run(pc, prompt, 4)
    # The interrupted (first) prefill chunk was recorded: it ends at the prompt end - 1,
    # or at the pre-end snapshot stop on the hybrid model.
    assert s.prefilled_tokens == (1 if name == "llama" else MARGIN)
    assert_same(cold(m, prompt, 4), got)


def test_prefill_step_size_is_per_request():
    m = model("llama")
    pc = new_cache(m, prefill_step_size=64)
    prompt = list(range(1, 40))
    got, _ = run(pc, prompt, 3, prefill_step_size=7)
    assert pc.prefill_step_size == 64  # the request's value did not stick
    assert_same(cold(m, prompt, 3), got)
