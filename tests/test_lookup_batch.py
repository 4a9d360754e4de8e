"""Prompt lookup in mlx-lm's batch (`serving.engine.lookup_batch`): a batch of one row
verifies proposals in one pass and takes back what was rejected, on every cache kind;
every answer equals plain decoding's (tokens and log-probs to 1e-4) and so does the
cache each row ends with — alone, with rows joining and leaving, with penalties."""

import random

import mlx.core as mx
import importlib
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_logits_processors

from mlx_kvcache.serving.engine.lookup_batch import LookupBatch

G = importlib.import_module("mlx_lm.generate")  # (``mlx_lm.generate`` is also a function)
from mlx_kvcache.serving.engine.lookup_request import LookupSampler, RequestLookup
from models import V
from proposals import ScriptedDrafter, VerifyAll
from reference import FLOAT_TOL, assert_same, model

KINDS = ["llama", "gemma3_text", "qwen3_next", "mamba"]


@pytest.fixture(autouse=True)
def lookup_batches(monkeypatch):
    """Every batch mlx-lm makes is one of ours (as `seam.patched` makes it in serve)."""
    monkeypatch.setattr(G, "GenerationBatch", LookupBatch)


def greedy(x):
    return mx.argmax(x, axis=-1)


def plain(m, prompt, n, procs=()):
    gen = generate_step(mx.array(prompt), m, prompt_cache=make_prompt_cache(m), max_tokens=n,
                        logits_processors=list(procs) or None)
    return [(int(t), lp) for t, lp in gen]


def scripted_row(seq, agree, most=6):
    return RequestLookup(most, make_drafter=lambda toks: ScriptedDrafter(seq, toks, agree, V),
                         length=VerifyAll())


def run(m, prompts, n, lookups, procs=None, join_after=None):
    """Each prompt's ``[(token, log-probs)]``, its last cache and tokens; ``join_after``:
    the second prompt is inserted once the first has that many tokens."""
    bg = G.BatchGenerator(m, completion_batch_size=4, prefill_batch_size=4,
                          prefill_step_size=64)
    procs = procs or [[] for _ in prompts]

    def insert(i):
        return bg.insert([prompts[i]], max_tokens=[n[i]],
                         samplers=[LookupSampler(greedy, lookups[i]) if lookups[i] else greedy],
                         logits_processors=[procs[i]])[0]
    order = [0] if join_after is not None else list(range(len(prompts)))
    uids = {insert(i): i for i in order}
    out = [[] for _ in prompts]
    ends = [None] * len(prompts)
    while any(e is None for e in ends):
        _, gens = bg.next()
        for r in gens:
            i = uids[r.uid]
            out[i].append((r.token, r.logprobs))
            if r.finish_reason is not None:
                ends[i] = (r.prompt_cache, list(r.all_tokens), r.finish_reason)
        if join_after is not None and len(out[0]) >= join_after and len(uids) == 1:
            uids[insert(1)] = 1
    return out, ends


def check_cache(m, cache, tokens):
    """A row's last cache holds ``tokens``: one more token through it gives a cold run's
    log-probs."""
    out = m(mx.array([[3]]), cache=cache)[0, -1]
    ref = m(mx.array([tokens + [3]]), cache=make_prompt_cache(m))[0, -1]
    diff = mx.abs((out - mx.logsumexp(out)) - (ref - mx.logsumexp(ref))).max().item()
    assert diff < FLOAT_TOL, diff


def prompt_of(seed, n=7):
    rng = random.Random(seed)
    return [rng.randrange(V) for _ in range(n)]


@pytest.mark.parametrize("name", KINDS)
@pytest.mark.parametrize("agree", ["mixed", "all", "none"])
def test_one_row_verifies_and_takes_back_exactly(name, agree):
    m = model(name)
    prompt, n = prompt_of(1), 36
    ref = plain(m, prompt, n)
    seq = prompt + [t for t, _ in ref]
    rule = {"mixed": lambda pos: (pos * 5) % 7, "all": lambda pos: 99, "none": lambda pos: 0}[agree]
    row = scripted_row(seq, rule)
    (got,), ((cache, tokens, why),) = run(m, [prompt], [n], [row])
    assert_same(ref, got)
    assert why == "length" and tokens == seq
    check_cache(m, cache, tokens)
    st = row.stats
    assert st.generated_tokens == n and st.lookup_drafted_tokens == st.drafted_tokens > 0
    if agree == "all":
        assert st.accepted_tokens == st.drafted_tokens and st.target_passes < n // 3
    if agree == "mixed":
        assert 0 < st.accepted_tokens < st.drafted_tokens
    if agree == "none":
        assert st.accepted_tokens == 0


def test_rows_join_and_leave_around_rounds():
    """A second row joins while the first verifies rounds (the batch then steps both as
    mlx-lm does), leaves first, and the first goes on verifying alone."""
    m = model("qwen3_next")
    a, b = prompt_of(2, 9), prompt_of(3, 5)
    ra, rb = plain(m, a, 40), plain(m, b, 8)
    seq_a, seq_b = a + [t for t, _ in ra], b + [t for t, _ in rb]
    rows = [scripted_row(seq_a, lambda pos: (pos * 3) % 5), scripted_row(seq_b, lambda pos: 2)]
    (got_a, got_b), ends = run(m, [a, b], [40, 8], rows, join_after=6)
    assert_same(ra, got_a)
    assert_same(rb, got_b)
    for (cache, tokens, _), seq in zip(ends, (seq_a, seq_b)):
        assert tokens == seq
        check_cache(m, cache, tokens)
    assert rows[0].stats.accepted_tokens > 0


def test_penalties_and_a_stop_inside_a_round():
    m = model("llama")
    prompt = prompt_of(4)
    procs = make_logits_processors(repetition_penalty=3.0, repetition_context_size=8)
    ref = plain(m, prompt, 30, procs)
    seq = prompt + [t for t, _ in ref]
    row = scripted_row(seq, lambda pos: (pos * 5) % 7)
    (got,), ((cache, tokens, _),) = run(m, [prompt], [30], [row], procs=[procs])
    assert_same(ref, got)
    check_cache(m, cache, tokens)
    # The answer's limit inside an accepted run: the row ends there, its cache with it.
    row = scripted_row(seq, lambda pos: 99)
    (got,), ((cache, tokens, why),) = run(m, [prompt], [11], [row], procs=[procs])
    assert_same(ref[:11], got)
    assert why == "length" and tokens == seq[: len(prompt) + 11]
    check_cache(m, cache, tokens)


def test_without_a_lookup_the_batch_is_mlx_lms():
    m = model("gemma3_text")
    prompts = [prompt_of(5), prompt_of(6, 4)]
    refs = [plain(m, p, 12) for p in prompts]
    got, ends = run(m, prompts, [12, 12], [None, RequestLookup(0)])
    for r, g in zip(refs, got):
        assert_same(r, g)
