"""Prompt-lookup decoding (`generation.lookup`, `speculative`): the drafter, its length
policy, and exactness on every cache kind.

Greedy output must be plain decoding's (a cold mlx-lm run: tokens and log-probs to 1e-4)
whatever is proposed; with proposals partly rejected at chosen positions (scripted:
`proposals`) — at a window's wrap, inside a recurrent layer's pass, around a chunked
attention's chunk, across the kv_bits switch — the caches and what the trie keeps equal
a cold run's; sampling keeps the model's distribution.
"""

import math
import random
from collections import Counter

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs
from mlx_lm.sample_utils import make_logits_processors, make_sampler

import mlx_kvcache as mk
from mlx_kvcache.generation.draft_length import LookupLength, LookupTally
from mlx_kvcache.generation.lookup import LookupPlan, PromptLookup
from mlx_kvcache.generation.pass_cost import PassCost
from models import V, build
from proposals import VerifyAll, scripted
from reference import (  # noqa: F401  (track_snapshots is an autouse fixture)
    MARGIN, TOK, assert_same, check_no_leaks, cold, model, new_cache, track_snapshots,
)
from test_speculative import (check_restored_state, cold_with, joint, l1_bound, sampled,
                              tiny_vocab_model)


# -- the drafter ---------------------------------------------------------------------------
def brute(seq, most, longest=PromptLookup.LONGEST):
    """The proposal by definition: the latest of the longest earlier matches of the
    sequence's suffix, its continuation read as a copy of itself past the end."""
    n, best, at = len(seq), 0, -1
    for i in range(n - 1):
        m = 0
        while m < longest and i - m >= 0 and seq[i - m] == seq[n - 1 - m]:
            m += 1
        if m and m >= best:
            best, at = m, i
    if at < 0 or most <= 0:
        return [], 0
    out = []
    for j in range(most):
        idx = at + 1 + j
        out.append(seq[idx] if idx < n else out[idx - n])
    return out, best


@settings(max_examples=300, deadline=None)
@given(hs.lists(hs.integers(0, 5), min_size=1, max_size=60), hs.integers(0, 8),
       hs.lists(hs.integers(0, 5), max_size=12))
def test_proposals_are_the_latest_longest_match(prefix, most, more):
    """Built at once or extended token by token (following a confirmed match), the
    proposal is the definition's."""
    pl = PromptLookup(prefix)
    assert pl.propose(most) == brute(prefix, most)
    seq = list(prefix)
    for t in more:
        pl.extend([t])
        seq.append(t)
        assert pl.propose(most) == brute(seq, most), seq
    assert list(pl.tokens) == seq


def test_a_match_is_followed_and_the_longest_wins():
    file = list(range(100, 140))
    pl = PromptLookup([1, 2] + file[:5] + [3, 4] + file + [5, 6, 7])
    assert pl.propose(4) == ([], 0)  # 7 is new
    pl.extend(file[:3])
    assert pl.propose(4) == (file[3:7], 3)  # the longest: 3 tokens back (both copies)
    pl.extend(file[3:6])  # past the short copy: only the long one goes on
    toks, match = pl.propose(5)
    assert toks == file[6:11] and match == 6
    pl.extend([999])  # a change: nothing matches any more
    assert pl.propose(3) == ([], 0)
    pl.extend(file[7:9])  # back on the file after the change
    assert pl.propose(2) == (file[9:11], 2)


# -- the length policy ---------------------------------------------------------------------
def fixed_cost(alpha=1.1, c=0.1):
    cost = PassCost(alpha=alpha, c=c)
    cost.observe = lambda k, seconds: None
    return cost


def test_long_matches_draft_long_and_failed_short_ones_stop_at_once():
    ll = LookupLength(fixed_cost())
    assert ll.next(40, 10) >= 6  # the prior of a long match: most of it
    for _ in range(30):  # short matches that keep failing
        k = ll.next(2, 10)
        ll.observe(2, k, 0)
    assert ll.acceptance(2) < 0.15
    assert ll.next(40, 10) >= 6  # (a long match is another bucket)
    # Short matches now only probe, less and less often.
    ks = []
    for _ in range(300):
        ks.append(ll.next(2, 10))
        ll.observe(2, ks[-1], 0)
    assert set(ks) <= {0, 1} and sum(ks) <= 6
    assert ll.next(0, 10) == 0 and ll.next(5, 0) == 0


def test_a_request_that_stops_copying_stops_drafting_whatever_others_did():
    """The model's other requests made matches of 3 tokens reliable; this request's fail:
    its own tally overrules the model's estimate within a few rounds, then it only probes."""
    ll = LookupLength(fixed_cost(1.1, 0.1))
    for _ in range(200):
        ll.observe(3, 4, 4)
    assert ll.acceptance(3) > 0.95
    tally, ks = LookupTally(), []
    for _ in range(40):
        ks.append(ll.next(3, 10, tally))
        ll.observe(3, ks[-1], 0, tally)
    assert ks[0] >= 6  # (it had every reason to draft at first)
    assert sum(1 for k in ks if k) <= 10 and set(ks[-25:]) <= {0, 1} and sum(ks[-25:]) <= 2
    assert ll.acceptance(3, LookupTally()) > 0.5  # a new request starts from the model's


@pytest.mark.parametrize("alpha,c", [(1.0, 0.0), (1.1, 0.05), (1.3, 0.4), (2.0, 1.0)])
def test_best_is_the_fastest_round(alpha, c):
    ll = LookupLength(fixed_cost(alpha, c))
    for match in (1, 3, 7, 20, 64):
        a = ll.acceptance(match)
        speeds = [sum(a ** i for i in range(k + 1)) / (1 if k == 0 else alpha + c * k)
                  for k in range(11)]
        assert ll.best(match, 10) == speeds.index(max(speeds))


def test_pass_cost_measures_alpha_and_c():
    cost = PassCost()
    for _ in range(20):
        cost.observe(0, 0.010)
    for i in range(200):
        k = 1 + i % 9
        cost.observe(k, 0.010 * (1.3 + 0.05 * k))
    cost.observe(4, 5.0)  # a pause of the caller: dropped
    assert cost.plain_seconds == pytest.approx(0.010)
    assert cost.alpha == pytest.approx(1.3, abs=0.02) and cost.c == pytest.approx(0.05, abs=0.01)
    assert cost.relative(0) == 1.0


# -- greedy: plain decoding's output, whatever is proposed ----------------------------------
KINDS = ["llama", "gemma3_text", "qwen3_next", "mamba", "llama4"]
N = 40
SCHEDULES = {
    "mixed": lambda pos: (pos * 7) % 6,   # 0..5 right, then a wrong one
    "all": lambda pos: 99,                # everything right: full rounds
    "none": lambda pos: 0,                # every first proposal wrong
}


def prompt_of(name, n=6, seed=0):
    rng = random.Random(seed)
    return [rng.randrange(V) for _ in range(n)]


@pytest.mark.parametrize("name", KINDS)
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_greedy_output_and_trie_are_plain_decodings(name, schedule):
    m = model(name)
    prompt = prompt_of(name)
    ref = cold(m, prompt, N)
    seq = prompt + [t for t, _ in ref]
    pc = new_cache(m, pre_end_margin=MARGIN)
    pc.lookup, drafters = scripted(seq, SCHEDULES[schedule], V)
    rs = list(pc.stream_generate(TOK, prompt, N))
    assert_same(ref, [(r.token, r.logprobs) for r in rs])
    st = rs[-1].cache
    assert st.lookup_drafted_tokens == st.drafted_tokens > 0
    assert st.lookup_accepted_tokens == st.accepted_tokens == sum(r.from_draft for r in rs)
    if schedule == "mixed":
        assert 0 < st.accepted_tokens < st.drafted_tokens
        if name != "llama":  # a recurrent layer, a wrapped window or a chunk came back
            assert st.replayed_tokens > 0 or name == "llama4", st
    if schedule == "all":
        assert st.accepted_tokens == st.drafted_tokens
        assert st.target_passes <= math.ceil(N / 7) + 1 and st.passes_saved >= N - 8
    if schedule == "none":  # (a carry past 2 (k + 1) tokens is replayed in a pass of its own)
        assert st.accepted_tokens == 0
        assert st.target_passes == N if name == "llama" else N <= st.target_passes <= N + N // 7
    # What the trie holds: every emitted token but the last (or all), both as a cold run.
    plan = check_restored_state(pc, seq[:-1] + [3])
    assert plan.restored >= len(seq) - 1 - (0 if name == "llama" else MARGIN + 1), plan
    check_no_leaks(pc)


@pytest.mark.parametrize("name", ["gemma3_text", "qwen3_next", "mamba", "llama4"])
def test_a_rejection_at_every_offset_of_a_long_pass(name):
    """One long proposal per round, rejected at each index in turn: the window wraps inside
    the pass (gemma3: 8), the recurrent state absorbs rejected tokens mid-pass (qwen3_next,
    mamba), chunk boundaries (llama4: 8) fall inside it."""
    m = model(name)
    prompt = prompt_of(name, 5, seed=3)
    ref = cold(m, prompt, 36)
    seq = prompt + [t for t, _ in ref]
    for reject in range(0, 9, 2):
        pc = new_cache(m, pre_end_margin=MARGIN)
        pc.lookup, _ = scripted(seq, lambda pos: reject, V, most=9)
        rs = list(pc.stream_generate(TOK, prompt, 36))
        assert_same(ref, [(r.token, r.logprobs) for r in rs])
        check_restored_state(pc, seq[:-1] + [1])
        check_no_leaks(pc)


def test_penalties_see_the_proposals_as_plain_decoding_sees_the_answer():
    """Logits processors (a repetition penalty) at each verified position see the prompt,
    the answer and the proposals before it — as plain decoding's history."""
    m = model("llama")
    prompt = prompt_of("llama", 5)
    procs = make_logits_processors(repetition_penalty=3.0, repetition_context_size=8)
    ref = cold_with(m, prompt, N, procs)
    seq = prompt + [t for t, _ in ref]
    pc = new_cache(m)
    pc.lookup, _ = scripted(seq, SCHEDULES["mixed"], V)
    rs = list(pc.stream_generate(TOK, prompt, N, logits_processors=procs))
    assert_same(ref, [(r.token, r.logprobs) for r in rs])
    assert rs[-1].cache.accepted_tokens > 0


@pytest.mark.parametrize("start", [9, 20, 27])
def test_kv_bits_switch_stays_where_plain_decoding_puts_it(start):
    from test_kv_quant import BITS, GROUP, canonical

    m = build("llama", head_dim=32)
    rng = random.Random(start)
    prompt = [rng.randrange(V) for _ in range(16)]
    ref = canonical(m, prompt, 24, start)
    seq = prompt + [t for t, _ in ref]
    pc = mk.PrefixCache(m, kv_bits=BITS, kv_group_size=GROUP, quantized_kv_start=start)
    pc.lookup, _ = scripted(seq, SCHEDULES["mixed"], V)
    rs = list(pc.stream_generate(TOK, prompt, 24))
    assert_same(ref, [(r.token, r.logprobs) for r in rs])
    assert 0 < rs[-1].cache.accepted_tokens < rs[-1].cache.drafted_tokens


def test_end_of_sequence_inside_a_round_and_max_tokens():
    m = model("qwen3_next")
    prompt = prompt_of("qwen3_next", 6, seed=5)
    ref = cold(m, prompt, N)
    seq = prompt + [t for t, _ in ref]
    # An end-of-sequence token accepted in the middle of a full round.
    j = next(i for i in range(10, N) if seq[len(prompt) + i] not in seq[:len(prompt) + i])
    pc = new_cache(m, pre_end_margin=MARGIN)
    pc.lookup, _ = scripted(seq, SCHEDULES["all"], V)
    eos = mk.testing.TokenIdTokenizer(eos=[seq[len(prompt) + j]])
    rs = list(pc.stream_generate(eos, prompt, N))
    assert [r.token for r in rs] == seq[len(prompt): len(prompt) + j + 1]
    assert rs[-1].finish_reason == "stop"
    plan = check_restored_state(pc, seq[: len(prompt) + j] + [7])
    assert plan.restored >= len(prompt) + j - MARGIN - 1, plan
    for limit in (1, 2, 7):
        pc = new_cache(m)
        pc.lookup, _ = scripted(seq, SCHEDULES["all"], V)
        rs = list(pc.stream_generate(TOK, prompt, limit))
        assert [r.token for r in rs] == seq[len(prompt): len(prompt) + limit]
        assert rs[-1].finish_reason == "length"
        check_no_leaks(pc)


@pytest.mark.parametrize("name", ["llama", "qwen3_next"])
def test_closed_mid_answer_keeps_the_trie_exact(name):
    m = model(name)
    prompt = prompt_of(name, 6, seed=1)
    ref = cold(m, prompt, N)
    seq = prompt + [t for t, _ in ref]
    pc = new_cache(m, pre_end_margin=MARGIN, snapshot_interval=8)
    for after in (1, 4, 9):
        pc.lookup, _ = scripted(seq, SCHEDULES["mixed"], V)
        gen = pc.stream_generate(TOK, prompt, N)
        seen = [next(gen).token for _ in range(after)]
        gen.close()
        assert seen == seq[len(prompt): len(prompt) + after]
        check_no_leaks(pc)
        follow = prompt + seen + [5, 6]
        check_restored_state(pc, follow)
        pc.lookup = None
        got = [(r.token, r.logprobs) for r in pc.stream_generate(TOK, follow, 4)]
        assert_same(cold(m, follow, 4), got)
        check_no_leaks(pc)


# -- the switch --------------------------------------------------------------------------------
def test_switched_off_is_plain_decoding_and_bad_arguments_are_named():
    m = model("llama")
    prompt = prompt_of("llama")
    off = mk.PrefixCache(m, prompt_lookup=False)
    assert off.lookup is None
    rs = list(off.stream_generate(TOK, prompt, 8))
    assert rs[-1].cache.drafted_tokens == 0 and rs[-1].cache.target_passes == 8
    on = mk.PrefixCache(m, prompt_lookup_num_tokens=4)
    assert on.lookup.most == 4
    with pytest.raises(ValueError, match="prompt_lookup_num_tokens must be >= 0"):
        mk.PrefixCache(m, prompt_lookup_num_tokens=-1)
    with pytest.raises(TypeError, match="prompt_lookup must be a bool"):
        mk.PrefixCache(m, prompt_lookup="yes")
    with pytest.raises(TypeError, match="prompt_lookup_num_tokens must be an int"):
        on.stream_generate(TOK, prompt, 4, prompt_lookup_num_tokens="4")
    seq = prompt + [t for t, _ in cold(m, prompt, 8)]
    on.lookup, _ = scripted(seq, SCHEDULES["all"], V)
    rs = list(on.stream_generate(TOK, prompt, 8, prompt_lookup_num_tokens=0))  # off for one
    assert rs[-1].cache.drafted_tokens == 0
    rs = list(on.stream_generate(TOK, prompt, 8))
    assert rs[-1].cache.drafted_tokens > 0


# -- with a draft model: the better proposal wins ----------------------------------------------
def test_with_a_draft_model_the_better_proposal_wins():
    """An identical (cheap, always right) draft against lookup proposals that are always
    wrong: the draft's rounds win once the lookup's failures are learned; the output is
    plain decoding's either way, and the draft left behind by lookup rounds catches up."""
    from mlx_kvcache.generation.draft_length import DraftLength

    name = "qwen3_next"
    m = model(name)
    prompt = prompt_of(name, 6)
    ref = cold(m, prompt, N)
    seq = prompt + [t for t, _ in ref]
    pc = new_cache(m, draft_model=mk.testing.noisy_copy(name, 0.0), num_draft_tokens=3,
                   pre_end_margin=MARGIN)
    pc.draft_length = DraftLength(0.05)  # adaptive, as for a draft 20x smaller
    plan, _ = scripted(seq, SCHEDULES["none"], V)
    pc.lookup = LookupPlan(6, LookupLength(fixed_cost()), plan.drafter)
    rs = list(pc.stream_generate(TOK, prompt, N))
    assert_same(ref, [(r.token, r.logprobs) for r in rs])
    st = rs[-1].cache
    assert st.lookup_accepted_tokens == 0 and st.lookup_drafted_tokens < 12
    assert st.accepted_tokens - st.lookup_accepted_tokens > N // 2  # the draft's
    check_restored_state(pc, seq[:-1] + [2])
    check_no_leaks(pc)


# -- sampling: the model's distribution ----------------------------------------------------------
def test_sampling_keeps_the_models_distribution():
    """Deterministic proposals (a lookup's) verified by sampling: accepted with probability
    p(t), else the sample is p without t — so every depth-3 continuation comes with the
    model's exact probability (checked against an L1 bound exact for any n)."""
    vocab, depth, n = 3, 3, 1000
    m = tiny_vocab_model(1, vocab)
    prompt = [0, 1, 2, 1]
    p = joint(m, prompt, vocab, depth)
    eps = l1_bound(len(p), n)
    most_likely = max(p, key=p.get)

    class Always:  # proposes the most likely continuation from wherever it is
        def __init__(self, tokens):
            self.n = len(tokens)

        def extend(self, toks):
            self.n += len(toks)

        def propose(self, most):
            done = self.n - len(prompt)
            return list(most_likely[done:])[:most] or [0], 8

    pc = mk.PrefixCache(m)
    pc.lookup = LookupPlan(3, VerifyAll(), Always)
    pc.seed(4321)
    counts, drafted, accepted = sampled(pc, prompt, depth, n, make_sampler(temp=1.0))
    assert 0 < accepted < drafted  # both branches of the rule ran
    l1 = sum(abs(counts[k] / n - q) for k, q in p.items())
    assert l1 < eps, (l1, eps)
    # The statistic has the power to see a wrong rule: always emitting the proposal.
    wrong = Counter({most_likely: n})
    assert sum(abs(wrong[k] / n - q) for k, q in p.items()) > eps


# -- real lookups on a model that copies: drafts where it copies, none where it does not --------
def copying(tmp_path, kind, chain):
    from pathlib import Path

    from mlx_lm.utils import load_model

    from mlx_kvcache.testing.copy_dirs import chain_table, write_copy_dir

    d = write_copy_dir(Path(tmp_path) / kind, kind, succ=chain_table([chain], 103))
    return load_model(d, trust_remote_code=True)[0]


@pytest.mark.parametrize("kind", ["llama", "qwen3_next"])
def test_copied_text_drafts_and_fresh_text_falls_back_at_once(tmp_path, kind):
    """The real drafter and policy (a fixed cost: no timing). An answer that copies the
    prompt with two changes is mostly accepted drafts; an answer whose every token the
    prompt follows with another (a wrong match at every step) drafts a few times until
    the failures are learned, then only probes — and both are plain decoding's."""
    rng = random.Random(9)
    text = rng.sample(range(8, 103), 80)
    copy = text[:30] + [5] + text[31:60] + text[61:]
    fresh = list(text)
    while any(b == fresh[fresh.index(a) + 1] if fresh.index(a) + 1 < len(fresh) else False
              for a, b in zip(text, text[1:])):
        rng.shuffle(fresh)  # no pair of the prompt's follows in the answer
    for answer_chain, copied in ((copy, True), (fresh, False)):
        m = copying(tmp_path / str(copied), kind, [1] + answer_chain + [2])
        prompt = [3] + text + [4, 1]
        n = len(answer_chain) + 1
        ref = cold(m, prompt, n)
        assert [t for t, _ in ref] == answer_chain + [2]
        pc = mk.PrefixCache(m)
        pc.lookup = LookupPlan(10, LookupLength(fixed_cost(1.1, 0.05)))
        rs = list(pc.stream_generate(mk.testing.TokenIdTokenizer(eos=[2]), prompt, n + 5))
        assert_same(ref, [(r.token, r.logprobs) for r in rs])
        st = rs[-1].cache
        if copied:
            assert st.lookup_accepted_tokens >= 0.8 * n and st.target_passes <= n // 3, st
        else:
            assert st.lookup_accepted_tokens == 0 and st.lookup_drafted_tokens <= 8, st
            assert st.target_passes == n
