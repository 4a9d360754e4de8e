"""Every cache class through `PrefixCache`: chunked attention (llama4), deepseek_v41's own
``LayerCache``, and cache classes the package has never seen (written here). Each answer
equals a cold run on the model's own (mlx-lm) caches to 1e-4 in log-probs; repeats reuse.

The cold reference feeds the positions a reused row was computed at in one-token passes
the same way (`History`, see test_kv_quant): deepseek_v41 rounds its KV to fp8/fp4, which
can turn the float noise between one-token and chunked passes into a rounding step.
"""

from __future__ import annotations

import random
import warnings

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models import cache as mlc

import mlx_kvcache as mk
from mlx_kvcache.caches import generic
from models import V, build
from reference import TOK, assert_same, check_no_leaks, new_cache, run, track_snapshots  # noqa: F401
from test_kv_quant import History

_MODELS = {}


def model(name):
    if name not in _MODELS:
        _MODELS[name] = CustomModel() if name == "custom" else build(name)
    return _MODELS[name]


def cold(m, prompt, max_tokens, singles=()):
    """Greedy tokens and log-probs on fresh caches from the model's own ``make_cache``
    (prefill in one pass except the positions in ``singles``, fed one at a time)."""
    cache = mlc.make_prompt_cache(m)
    n, pos, singles = len(prompt), 0, set(singles)
    while pos < n - 1:
        end = pos + 1 if pos in singles else min([n - 1] + [p for p in singles if p > pos])
        m(mx.array(prompt[pos:end])[None], cache=cache)
        pos = end
    out, y = [], prompt[-1]
    for _ in range(max_tokens):
        logits = m(mx.array([y])[None], cache=cache)[:, -1, :]
        lp = (logits - mx.logsumexp(logits, axis=-1, keepdims=True)).squeeze(0)
        y = int(mx.argmax(lp).item())
        out.append((y, lp))
    return out


def ask(pc, hist, m, prompt, max_tokens=4):
    got, st = run(pc, prompt, max_tokens)
    assert_same(cold(m, prompt, max_tokens, hist.singles(prompt, st.restored_tokens)), got)
    assert st.restored_tokens + st.prefilled_tokens == len(prompt)
    hist.record(prompt, [t for t, _ in got], st.restored_tokens)
    return got, st


def conversation(pc, m, rng, turns=3):
    """A chat-like workload: growing turns, an exact repeat, a divergence inside an earlier
    turn, a new branch; returns the stats of each request."""
    hist, stats = History(), []
    conv = [rng.randrange(V) for _ in range(21)]  # crosses chunk (8) and window (8) bounds
    for _ in range(turns):
        got, st = ask(pc, hist, m, conv)
        stats.append(st)
        conv = conv + [t for t, _ in got][:3] + [rng.randrange(V) for _ in range(9)]
    for p in (conv, conv, conv[:19] + [rng.randrange(V) for _ in range(6)],
              conv[:30] + [rng.randrange(V) for _ in range(5)]):
        stats.append(ask(pc, hist, m, p)[1])
    check_no_leaks(pc)
    return conv, stats


# -- chunked attention (llama4) -------------------------------------------------------------
def test_llama4_chunked_parity_and_reuse():
    """Chunk 8, prompts of 21..50 tokens: every restore lands where the chunk's rows are
    held (any token here: prefill stops at least once a chunk) and equals a cold run."""
    m = model("llama4")
    pc = new_cache(m, max_bytes=1 << 30, prefill_step_size=5)
    assert pc.manager.snapshot_interval == 8  # capped to the chunk size
    conv, stats = conversation(pc, m, random.Random(0))
    assert all(s.restored_tokens > 0 for s in stats[1:])
    assert stats[4].restored_tokens == len(conv) - 1  # an exact repeat
    assert stats[3].restored_tokens == len(conv) - 9  # the last turn's fed tokens
    assert stats[5].restored_tokens == 19 and stats[6].restored_tokens == 30  # divergences


def test_llama4_long_answer_keeps_only_its_last_chunk_rows():
    """An answer longer than a chunk is recorded from the rows the live cache still holds:
    a later prompt reaches a position there only if its chunk's rows are among them; else
    it lands on the deepest point that works (here the chunk boundary 24), never wrong."""
    m, rng = model("llama4"), random.Random(4)
    pc = new_cache(m, max_bytes=1 << 30, prefill_step_size=5)
    hist = History()
    p = [rng.randrange(V) for _ in range(24)]
    got, _ = ask(pc, hist, m, p, 20)  # fed 24 + 19: the last pass kept rows 34..42
    fed = p + [t for t, _ in got][:19]
    q = fed[:29] + [rng.randrange(V) for _ in range(4)]  # 29: chunk [24, 32) rows are gone
    got, st = ask(pc, hist, m, q)
    assert st.restored_tokens == 24 and "ChunkedKVCache" in st.reason
    q = fed[:41] + [rng.randrange(V) for _ in range(4)]  # 41: chunk [40, 48) rows are held
    got, st = ask(pc, hist, m, q)
    assert st.restored_tokens == 41


def test_chunked_restore_refuses_where_the_chunk_rows_are_gone():
    """mlx-lm#1494: rewinding a trimmed chunked cache into a chunk whose first rows were
    trimmed away serves too few keys. Ours refuses (and trim raises) instead."""
    c = mk.ChunkedKVCache(8)
    k = mx.arange(30, dtype=mx.float32).reshape(1, 1, 30, 1) * mx.ones((1, 1, 1, 4))
    c.update(k[..., :20, :], k[..., :20, :])
    c.maybe_trim_front()  # keeps rows 12..19
    assert c.start_position == 12
    assert not c.restore(None, 11) and c.offset == 20  # chunk [8, 16) lost rows 8..11
    with pytest.raises(mk.CacheError, match="no longer held"):
        c.trim(7)
    assert c.restore(None, 16) and c.keys is None  # a chunk boundary needs no rows
    c.update(k[..., 16:18, :], k[..., 16:18, :])
    kk, _ = c.keys_and_values()
    assert c.start_position == 16 and kk[0, 0, :, 0].tolist() == [16.0, 17.0]
    s = c.snapshot(16)
    c2 = mk.ChunkedKVCache(8)  # empty: the chunk [16, 24) needs nothing below 16
    assert c2.restore(s, 17) and (c2.offset, c2.start_position) == (17, 16)
    assert not mk.ChunkedKVCache(8).restore(s, 15)  # no rows of [8, 16) anywhere
    # the mlx-lm class would happily "trim" into the lost chunk
    theirs = mlc.ChunkedKVCache(8)
    theirs.update_and_fetch(k[..., :20, :], k[..., :20, :])
    theirs.maybe_trim_front()
    theirs.trim(7)
    assert theirs.offset == 13 and theirs.start_position == 12  # wrong: rows 8..11 missing


# -- deepseek_v41's LayerCache: the generic path ----------------------------------------------
def test_deepseek_v41_layer_cache_parity_and_reuse():
    m = model("deepseek_v41")
    pc = new_cache(m, max_bytes=1 << 30, prefill_step_size=5, snapshot_interval=8, pre_end_margin=4)
    leaves = pc.manager.ops
    assert all(isinstance(c, mk.GenericCache) and c.mode == "attrs" and not c.tracked for c in leaves)
    conv, stats = conversation(pc, m, random.Random(1))
    assert all(s.restored_tokens > 0 for s in stats[1:])
    assert stats[4].restored_tokens == len(conv) - 1  # the pre-end snapshot at n - 1
    # Whole states restore at node ends only: the divergence at 19 lands on the first
    # turn's interval snapshot at 16 (its pre-end stop, 21 - 4 = 17, one token above it,
    # would not pay: `planner.guess_spacing`), and the reason names the real class.
    assert stats[5].restored_tokens == 16 and "LayerCache" in stats[5].reason


# -- classes the package has never seen ------------------------------------------------------
class RowCache:
    """Keys/values by concatenation, its own ``push`` / ``position``, no ``offset`` and a
    read-only ``state``: the generic path counts tokens and copies its array attributes."""

    def __init__(self):
        self.k = self.v = None
        self.length = 0

    def position(self):
        return self.length

    def push(self, k, v):
        self.k = k if self.k is None else mx.concatenate([self.k, k], axis=2)
        self.v = v if self.v is None else mx.concatenate([self.v, v], axis=2)
        self.length += k.shape[2]
        return self.k, self.v

    @property
    def state(self):
        return self.k, self.v


class StateCache:
    """Preallocated rows written in place, an ``offset``, and ``state`` with a setter (the
    generic path goes through it); keeps a float tag that must survive snapshots."""

    def __init__(self):
        self.buf = None
        self.offset = 0
        self.scale = 1.0

    def append(self, k, v):
        kv = mx.concatenate([k, v], axis=-1)
        if self.buf is None or self.offset + k.shape[2] > self.buf.shape[2]:
            grow = mx.zeros((*kv.shape[:2], 64, kv.shape[3]), kv.dtype)
            self.buf = grow if self.buf is None else mx.concatenate([self.buf[..., : self.offset, :], grow], axis=2)
        self.buf[..., self.offset : self.offset + k.shape[2], :] = kv
        self.offset += k.shape[2]
        d = k.shape[3]
        return self.buf[..., : self.offset, :d], self.buf[..., : self.offset, d:]

    @property
    def state(self):
        return {"buf": self.buf, "offset": self.offset, "scale": self.scale, "name": "rows"}

    @state.setter
    def state(self, v):
        self.buf, self.offset, self.scale = v["buf"], v["offset"], v["scale"]


class Block(nn.Module):
    def __init__(self, dim=32, heads=2):
        super().__init__()
        self.heads, self.hd = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)
        self.mlp = nn.Linear(dim, dim, bias=False)
        self.rope = nn.RoPE(self.hd)

    def __call__(self, x, cache):
        B, L, D = x.shape
        q, k, v = (t.reshape(B, L, self.heads, self.hd).transpose(0, 2, 1, 3)
                   for t in mx.split(self.qkv(x), 3, axis=-1))
        # Class-specific methods: the model must see its own objects.
        if isinstance(cache, RowCache):
            pos, update = cache.position(), cache.push
        elif isinstance(cache, StateCache):
            pos, update = cache.offset, cache.append
        else:
            pos, update = cache.offset, cache.update_and_fetch
        q, k = self.rope(q, offset=pos), self.rope(k, offset=pos)
        k, v = update(k, v)
        a = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.hd ** -0.5,
                                                 mask="causal" if L > 1 else None)
        x = x + self.o(a.transpose(0, 2, 1, 3).reshape(B, L, D))
        return x + self.mlp(nn.silu(x))


class CustomModel(nn.Module):
    def __init__(self):
        super().__init__()
        mx.random.seed(3)
        self.embed = nn.Embedding(V, 32)
        self.layers = [Block(), Block(), Block()]
        self.head = nn.Linear(32, V, bias=False)
        mx.eval(self.parameters())

    def make_cache(self):
        return [RowCache(), StateCache(), mlc.KVCache()]

    def __call__(self, inputs, cache=None):
        cache = cache or self.make_cache()
        h = self.embed(inputs)
        for layer, c in zip(self.layers, cache):
            h = layer(h, c)
        return self.head(h)


def test_unknown_cache_classes_parity_reuse_at_node_ends_one_warning(monkeypatch):
    monkeypatch.setattr(generic, "_warned", set())
    m = model("custom")
    with pytest.warns(RuntimeWarning) as w:
        pc = new_cache(m, max_bytes=1 << 30, prefill_step_size=5, snapshot_interval=8,
                       pre_end_margin=4)
    named = [str(x.message) for x in w if "does not know" in str(x.message)]
    assert len(named) == 2 and "RowCache" in named[0] and "StateCache" in named[1]
    ops = pc.manager.ops
    assert [type(c).__name__ for c in ops] == ["GenericCache", "GenericCache", "KVCache"]
    assert (ops[0].mode, ops[0].tracked) == ("attrs", True)
    assert (ops[1].mode, ops[1].tracked) == ("state", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per class: no second warning
        conv, stats = conversation(pc, m, random.Random(2))
        new_cache(m)
    assert all(s.restored_tokens > 0 for s in stats[1:])
    assert stats[4].restored_tokens == len(conv) - 1
    # whole states restore only at node ends: the divergence at 19 lands on 16 (the first
    # turn's interval snapshot; no pre-end one at 17, one token above it)
    assert stats[5].restored_tokens == 16 and "RowCache" in stats[5].reason


def test_generic_interrupted_pass_is_not_recorded():
    """An object without an offset whose arrays changed since the last counted pass (an
    interrupted forward pass) is inconsistent: its live state is never recorded."""
    m = model("custom")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the class warning (tested above)
        live = mk.leaf_caches(mk.make_prompt_cache(m))
    g = live[0]
    assert g.tracked and g.offset == 0 and not g.dirty
    k = mx.ones((1, 2, 3, 16))
    g.obj.push(k, k)
    assert g.dirty and not g.restore(None, 0)
    mk.settle([g.obj], 3)
    assert g.offset == 3 and not g.dirty and g.restore(None, 3)
    s = g.snapshot(0)
    g.obj.push(k, k)
    mk.settle([g.obj], 3)
    assert g.offset == 6 and g.restore(s, 3) and g.obj.length == 3 and g.obj.k.shape[2] == 3
    g.free()
    assert g.offset == 0 and g.obj.k is None


# -- persistence of the new kinds ------------------------------------------------------------
@pytest.mark.parametrize("name", ["llama4", "deepseek_v41", "custom"])
def test_new_kinds_persist_and_restore_after_a_restart(name, tmp_path):
    m = model(name)
    rng = random.Random(5)
    p = [rng.randrange(V) for _ in range(27)]
    kw = dict(max_bytes=1 << 30, prefill_step_size=5, snapshot_interval=8, pre_end_margin=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the generic class warning
        pc = new_cache(m, cache_dir=str(tmp_path), **kw)
        hist = History()
        ask(pc, hist, m, p)
        pc.close()
        pc2 = new_cache(m, cache_dir=str(tmp_path), **kw)
    got, st = ask(pc2, hist, m, p)
    assert st.restored_tokens == len(p) - 1
    pc2.close()
