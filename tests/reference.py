"""Shared by the PrefixCache tests: cold mlx-lm reference runs, log-prob comparison, and a
checker that every snapshot a cache made is either in its trie or closed."""

import gc
import itertools
import weakref

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache as mlx_make_prompt_cache

import mlx_kvcache as mk
from mlx_kvcache.caches.snapshot import Snapshot
from fake_tokenizer import FakeTokenizer
from models import build

TOK = FakeTokenizer()
MARGIN = 4
MODELS = {}


def model(name):
    if name not in MODELS:
        MODELS[name] = build(name)
    return MODELS[name]


# -- snapshot leak checker -------------------------------------------------------------------
_ALL_SNAPSHOTS: "weakref.WeakSet[Snapshot]" = weakref.WeakSet()
_COUNTER = itertools.count()
_orig_init = Snapshot.__init__


def _tracking_init(self, *a, **k):
    _orig_init(self, *a, **k)
    self._test_seq = next(_COUNTER)
    _ALL_SNAPSHOTS.add(self)


@pytest.fixture(autouse=True)
def track_snapshots(monkeypatch):
    monkeypatch.setattr(Snapshot, "__init__", _tracking_init)
    yield


def new_cache(m, **kw):
    if kw.get("draft_model") is not None:
        # The drafts here are noisy copies as large as their targets, which the adaptive
        # policy never drafts with: tests of the rollback rules draft every round.
        kw.setdefault("draft_policy", "fixed")
        # Their rounds are the draft model's alone (lookup beside a draft: test_lookup).
        kw.setdefault("prompt_lookup", False)
    if kw.get("kv_bits") is not None:
        # The kv_bits tests rebuild each reused row the way it was computed (decoded rows in
        # one-token passes); prompt lookup decodes in verify passes, another summation order,
        # which quantization can turn into a step. (Lookup with kv_bits: test_lookup.)
        kw.setdefault("prompt_lookup", False)
    pc = mk.PrefixCache(m, **kw)
    pc._test_seq = next(_COUNTER)  # snapshots created from here on belong to pc
    return pc


def check_no_leaks(pc):
    """Trie invariants hold, and every open snapshot pc made that is still alive is in its trie."""
    trie = pc.manager.trie
    trie.check_invariants()
    gc.collect()
    held = {id(s) for n in trie.nodes() for s in n.snapshots if s is not None}
    leaked = [
        s for s in list(_ALL_SNAPSHOTS)
        if not s.closed and id(s) not in held and getattr(s, "_test_seq", -1) >= pc._test_seq
    ]
    assert not leaked, leaked
    assert trie.nbytes == sum(n.nbytes for n in trie.nodes())


# -- reference ---------------------------------------------------------------------------------
def cold(m, prompt, max_tokens):
    """Greedy tokens and log-probs from mlx-lm's own generate_step on fresh caches."""
    out = []
    gen = generate_step(mx.array(prompt), m, prompt_cache=mlx_make_prompt_cache(m), max_tokens=max_tokens)
    for (t, lp), _ in zip(gen, range(max_tokens)):
        out.append((int(t), lp))
    return out


def run(pc, prompt, max_tokens, **kw):
    rs = list(pc.stream_generate(TOK, prompt, max_tokens, **kw))
    return [(r.token, r.logprobs) for r in rs], rs[-1].cache


def interleaved(gens):
    """Advance the generators one step each in turn until every one ends (requests
    open at once on one thread); each one's ``[(token, logprobs)]``."""
    outs = [[] for _ in gens]
    live = list(range(len(gens)))
    while live:
        for i in list(live):
            try:
                r = next(gens[i])
                outs[i].append((r.token, r.logprobs))
            except StopIteration:
                live.remove(i)
    return outs


#: How far two correct float32 runs of the test models may differ in a log-prob when only the
#: order of summation changes (another BLAS kernel, another buffer shape in attention).
#: Why: float32's unit roundoff is 6e-8; a dot product of n terms summed in another order
#: moves by about sqrt(n) roundoffs relative (n <= 256 here: ~1e-6), which a log-prob
#: ``z - logsumexp(z)`` with |z| <= ~10 carries as ~1e-5, a few layers (<= 4) compounding it
#: to a few 1e-5 at the very worst; 1e-4 is above that, and >= 15x above what is seen. Measured
#: (tests/test_kv_quant.py and test_speculative.py's kv_bits tests, max over all their
#: comparisons): 3.8e-6 with OpenBLAS 0.3.21's Cooperlake and SkylakeX kernels, 2.9e-6
#: Haswell and Zen, 6.2e-6 Prescott, 0 with MLX's bundled reference BLAS. What a wrong cache
#: gives is far above: one prompt row wrong moves the log-probs by 0.25 (llama) to 1.9
#: (gemma3); a kv_bits switch one token late by 6.6e-4 (llama) / 1.3e-3 (gemma3).
FLOAT_TOL = 1e-4


def assert_same(ref, got, tol=FLOAT_TOL):
    """Same greedy tokens, and every log-prob within ``tol`` (see `FLOAT_TOL`; a caller that
    quantizes rows computed in another summation order passes a bound that says why)."""
    assert [t for t, _ in ref] == [t for t, _ in got]
    diff = max(mx.abs(a - b).max().item() for (_, a), (_, b) in zip(ref, got))
    assert diff < tol, diff


