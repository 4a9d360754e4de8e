"""Speculative decoding with `PrefixCache(model, draft_model=...)` on every cache kind.

Greedy output must be the target's own (compared with a cold mlx-lm run: tokens and
log-probs to 1e-4), over many rounds with accepts and rejects (noisy-copy drafts) and
with full acceptance (an identical draft); what the request leaves in the trie must equal
a cold run for *both* models; sampling must give the target's distribution.
"""

import math
import random
import warnings
from collections import Counter

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step, speculative_generate_step
from mlx_lm.models.cache import make_prompt_cache as mlx_make_prompt_cache
from mlx_lm.sample_utils import make_logits_processors, make_sampler

import mlx_kvcache as mk
import mlx_kvcache.testing
from mlx_kvcache.testing import noisy_copy
from models import OpaqueStateCache, V, build
from reference import (  # noqa: F401  (track_snapshots is an autouse fixture)
    FLOAT_TOL, MARGIN, TOK, assert_same, check_no_leaks, cold, model, new_cache, run,
    track_snapshots,
)

NAMES = ["llama", "gemma3_text", "qwen3_next", "mamba"]
# Noise that gives partial acceptance with these prompts. Random llama and mamba models echo
# their input token; a repetition penalty makes their greedy output vary (and covers logits
# processors). gemma's prompt is shorter than its window (8): it wraps while generating.
CASES = {
    "llama": dict(sigma=0.1, prompt_seed=0, length=5, penalty=True),
    "gemma3_text": dict(sigma=0.02, prompt_seed=0, length=5, penalty=False),
    "qwen3_next": dict(sigma=0.01, prompt_seed=0, length=5, penalty=False),
    "mamba": dict(sigma=0.1, prompt_seed=0, length=6, penalty=True),
}
N = 40  # generated tokens


def case(name):
    c = CASES[name]
    rng = random.Random(c["prompt_seed"])
    prompt = [rng.randrange(V) for _ in range(c["length"])]
    procs = make_logits_processors(repetition_penalty=3.0, repetition_context_size=8) \
        if c["penalty"] else []
    return prompt, procs, c["sigma"]


def cold_with(m, prompt, max_tokens, procs=()):
    """Greedy tokens and log-probs of mlx-lm's generate_step on fresh caches."""
    gen = generate_step(mx.array(prompt), m, prompt_cache=mlx_make_prompt_cache(m),
                        max_tokens=max_tokens, logits_processors=list(procs) or None)
    return [(int(t), lp) for t, lp in gen]


def spec_run(pc, prompt, max_tokens, **kw):
    rs = list(pc.stream_generate(TOK, prompt, max_tokens, **kw))
    return [(r.token, r.logprobs) for r in rs], rs


def cold_logits(m, tokens):
    """Last-position log-probs of a cold mlx-lm forward over ``tokens``."""
    out = m(mx.array(tokens)[None], cache=mlx_make_prompt_cache(m))[0, -1]
    return out - mx.logsumexp(out)


# -- greedy: token for token the target's output -----------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_greedy_output_is_the_targets(name):
    m = model(name)
    prompt, procs, sigma = case(name)
    ref = cold_with(m, prompt, N, procs)
    if name in ("qwen3_next", "mamba"):  # where mlx-lm's own speculative decoding refuses
        with pytest.raises(ValueError, match="trimmable"):
            next(speculative_generate_step(mx.array(prompt), m, build(name)))
    for s in (sigma, 0.0):
        pc = new_cache(m, draft_model=noisy_copy(name, s), num_draft_tokens=4)
        got, rs = spec_run(pc, prompt, N, logits_processors=procs)
        assert_same(ref, got)
        st = rs[-1].cache
        assert sum(r.from_draft for r in rs) == st.accepted_tokens
        assert st.target_passes < N
        if s:  # partial acceptance: rejected drafts rolled back, every layer kind
            assert 0 < st.accepted_tokens < st.drafted_tokens, st
            if name != "llama":  # a recurrent layer or a wrapped window was restored
                assert st.replayed_tokens > 0, st
        else:  # an identical draft: everything accepted, nothing replayed
            assert st.accepted_tokens == st.drafted_tokens > 0 and st.replayed_tokens == 0
            assert st.target_passes <= math.ceil(N / 5) + 1
        check_no_leaks(pc)


# -- rounds that draft fewer tokens, or none (the draft left behind catches up) -----------------
class Scripted:
    """A draft length that follows a script (capped by what the round allows), to reach
    every transition: drafting after rounds without, a long lag, drafting every round."""

    def __init__(self, script):
        self.script, self.i, self.seen = list(script), 0, []

    def next(self, most):
        k = min(most, self.script[self.i % len(self.script)])
        self.i += 1
        return k

    def observe(self, proposed, accepted):
        self.seen.append((proposed, accepted))


SCRIPT = [3, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 4, 2, 0, 4]  # a lag past 2 * (k + 1) too


@pytest.mark.parametrize("name", NAMES)
def test_rounds_without_drafts_keep_output_and_trie_exact(name):
    m = model(name)
    prompt, procs, sigma = case(name)
    ref = cold_with(m, prompt, N, procs)
    pc = new_cache(m, draft_model=noisy_copy(name, sigma), num_draft_tokens=4,
                   pre_end_margin=MARGIN)
    pc.draft_length = Scripted(SCRIPT)
    got, rs = spec_run(pc, prompt, N, logits_processors=procs)
    assert_same(ref, got)
    st = rs[-1].cache
    assert 0 < st.accepted_tokens < st.drafted_tokens < 4 * N // 2, st
    assert [p for p, _ in pc.draft_length.seen][:4] == [3, 0, 0, 1]
    assert sum(a for _, a in pc.draft_length.seen) == st.accepted_tokens
    # Both models hold every emitted token but the last, as plain decoding records it.
    seq = prompt + [t for t, _ in got]
    plan = check_restored_state(pc, seq[:-1] + [3])
    assert plan.restored == len(seq) - 1, plan
    check_no_leaks(pc)
    # Closed mid-answer while the draft lags: what is stored is still exact.
    pc2 = new_cache(m, draft_model=noisy_copy(name, sigma), num_draft_tokens=4,
                    pre_end_margin=MARGIN)
    pc2.draft_length = Scripted([0])
    gen = pc2.stream_generate(TOK, prompt, N, logits_processors=procs)
    part = [(r.token, r.logprobs) for _, r in zip(range(7), gen)]
    gen.close()
    assert_same(ref[:7], part)
    check_restored_state(pc2, seq[: len(prompt) + 7] + [5])
    check_no_leaks(pc2)


def test_adaptive_policy_sets_aside_a_draft_as_large_as_the_target():
    """The default policy: a same-size draft could never pay for itself, so it is not used
    at all (a warning says why): answers and log-probs are plain decoding's, the trie
    holds the target's layers only, and the draft may still be passed per request."""
    name = "qwen3_next"
    m = model(name)
    prompt, procs, sigma = case(name)
    draft = noisy_copy(name, sigma)
    with pytest.warns(RuntimeWarning, match="the draft model is not used: a step of the draft "
                      "model costs 1.00 of a step of the model"):
        pc = mk.PrefixCache(m, draft_model=draft, num_draft_tokens=4, pre_end_margin=MARGIN)
    assert "never pay" in pc.draft_set_aside
    assert pc.draft_model is None and pc.draft_length is None
    got, rs = spec_run(pc, prompt, 12, logits_processors=procs, draft_model=draft)
    assert_same(cold_with(m, prompt, 12, procs), got)
    assert rs[-1].cache.drafted_tokens == 0 and not any(r.from_draft for r in rs)
    seq = prompt + [t for t, _ in got]
    assert check_restored_state(pc, seq[:-1] + [2]).restored == len(seq) - 1
    live, _ = pc.manager.checkout(seq[:4])
    assert len(live.caches) == pc.target_entries == len(mlx_make_prompt_cache(m))  # no draft
    pc.manager.checkin(live, [])
    with pytest.raises(ValueError, match="is not the draft model"):
        spec_run(pc, prompt, 2, draft_model=noisy_copy(name, sigma))
    fixed = mk.PrefixCache(m, draft_model=draft, draft_policy="fixed")
    assert fixed.draft_length is None and fixed.draft_set_aside is None
    assert fixed.draft_model is draft


# -- what the trie holds afterwards: both models equal cold runs -------------------------------
def check_restored_state(pc, tokens):
    """Restore ``tokens`` from the trie into a live set, feed both models the rest, and
    compare each model's next-token log-probs with a cold run over all of ``tokens``
    (on the cache's engine thread, where its arrays live)."""
    mgr = pc.manager
    live, plan = mgr.checkout(tokens)

    def compare():
        rest = mx.array(tokens[plan.restored:])[None]
        parts = (live.caches[: pc.target_entries], live.caches[pc.target_entries:])
        diffs = []
        for m, caches in zip((pc.model, pc.draft_model), parts):
            if m is None:  # no draft model in use
                continue
            out = m(rest, cache=caches)[0, -1]
            mk.settle(caches, rest.shape[1])
            diffs.append(mx.abs(out - mx.logsumexp(out) - cold_logits(m, tokens)).max().item())
        return diffs

    fed = list(tokens[: plan.restored])
    try:
        diffs = pc._engine.run(compare)
        fed = list(tokens)
    finally:
        mgr.checkin(live, fed)
    assert max(diffs) < FLOAT_TOL, diffs
    return plan


@pytest.mark.parametrize("name", NAMES)
def test_caches_after_generation_equal_a_cold_run(name):
    m = model(name)
    prompt, procs, sigma = case(name)
    pc = new_cache(m, draft_model=noisy_copy(name, sigma), num_draft_tokens=4,
                   pre_end_margin=MARGIN)
    got, rs = spec_run(pc, prompt, N, logits_processors=procs)
    assert rs[-1].cache.replayed_tokens > 0 or name == "llama"
    seq = prompt + [t for t, _ in got]
    # The whole answer (less its last token, never fed) is in the trie, for both models.
    plan = check_restored_state(pc, seq[:-1] + [7])
    assert plan.restored >= len(seq) - 1 - (0 if name == "llama" else MARGIN + 1), plan
    # A follow-up request on the same cache answers as a cold run does.
    follow = seq + [3, 1, 4]
    got2, rs2 = spec_run(pc, follow, 6)
    assert_same(cold(m, follow, 6), got2)
    assert rs2[-1].cache.restored_tokens >= len(seq) - 1 - (0 if name == "llama" else MARGIN + 1)
    check_no_leaks(pc)

    # An end-of-sequence token accepted inside a round (more drafts after it): the models
    # rewind (or return to their checkpoint and replay) to all but that last token.
    j = next(i for i in range(8, N - 1) if rs[i].from_draft and rs[i + 1].from_draft
             and rs[i].token not in seq[: len(prompt) + i])
    pc = new_cache(m, draft_model=noisy_copy(name, sigma), num_draft_tokens=4,
                   pre_end_margin=MARGIN)
    eos_tok = mk.testing.TokenIdTokenizer(eos=[rs[j].token])
    rs3 = list(pc.stream_generate(eos_tok, prompt, N, logits_processors=procs))
    assert [r.token for r in rs3] == seq[len(prompt): len(prompt) + j + 1]
    assert rs3[-1].finish_reason == "stop"
    plan = check_restored_state(pc, seq[: len(prompt) + j] + [7])
    assert plan.restored == len(prompt) + j, plan  # what plain decoding would have recorded
    check_no_leaks(pc)


def test_identical_draft_keeps_accepting_after_restores():
    """The draft's own caches come back from the trie exactly: an identical draft still
    agrees with the target on every token of a follow-up request."""
    name = "qwen3_next"
    m = model(name)
    pc = new_cache(m, draft_model=noisy_copy(name, 0.0), num_draft_tokens=3, pre_end_margin=MARGIN)
    prompt, _, _ = case(name)
    got, _ = spec_run(pc, prompt, 20)
    follow = prompt + [t for t, _ in got] + [9, 8, 7]
    got2, rs2 = spec_run(pc, follow, 20)
    st = rs2[-1].cache
    assert st.restored_tokens > len(prompt) and st.accepted_tokens == st.drafted_tokens > 0
    assert_same(cold(m, follow, 20), got2)


# -- a hit skips prefill on both models; the budget counts both --------------------------------
class Counting:
    """A model wrapper counting the tokens fed to it."""

    def __init__(self, m):
        self.m, self.fed = m, 0

    def __call__(self, x, cache=None):
        self.fed += x.shape[1]
        return self.m(x, cache=cache)


@pytest.mark.parametrize("name", ["llama", "qwen3_next"])
def test_hit_skips_prefill_on_both_models(name):
    m = model(name)
    draft = noisy_copy(name, 0.0)
    pc = new_cache(m, draft_model=draft, num_draft_tokens=3, pre_end_margin=MARGIN)
    prompt = list(range(20, 60))
    pc.draft_model = counting = Counting(draft)
    got1, rs1 = spec_run(pc, prompt, 4)
    assert counting.fed >= len(prompt)
    counting.fed = 0
    got2, rs2 = spec_run(pc, prompt, 4)
    st = rs2[-1].cache
    assert st.restored_tokens == len(prompt) - 1 and st.prefilled_tokens == 1
    assert counting.fed <= 1 + st.drafted_tokens  # the last prompt token, then its drafts
    assert_same(got1, got2)
    pc.draft_model = draft
    # Every node holds both models' layers; the bytes held count both.
    n_target = len(mk.leaf_caches(mk.make_prompt_cache(m)))
    n_draft = len(mk.leaf_caches(mk.make_prompt_cache(draft)))
    nodes = list(pc.manager.trie.nodes())
    assert nodes and all(len(nd.snapshots) == n_target + n_draft for nd in nodes)
    assert all(nd.snapshots[n_target + i] is not None for nd in nodes for i in range(n_draft)
               if nd.snapshots[i] is not None)
    check_no_leaks(pc)
    plain = new_cache(m, pre_end_margin=MARGIN)
    spec_run(plain, prompt, 4)
    spec_run(plain, prompt, 4)
    assert pc.nbytes >= 1.9 * plain.nbytes  # the draft is as large as the target


def test_budget_holds_with_a_draft():
    m = model("qwen3_next")
    budget = 150_000
    pc = new_cache(m, draft_model=noisy_copy("qwen3_next", 0.01), max_bytes=budget,
                   pre_end_margin=MARGIN, snapshot_interval=16)
    rng = random.Random(2)
    system = [rng.randrange(V) for _ in range(24)]
    for i in range(8):
        prompt = system + [rng.randrange(V) for _ in range(rng.randrange(4, 30))]
        got, _ = spec_run(pc, prompt, 6)
        assert_same(cold(m, prompt, 6), got)
        assert pc.nbytes <= budget
        check_no_leaks(pc)
    assert pc.stats.evicted_bytes > 0


# -- interrupted mid-stream -----------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_closed_mid_stream_keeps_the_trie_correct(name):
    m = model(name)
    prompt, procs, sigma = case(name)
    pc = new_cache(m, draft_model=noisy_copy(name, sigma), num_draft_tokens=4,
                   pre_end_margin=MARGIN, snapshot_interval=8)
    for after in (1, 3, 6, 11):
        gen = pc.stream_generate(TOK, prompt, N, logits_processors=procs)
        seen = [next(gen).token for _ in range(after)]
        gen.close()
        check_no_leaks(pc)
        follow = prompt + seen + [5, 6]
        got, _ = spec_run(pc, follow, 4)
        assert_same(cold(m, follow, 4), got)
        check_restored_state(pc, follow)
        check_no_leaks(pc)
    got, _ = spec_run(pc, prompt, N, logits_processors=procs)
    assert_same(cold_with(m, prompt, N, procs), got)


class Failing:
    """A model wrapper whose ``fail_at``-th call raises: before the model runs, or after
    it wrote every layer but before the request's bookkeeping saw it."""

    def __init__(self, m, fail_at, after):
        self.m, self.calls, self.fail_at, self.after = m, 0, fail_at, after

    def __call__(self, x, cache=None):
        self.calls += 1
        if self.calls == self.fail_at and not self.after:
            raise RuntimeError("boom")
        out = self.m(x, cache=cache)
        if self.calls == self.fail_at:
            raise RuntimeError("boom")
        return out


@pytest.mark.parametrize("name", ["llama", "qwen3_next"])
@pytest.mark.parametrize("which", ["draft", "target"])
@pytest.mark.parametrize("after", [False, True])
def test_a_failing_pass_keeps_the_trie_correct(name, which, after):
    m = model(name)
    prompt, _, sigma = case(name)
    draft = noisy_copy(name, sigma)
    pc = new_cache(m, draft_model=draft, num_draft_tokens=3, pre_end_margin=MARGIN)
    # Calls: the prefill (one chunk) once for each model, then one per draft step or
    # verify pass: fail a few rounds in.
    if which == "draft":
        pc.draft_model = Failing(draft, 8, after)
    else:
        pc.model = Failing(m, 4, after)
    with pytest.raises(RuntimeError, match="boom"):
        list(pc.stream_generate(TOK, prompt, N))
    pc.model, pc.draft_model = m, draft
    check_no_leaks(pc)
    for p in (prompt, prompt + [1, 2, 3]):
        got, _ = spec_run(pc, p, 6)
        assert_same(cold(m, p, 6), got)
        check_restored_state(pc, p)
    check_no_leaks(pc)


# -- sampling: the target's distribution ---------------------------------------------------
def tiny_vocab_model(seed, vocab):
    m = build("llama", seed=seed, vocab_size=vocab, hidden_size=16, num_hidden_layers=1,
              intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
              tie_word_embeddings=False)
    return m


def joint(m, prompt, vocab, depth):
    """Exact probability of every ``depth``-token continuation under ``m``."""
    out = {(): 1.0}
    for _ in range(depth):
        nxt = {}
        for seq, p in out.items():
            lp = cold_logits(m, prompt + list(seq)).tolist()
            for t in range(vocab):
                nxt[seq + (t,)] = p * math.exp(lp[t])
        out = nxt
    return out


def l1_bound(cells, n, delta=1e-6):
    """The L1 distance an empirical distribution of ``n`` draws over ``cells`` outcomes
    exceeds with probability at most ``delta``: P(|p_hat - p|_1 >= e) <= (2^cells - 2)
    exp(-n e^2 / 2) (Weissman et al. 2003) — exact for any n, not asymptotic."""
    return math.sqrt(2 * (cells * math.log(2) + math.log(1 / delta)) / n)


def sampled(pc, prompt, depth, n, sampler):
    """``n`` answers of ``depth`` tokens sampled from ``pc`` after ``prompt``: how often
    each continuation came, and the proposals drafted and accepted over all of them."""
    counts, drafted, accepted = Counter(), 0, 0
    for _ in range(n):
        rs = list(pc.stream_generate(TOK, prompt, depth, sampler=sampler))
        counts[tuple(r.token for r in rs)] += 1
        drafted += rs[-1].cache.drafted_tokens
        accepted += rs[-1].cache.accepted_tokens
    return counts, drafted, accepted


def test_sampling_gives_the_targets_distribution():
    vocab, depth, n = 3, 3, 1000
    target, draft = tiny_vocab_model(1, vocab), tiny_vocab_model(2, vocab)
    prompt = [0, 1, 2, 1]
    p_target, p_draft = joint(target, prompt, vocab, depth), joint(draft, prompt, vocab, depth)
    eps = l1_bound(len(p_target), n)
    # The draft's distribution is far enough from the target's that a rule emitting the
    # draft's tokens would be caught (shown on draws from the draft below).
    assert sum(abs(p_target[k] - p_draft[k]) for k in p_target) > 2.5 * eps

    pc = new_cache(target, draft_model=draft, num_draft_tokens=2)
    pc.seed(1234)
    counts, drafted, accepted = sampled(pc, prompt, depth, n, make_sampler(temp=1.0))
    assert 0 < accepted < drafted  # both branches of the acceptance rule ran
    l1 = sum(abs(counts[k] / n - p) for k, p in p_target.items())
    assert l1 < eps, (l1, eps)

    # The same statistic rejects draws from the draft's distribution.
    keys = list(p_draft)
    rng = np.random.default_rng(0)
    draws = rng.choice(len(keys), size=n, p=np.array([p_draft[k] for k in keys]) /
                       sum(p_draft.values()))
    wrong = Counter(keys[i] for i in draws)
    assert sum(abs(wrong[k] / n - p_target[k]) for k in keys) > eps


# -- arguments, persistence, caches the trie cannot hold ------------------------------------
def test_bad_draft_arguments_are_named_and_change_nothing():
    m = model("llama")
    d = noisy_copy("llama", 0.1)
    with pytest.raises(ValueError, match="target model itself"):
        mk.PrefixCache(m, draft_model=m)
    with warnings.catch_warnings():  # the error alone: no "draft not used" warning first
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match="num_draft_tokens must be >= 0"):
            mk.PrefixCache(m, draft_model=d, num_draft_tokens=-1)
    with pytest.raises(ValueError, match="draft_policy must be one of adaptive, fixed, got 'often'"):
        mk.PrefixCache(m, draft_model=d, draft_policy="often")
    plain = new_cache(m)
    with pytest.raises(ValueError, match="construct PrefixCache"):
        plain.stream_generate(TOK, [1, 2, 3], 3, draft_model=d)
    pc = new_cache(m, draft_model=d)
    with pytest.raises(ValueError, match="not the draft model"):
        pc.stream_generate(TOK, [1, 2, 3], 3, draft_model=noisy_copy("llama", 0.2))
    with pytest.raises(TypeError, match="num_draft_tokens must be an int"):
        pc.stream_generate(TOK, [1, 2, 3], 3, num_draft_tokens="3")
    assert pc.stats.requests == 0 and pc.nbytes == 0
    got, rs = spec_run(pc, [1, 2, 3], 5, draft_model=d, num_draft_tokens=0)
    assert_same(cold(m, [1, 2, 3], 5), got)
    assert rs[-1].cache.drafted_tokens == 0 and rs[-1].cache.target_passes == 5
    check_no_leaks(pc)


def test_persisted_cache_is_keyed_on_both_models(tmp_path):
    m = model("qwen3_next")
    d1, d2 = noisy_copy("qwen3_next", 0.01), noisy_copy("qwen3_next", 0.02)
    prompt = list(range(30, 60))
    # (fixed: these drafts are as large as their target, which adaptive sets aside)
    pc = mk.PrefixCache(m, draft_model=d1, cache_dir=str(tmp_path), pre_end_margin=MARGIN,
                        draft_policy="fixed")
    spec_run(pc, prompt, 4)
    pc.close()
    others = [mk.PrefixCache(m, cache_dir=str(tmp_path)),
              mk.PrefixCache(m, draft_model=d2, cache_dir=str(tmp_path), draft_policy="fixed")]
    paths = {str(pc.cache_path)} | {str(o.cache_path) for o in others}
    assert len(paths) == 3
    for o in others:
        assert o.stats.nodes == 0
        o.close()
    again = mk.PrefixCache(m, draft_model=d1, cache_dir=str(tmp_path), pre_end_margin=MARGIN,
                           draft_policy="fixed")
    got, rs = spec_run(again, prompt, 4)
    assert rs[-1].cache.restored_tokens >= len(prompt) - MARGIN - 1
    assert_same(cold(m, prompt, 4), got)
    again.close()



def test_draft_with_caches_the_trie_cannot_hold():
    """Without the prefix cache (a cache kind it refuses), speculation still works."""
    m = build("llama")
    m.make_cache = lambda: [OpaqueStateCache() for _ in m.layers]
    d = noisy_copy("llama", 0.1)
    with pytest.warns(RuntimeWarning, match="cannot be reused"):
        pc = mk.PrefixCache(m, draft_model=d, num_draft_tokens=3, draft_policy="fixed")
    prompt, procs, _ = case("llama")
    got, rs = spec_run(pc, prompt, 20, logits_processors=procs)
    assert_same(cold_with(build("llama"), prompt, 20, procs), got)
    assert 0 < rs[-1].cache.accepted_tokens < rs[-1].cache.drafted_tokens


# -- concurrency: speculative requests interleaved and closed from other threads --------------
def test_interleaved_and_closed_on_other_threads():
    import threading

    name = "qwen3_next"
    m = model(name)
    pc = new_cache(m, draft_model=noisy_copy(name, 0.01), num_draft_tokens=3,
                   pre_end_margin=MARGIN, snapshot_interval=8)
    rng = random.Random(7)
    head = [rng.randrange(V) for _ in range(6)]
    ps = [head + [rng.randrange(V) for _ in range(k)] for k in (9, 14, 4)]
    gens = [pc.stream_generate(TOK, p, 12) for p in ps]
    outs = [[] for _ in ps]
    for _ in range(5):  # alternate next() between the three on this thread
        for g, o in zip(gens, outs):
            r = next(g)
            o.append((r.token, r.logprobs))
    t = threading.Thread(target=gens[1].close)  # one closed from another thread
    t.start()
    t.join(30)
    assert not t.is_alive()
    for i in (0, 2):  # the others finish on a third thread
        th = threading.Thread(target=lambda i=i: outs[i].extend((r.token, r.logprobs) for r in gens[i]))
        th.start()
        th.join(60)
        assert not th.is_alive()
    for i, p in enumerate(ps):
        n = len(outs[i])
        assert n == (5 if i == 1 else 12)
        assert_same(cold(m, p, n), outs[i])
    check_no_leaks(pc)
    for p, o in zip(ps, outs):
        follow = p + [t for t, _ in o] + [1]
        got, _ = spec_run(pc, follow, 3)
        assert_same(cold(m, follow, 3), got)
        check_restored_state(pc, follow)
    check_no_leaks(pc)


@pytest.mark.parametrize("draft_vocab", [V - 28, V + 8])
def test_draft_with_another_vocabulary_size(draft_vocab):
    """A smaller draft vocabulary: ids it lacks (in the prompt, or emitted by the target)
    reach it clamped, never as an out-of-range lookup; a larger one never proposes an id
    the target lacks. Either way the output is the target's."""
    m = model("llama")
    draft = build("llama", seed=3, vocab_size=draft_vocab)
    pc = new_cache(m, draft_model=draft, num_draft_tokens=3)

    class Checking:  # records the largest id the draft is fed (MLX does not bound-check)
        largest = 0

        def __call__(self, x, cache=None):
            Checking.largest = max(Checking.largest, mx.max(x).item())
            return draft(x, cache=cache)

    pc.draft_model = Checking()
    prompt, procs, _ = case("llama")
    prompt = prompt + [V - 1, V - 2, V - 3]  # ids past a smaller draft's vocabulary
    widths = set()

    def width(tokens, logits):  # processors index logits by history ids: the target's width
        widths.add(logits.shape[-1])
        return logits

    got, rs = spec_run(pc, prompt, 30, logits_processors=procs + [width])
    assert_same(cold_with(m, prompt, 30, procs), got)
    assert rs[-1].cache.drafted_tokens > 0
    assert Checking.largest < draft_vocab and widths == {V}
    check_no_leaks(pc)


# -- with kv_bits: the switch stays exactly at quantized_kv_start ------------------------------

@pytest.mark.parametrize("start", [9, 28, 33])
def test_kv_bits_switch_is_where_plain_decoding_puts_it(start):
    """With a draft and ``kv_bits``, no pass spans the switch (drafts stay below it, a carry
    crossing it is fed in two passes), so the answer equals the canonical cold run: the
    switch inside the prefill (9) and during decoding (28, 33), a follow-up request restored
    from the trie too. A pass spanning the switch is off by ~7e-3 here."""
    from test_kv_quant import BITS, GROUP, canonical

    m = build("llama", head_dim=32)
    d = noisy_copy("llama", 0.05, head_dim=32)
    rng = random.Random(start)
    prompt = [rng.randrange(V) for _ in range(20)]
    pc = mk.PrefixCache(m, draft_model=d, num_draft_tokens=4, kv_bits=BITS, kv_group_size=GROUP,
                        quantized_kv_start=start, draft_policy="fixed")
    got, rs = spec_run(pc, prompt, 30)
    assert_same(canonical(m, prompt, 30, start), got)
    st = rs[-1].cache
    assert 0 < st.accepted_tokens <= st.drafted_tokens
    follow = prompt + [t for t, _ in got] + [rng.randrange(V) for _ in range(5)]
    got2, rs2 = spec_run(pc, follow, 6)
    assert rs2[-1].cache.restored_tokens > start
    # The follow-up's reused rows past the prompt were computed in verify passes, not
    # one-token passes: identical here (no quantization step flips), checked against the
    # canonical run that feeds the whole follow-up prompt cold.
    assert_same(canonical(m, follow, 6, start), got2)
    check_no_leaks(pc)


# -- each layer kind's rollback rule (caches/rollback.py) -----------------------------------
def test_each_layer_kind_rolls_back_by_its_own_rule():
    """Ours answer for themselves; mlx-lm's classes (caching off) are adapted in caches/:
    a window needs a checkpoint once a pass would wrap it, KV rewinds live, a recurrent
    state only comes back whole — the same answers for our class and mlx-lm's."""
    from mlx_lm.models import cache as mlc

    from mlx_kvcache import caches
    from mlx_kvcache.caches.rollback import ForeignRollback, layers_of, rollback_of

    def fed(c, n):
        c.update_and_fetch(mx.ones((1, 2, n, 4)), mx.ones((1, 2, n, 4)))
        return c

    for ours, theirs in ((fed(caches.KVCache(), 5), fed(mlc.KVCache(), 5)),
                         (fed(caches.RotatingKVCache(8), 5), fed(mlc.RotatingKVCache(8), 5))):
        assert rollback_of(ours) is ours and isinstance(rollback_of(theirs), ForeignRollback)
        window = isinstance(ours, caches.RotatingKVCache)
        for c in (ours, theirs):
            r = rollback_of(c)
            assert r.rewinds_live()
            assert r.needs_checkpoint(3) is False and r.needs_checkpoint(4) is window
            assert not r.rewind(6) and r.rewind(3) and c.offset == 3
    for c in (caches.RecurrentCache(2), mlc.ArraysCache(2)):
        r = rollback_of(c)
        c[0] = mx.zeros((1, 3))
        c.advance(1)
        assert not r.rewinds_live() and r.needs_checkpoint(0)
        point = r.rollback_point()
        c[0] = mx.ones((1, 3))
        c.advance(1)
        assert r.return_to(point, 1) and c[0].sum().item() == 0
    inner = [mlc.KVCache(), caches.RecurrentCache(2)]
    assert layers_of([mlc.CacheList(*inner), mlc.KVCache()])[:2] == inner
