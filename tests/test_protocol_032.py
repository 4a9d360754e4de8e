"""mlx-lm 0.32's cache protocol on every class of ours: ``state`` (with its scalars, the
whole buffer, getter and setter) equal to mlx-lm's own class fed the same tokens,
``from_state(state)``, ``keys_and_values()``, ``nbytes``, ``size``, ``empty``, no
``meta_state``; prompt-cache files both ways; the protocol check; speculative decoding
with stock mlx-lm caches in the draft model."""

import inspect
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.models import cache as mlc

import mlx_kvcache.caches as K
from mlx_kvcache.caches import protocol
from mlx_kvcache.generation.speculative import SpeculativeDecoder
from mlx_kvcache.prefix.stats import RequestStats
from mlx_kvcache.testing import noisy_copy
from models import model
from reference import FLOAT_TOL

TOL = FLOAT_TOL  # float32 summation-order noise: see reference.FLOAT_TOL
PREFIX = list(range(3, 23))  # 20 tokens: gemma3_text's window (8) and llama4's chunk (8) wrap
def filled(m, caches, tokens=PREFIX):
    m(mx.array([tokens[:-3]]), cache=caches)  # a prefill chunk, then decode steps
    K.settle(caches, len(tokens) - 3)
    for t in tokens[-3:]:
        m(mx.array([[t]]), cache=caches)
        K.settle(caches, 1)
    mx.eval([c.state for c in caches])
    return caches


def next_logits(m, caches):
    out = m(mx.array([[7]]), cache=caches)[0, -1]
    return out - mx.logsumexp(out)


def close(a, b):
    return float(mx.abs(a - b).max()) < TOL


# (model, our caches, mlx-lm's caches) for every class of ours
def q_ours(m):
    return [K.QuantizedKVCache(group_size=32, bits=4) for _ in m.layers]


def q_theirs(m):
    return [mlc.QuantizedKVCache(group_size=32, bits=4) for _ in m.layers]


CASES = {
    "kv": ("llama", {}, None, None),
    "rotating": ("gemma3_text", {}, None, None),
    "recurrent": ("qwen3_next", {}, None, None),
    "chunked": ("llama4", {}, None, None),
    "quantized": ("llama", dict(hidden_size=128), q_ours, q_theirs),
}


def pair(case):
    name, over, mine, theirs = CASES[case]
    m = model(name, **over)
    a = (mine or K.make_prompt_cache)(m)
    b = (theirs or mlc.make_prompt_cache)(m)
    return m, filled(m, a), filled(m, b)


def flat(state):
    return tree_flatten(state if isinstance(state, (list, tuple)) else [state])


@pytest.mark.parametrize("case", list(CASES))
def test_state_is_mlx_lms_with_its_scalars_and_round_trips(case):
    m, ours, theirs = pair(case)
    kinds = set()
    for a, b in zip(ours, theirs):
        assert isinstance(a, K.LEAF_TYPES)
        kinds.add(type(a))
        assert not hasattr(a, "meta_state")
        assert list(inspect.signature(type(a).from_state).parameters) == ["state"]
        sa, sb = a.state, b.state
        if isinstance(a, K.RecurrentCache):  # mlx-lm's layout, then the tokens it absorbed
            assert len(sa) == len(sb) + 1 and sa[-1] == len(PREFIX)
            sa = sa[:-1]
        fa, fb = flat(sa), flat(sb)
        assert [k for k, _ in fa] == [k for k, _ in fb]
        for (k, x), (_, y) in zip(fa, fb):
            if isinstance(y, mx.array):  # the whole buffer, room to grow included
                assert isinstance(x, mx.array) and x.shape == y.shape and x.dtype == y.dtype, k
                assert np.allclose(np.array(x), np.array(y), atol=1e-5), k
            else:
                assert x == y, k
        assert a.nbytes == b.nbytes and not a.empty()
        if type(b).size is not mlc._BaseCache.size or isinstance(a, K.RecurrentCache):
            assert a.size() == b.size()  # (a recurrent state holds no positions: 0)
        else:  # mlx-lm's class leaves size() at its base's "not implemented" 0; ours counts
            assert a.size() == a.offset - getattr(a, "start_position", 0)
        if not isinstance(a, K.RecurrentCache):
            for x, y in zip(flat(a.keys_and_values()), flat(b.keys_and_values())):
                assert x[1].shape == y[1].shape
        # the setter and from_state(state) rebuild the same cache
        c = type(a).from_state(a.state)
        assert type(c) is type(a) and c.state is not None
    assert close(next_logits(m, [type(a).from_state(a.state) for a in ours]), next_logits(m, theirs))
    fresh = K.make_prompt_cache(m) if CASES[case][2] is None else CASES[case][2](m)
    assert all(c.empty() and c.nbytes == 0 for c in fresh)


@pytest.mark.parametrize("case", list(CASES))
def test_prompt_cache_files_both_ways(case, tmp_path):
    m, ours, theirs = pair(case)
    ref = next_logits(m, filled(m, (CASES[case][3] or mlc.make_prompt_cache)(m)))
    # ours -> mlx-lm's save -> mlx-lm's load (its classes) and our load (ours)
    f = str(tmp_path / "ours.safetensors")
    mlc.save_prompt_cache(f, ours, {"who": "ours"})
    assert close(next_logits(m, mlc.load_prompt_cache(f)), ref)
    back, meta = K.load_prompt_cache(f, return_metadata=True)
    assert meta == {"who": "ours"}
    assert all(isinstance(c, K.LEAF_TYPES) for c in back)
    assert [c.offset for c in back] == [c.offset for c in ours]
    assert close(next_logits(m, back), ref)
    # mlx-lm's -> file -> ours -> file -> mlx-lm's
    g, h = str(tmp_path / "theirs.safetensors"), str(tmp_path / "again.safetensors")
    mlc.save_prompt_cache(g, theirs)
    mine = K.load_prompt_cache(g)
    assert all(isinstance(c, K.LEAF_TYPES) for c in mine)
    assert all(c.snapshot() is not None for c in mine)  # ours in full: they snapshot
    mlc.save_prompt_cache(h, mine)
    again = mlc.load_prompt_cache(h)
    assert [type(c).__name__ for c in again] == [type(c).__name__ for c in mine]
    assert close(next_logits(m, again), ref)


# -- the protocol check -----------------------------------------------------------------------
def test_protocol_check_passes_here_and_names_a_changed_protocol(monkeypatch):
    assert protocol.check() is None
    monkeypatch.setattr(mlc.KVCache, "state", property(lambda self: (self.keys, self.values)))
    monkeypatch.setattr(mlc.RotatingKVCache, "meta_state", property(lambda self: ("0",)), raising=False)
    with pytest.raises(protocol.ProtocolError) as e:
        protocol.check()
    assert "KVCache.state" in str(e.value) and "RotatingKVCache has meta_state" in str(e.value)
    monkeypatch.undo()
    import mlx_lm

    monkeypatch.setattr(mlx_lm, "__version__", "0.33.1")
    assert "outside the tested range" in protocol.check()


def test_importing_on_a_changed_protocol_is_one_clear_error():
    code = ("import mlx_lm.models.cache as c\n"
            "c.KVCache.from_state = classmethod(lambda cls, state, meta_state: None)\n"
            "import mlx_kvcache.caches\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode != 0
    assert "ProtocolError" in r.stderr and "KVCache.from_state takes ['state', 'meta_state']" in r.stderr


# -- speculative decoding with stock mlx-lm caches in the draft model -----------------------------
@pytest.mark.parametrize("name,sigma", [("qwen3_next", 0.01), ("gemma3_text", 0.02)])
def test_speculative_with_stock_draft_caches(name, sigma):
    """The draft's layers are mlx-lm 0.32's own classes (an untrimmable recurrent state, a
    window that wraps): rollback snapshots them through ``state`` alone. The output is the
    target's greedy output, log-probs to 1e-4."""
    target, draft = model(name), noisy_copy(name, sigma)
    prompt, n = [5, 17, 3, 99, 42], 24
    ref = [(int(t), lp) for t, lp in generate_step(
        mx.array(prompt), target, prompt_cache=mlc.make_prompt_cache(target), max_tokens=n)]
    tc, dc = K.make_prompt_cache(target), mlc.make_prompt_cache(draft)
    assert not any(isinstance(c, K.LEAF_TYPES) for c in dc)
    x = mx.array([prompt[:-1]])
    target(x, cache=tc)
    K.settle(tc, len(prompt) - 1)
    draft(x, cache=dc)
    stats = RequestStats()
    spec = SpeculativeDecoder(target, tc, draft, dc, prompt, num_draft=3,
                              sampler=lambda lp: mx.argmax(lp, axis=-1), processors=[], eos=set(),
                              max_tokens=n, stats=stats)
    out, done = [], False
    while not done:
        got, done = spec.step()
        out += got
    held, ok = spec.finish(True)
    assert ok and len(held) == len(prompt) + n - 1
    assert [t for t, _, _ in out] == [t for t, _ in ref]
    assert all(close(a, b) for (_, a, _), (_, b) in zip(out, ref))
    assert 0 < stats.accepted_tokens < stats.drafted_tokens  # rejections rolled the draft back


def test_a_recurrent_file_without_a_token_count_stays_mlx_lms(tmp_path):
    """mlx-lm's ArraysCache records no token count: with no other layer to say it (Mamba),
    loading keeps mlx-lm's class rather than ours with a wrong offset."""
    m = model("mamba")
    c = mlc.make_prompt_cache(m)
    m(mx.array([[1, 2, 3]]), cache=c)
    f = str(tmp_path / "mamba.safetensors")
    mlc.save_prompt_cache(f, c)
    assert all(type(x) is mlc.ArraysCache for x in K.load_prompt_cache(f))
    ours = filled(m, K.make_prompt_cache(m), [1, 2, 3, 4])
    mlc.save_prompt_cache(f, ours)  # ours record it
    assert [(type(x), x.offset) for x in K.load_prompt_cache(f)] == [(K.RecurrentCache, 4)] * len(ours)
