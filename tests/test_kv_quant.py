"""Quantized KV (``kv_bits``) through `PrefixCache`: every answer equals the canonical cold
run with mlx-lm's own caches, whatever was reused and wherever a restore landed.

The canonical schedule (`KVQuantization`): rows before ``quantized_kv_start`` are computed
with mlx-lm's ``KVCache``, which converts (``to_quantized``) exactly when its offset reaches
the start; every later row is quantized. The reference below feeds mlx-lm's caches that
way. (mlx-lm's own ``generate_step`` converts after the first prefill chunk crossing the
start, so its answers depend on chunking; the test checks that this difference is real.)

One more fact decides the reference: a row computed by a one-token forward pass (the
prompt's last token, every decoded token) differs from the same row computed inside a
prefill chunk by float noise (~1e-6 with OpenBLAS: matrix-vector vs matrix-matrix
kernels), and quantization can turn that noise into a whole quantization step (~3e-4 in
the log-probs here). A reused row is the row the cache computed, so the cold reference
computes every reused position the way it was first computed: `History` remembers which
positions of which prefixes were one-token passes, and the reference feeds exactly those
one token at a time (everything else in chunks, which give identical rows).
"""

from __future__ import annotations

import random

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models import cache as mlc

import mlx_kvcache as mk
from mlx_kvcache.caches import KVSnapshot, QuantizedSnapshot
from models import V, build
from reference import FLOAT_TOL, TOK, assert_same, check_no_leaks, new_cache, run, track_snapshots  # noqa: F401

BITS, GROUP = 8, 32
_MODEL = {}


def model():
    if "m" not in _MODEL:
        _MODEL["m"] = build("llama", head_dim=32)  # quantization groups of 32 need head_dim 32
    return _MODEL["m"]


def canonical(m, prompt, max_tokens, start, bits=BITS, group=GROUP, chunk=None, singles=()):
    """Greedy tokens and log-probs of a cold run on mlx-lm's caches under the canonical
    schedule (prefill in ``chunk``-token pieces, stopping at ``start``; the positions in
    ``singles`` are fed one token at a time)."""
    cache = mlc.make_prompt_cache(m)
    singles = set(singles)

    def convert():
        for i, c in enumerate(cache):
            if type(c) is mlc.KVCache and c.offset >= start:
                cache[i] = c.to_quantized(group_size=group, bits=bits)

    n, pos = len(prompt), 0
    while pos < n - 1:
        end = n - 1 if chunk is None else min(n - 1, pos + chunk)
        if pos < start:
            end = min(end, start)
        if pos in singles:
            end = pos + 1
        else:
            end = min([end] + [p for p in singles if p > pos])
        convert()
        m(mx.array(prompt[pos:end])[None], cache=cache)
        pos = end
    out, y = [], prompt[-1]
    for _ in range(max_tokens):
        convert()
        logits = m(mx.array([y])[None], cache=cache)[:, -1, :]
        lp = (logits - mx.logsumexp(logits, axis=-1, keepdims=True)).squeeze(0)
        y = int(mx.argmax(lp).item())
        out.append((y, lp))
    return out


class History:
    """Which positions of which token prefixes a `PrefixCache` computed in one-token passes
    (the first computation of a prefix is the one its snapshots keep)."""

    def __init__(self):
        self.single = {}

    def record(self, prompt, generated, restored):
        seq = list(prompt) + list(generated[:-1])  # the last answer token is never fed
        for p in range(restored, len(seq)):
            self.single.setdefault(tuple(seq[: p + 1]), p >= len(prompt) - 1)

    def singles(self, prompt, restored):
        return {p for p in range(restored) if self.single.get(tuple(prompt[: p + 1]))}


def ask(pc, hist, m, prompt, max_tokens, start, chunk=None, tol=FLOAT_TOL):
    """Run ``prompt``, check it against the canonical cold run (log-probs to ``tol``),
    remember its history."""
    got, st = run(pc, prompt, max_tokens)
    ref = canonical(m, prompt, max_tokens, start, chunk=chunk,
                    singles=hist.singles(prompt, st.restored_tokens))
    assert_same(ref, got, tol)
    hist.record(prompt, [t for t, _ in got], st.restored_tokens)
    return got, st


def prompt_of(rng, n):
    return [rng.randrange(V) for _ in range(n)]


def kinds(pc):
    """Per node (start, end): the set of snapshot kinds of its full-attention layers."""
    return {(n.start, n.end): {type(s).__name__ for s in n.snapshots if s is not None}
            for n in pc.manager.trie.nodes()}


def test_canonical_schedule_is_chunk_independent_and_mlx_lm_is_not():
    m, rng = model(), random.Random(1)
    p = prompt_of(rng, 40)
    a = canonical(m, p, 4, start=10, chunk=None)
    b = canonical(m, p, 4, start=10, chunk=7)
    assert_same(a, b)
    # mlx-lm's generate_step switches after the first chunk reaching the start: the
    # answer changes with the chunk size (what the canonical schedule avoids).
    lps = []
    for step in (16, 32):
        gen = generate_step(mx.array(p), m, prompt_cache=mlc.make_prompt_cache(m), max_tokens=2,
                            kv_bits=BITS, kv_group_size=GROUP, quantized_kv_start=10,
                            prefill_step_size=step)
        lps.append(next(gen)[1])
    assert mx.abs(lps[0] - lps[1]).max().item() > 1e-4


@pytest.mark.parametrize("start, keep_live", [(0, False), (9, False), (23, False), (1000, False),
                                              (9, True), (23, True)])
def test_parity_with_canonical_cold_runs(start, keep_live):
    """Repeats, extensions, divergences before and after the start, prompts shorter than
    it (the switch then happens during decoding): each answer equals the cold run. With
    ``keep_live`` the idle caches (quantized or not) are reused or swapped as needed."""
    m, rng = model(), random.Random(start)
    pc = new_cache(m, kv_bits=BITS, kv_group_size=GROUP, quantized_kv_start=start,
                   prefill_step_size=5, max_bytes=1 << 30, keep_live=keep_live)
    base = prompt_of(rng, 16)
    long = base + prompt_of(rng, 20)
    prompts = [
        base, base,                                 # a repeat: 15 of 16 tokens restored
        long,                                       # extends past the start
        long[:30] + prompt_of(rng, 6),              # diverges after the start
        long[:6] + prompt_of(rng, 10),              # diverges before it
        long + prompt_of(rng, 3), long,             # extension, then the shorter repeat
    ]
    reused, hist = [], History()
    for p in prompts:
        got, st = ask(pc, hist, m, p, 5, start)
        assert st.restored_tokens + st.prefilled_tokens == len(p)
        reused.append(st.restored_tokens)
        check_no_leaks(pc)
    # Full-attention rows reach any token, quantized or not: every restore is exact.
    # (A random extension may happen to match generated tokens: a lower bound there.)
    assert reused[:5] == [0, 15, 16, 30, 6] and reused[5] >= 36 and reused[6] == 35
    if 0 < start < 16:  # the last unquantized rows stay restorable for everyone
        assert any(k == {"KVSnapshot"} for (a, b), k in kinds(pc).items() if b == start)


def test_snapshot_before_start_restored_after_it_and_the_reverse():
    """Unquantized rows (taken before the switch) serve a target past the start after
    quantization; quantized rows never serve a target at or below the start."""
    m, rng, start = model(), random.Random(7), 12
    pc = new_cache(m, kv_bits=BITS, kv_group_size=GROUP, quantized_kv_start=start,
                   prefill_step_size=64, max_bytes=1 << 30)
    hist = History()
    short = prompt_of(rng, 8)
    got, _ = ask(pc, hist, m, short, 3, start)  # fed 0..9: all below the start
    assert all(k == {"KVSnapshot"} for k in kinds(pc).values())
    # Before -> after: extend it well past the start; the restore lands on 10 (below the
    # start, unquantized), prefill stops at 12 and switches there.
    longer = short + [t for t, _ in got][:2] + prompt_of(rng, 20)
    got, st = ask(pc, hist, m, longer, 3, start)
    assert st.restored_tokens == 10
    # A divergence at 20 > start restores 20 from unquantized [0, 12) rows (quantized on
    # the way) and quantized [12, 20) rows.
    div = longer[:20] + prompt_of(rng, 5)
    got, st = ask(pc, hist, m, div, 3, start)
    assert st.restored_tokens == 20
    # After -> before: a prompt shorter than the start whose answer crosses it switches
    # during decoding and records quantized rows from 0 ...
    pc2 = new_cache(m, kv_bits=BITS, kv_group_size=GROUP, quantized_kv_start=start,
                    max_bytes=1 << 30)
    hist = History()
    p = prompt_of(rng, 9)
    got, _ = ask(pc2, hist, m, p, 8, start)  # fed 9 + 7 = 16 tokens: switched at 12
    fed = p + [t for t, _ in got][:7]
    assert any("QuantizedSnapshot" in k for k in kinds(pc2).values())
    # ... which never serve a target at or below the start (recomputed instead) ...
    below = p[:7] + prompt_of(rng, 4)
    got, st = ask(pc2, hist, m, below, 3, start)
    assert st.restored_tokens == 0 and "no state" in st.reason
    # ... but do serve one past it (rows 8..15 were one-token passes: see `History`).
    past = fed + prompt_of(rng, 3)
    got, st = ask(pc2, hist, m, past, 3, start)
    assert st.restored_tokens == 16
    assert hist.singles(past, 16) == set(range(8, 16))


def test_per_request_kv_arguments_must_restate_the_schedule():
    m = model()
    pc = new_cache(m, kv_bits=BITS, kv_group_size=GROUP, quantized_kv_start=4)
    p = list(range(10))
    got, _ = run(pc, p, 2, kv_bits=BITS, kv_group_size=GROUP, quantized_kv_start=4)
    assert_same(canonical(m, p, 2, 4), got)
    with pytest.raises(ValueError, match="fixed per PrefixCache"):
        run(pc, p, 2, kv_bits=4, kv_group_size=GROUP, quantized_kv_start=4)
    plain = new_cache(m)
    run(plain, p, 2, kv_bits=None)  # mlx-lm's default: accepted
    with pytest.raises(ValueError, match="fixed per PrefixCache"):
        run(plain, p, 2, kv_bits=8)
    for bad, match in [(dict(kv_bits=7), "kv bits"), (dict(kv_bits=8, kv_group_size=16), "group size"),
                       (dict(kv_bits=8, quantized_kv_start=-1), "quantized_kv_start")]:
        with pytest.raises(ValueError, match=match):
            mk.PrefixCache(m, **bad)


def test_persisted_quantized_rows_round_trip(tmp_path):
    """Quantized and unquantized rows go to disk and come back; a restart with another
    schedule on the same directory loads nothing (each schedule has its own directory) and
    leaves the first schedule's cache intact."""
    m, rng, start = model(), random.Random(3), 6
    kw = dict(kv_bits=BITS, kv_group_size=GROUP, quantized_kv_start=start, max_bytes=1 << 30)
    p = prompt_of(rng, 30)
    pc = new_cache(m, cache_dir=str(tmp_path), **kw)
    hist = History()
    ask(pc, hist, m, p, 4, start)
    pc.close()
    kinds_saved = {type(s) for n in pc.manager.trie.nodes() for s in n.snapshots if s is not None}
    assert kinds_saved == {KVSnapshot, QuantizedSnapshot}
    pc2 = new_cache(m, cache_dir=str(tmp_path), **kw)
    q = p[:25] + prompt_of(rng, 4)
    got, st = ask(pc2, hist, m, q, 4, start)
    assert st.restored_tokens == 25
    pc2.close()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to say: another directory, nothing purged
        pc3 = new_cache(m, cache_dir=str(tmp_path), **{**kw, "quantized_kv_start": start + 1})
    assert pc3.cache_path != pc2.cache_path
    got, st = run(pc3, q, 4)
    assert st.restored_tokens == 0
    assert_same(canonical(m, q, 4, start + 1), got)
    pc3.close()
    pc4 = new_cache(m, cache_dir=str(tmp_path), **kw)  # back to the first schedule
    got, st = run(pc4, q, 4)
    assert st.restored_tokens == len(q) - 1  # pc2's request, whole
    assert_same(canonical(m, q, 4, start), got)
    pc4.close()


def test_chat_cli_kv_bits(tmp_path):
    """``mlx-kvcache chat --kv-bits`` passes the schedule to its PrefixCache: turns reuse
    the conversation; a setting mlx cannot quantize with is a clear error (exit 2)."""
    from test_cli import build_tiny_model_dir, run_chat, status_lines

    d = build_tiny_model_dir(tmp_path / "model", head_dim=32)
    args = ["--model", str(d), "--max-tokens", "6", "--kv-bits", "8", "--kv-group-size", "32",
            "--quantized-kv-start", "12"]
    rc, out, err = run_chat(args, "hello there\nsecond turn\n", tmp_path, timeout=120)
    assert rc == 0 and "Traceback" not in out + err, err
    t1, t2 = status_lines(out)
    assert t2["reused"] >= t1["prompt"] + t1["answer"] - 1 > 12  # reused past the start
    rc, out, err = run_chat(args[:2] + ["--kv-bits", "7"], "hi\n", tmp_path, timeout=120)
    assert rc == 2 and "kv bits must be one of" in err and "Traceback" not in err


class _ListWrapped(nn.Module):
    """A llama whose first layer's cache sits inside a ``CacheList`` (as falcon_h1's and
    deepseek_v32's do): mlx-lm's switch converts only top-level ``KVCache`` entries, so
    that layer stays in full precision while the other one is quantized."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    @property
    def layers(self):
        return self.inner.layers

    def make_cache(self):
        return [mlc.CacheList(mlc.KVCache()), mlc.KVCache()]

    def __call__(self, inputs, cache=None):
        cache = cache or self.make_cache()
        return self.inner(inputs, cache=[cache[0][0], cache[1]])


def test_layers_inside_a_cache_list_stay_in_full_precision():
    m, rng, start = _ListWrapped(model()), random.Random(11), 10
    pc = new_cache(m, kv_bits=BITS, kv_group_size=GROUP, quantized_kv_start=start,
                   prefill_step_size=6, max_bytes=1 << 30)
    hist = History()
    p = prompt_of(rng, 30)
    ask(pc, hist, m, p, 4, start)
    kinds_of = {type(s).__name__ for n in pc.manager.trie.nodes() for s in n.snapshots[:1] if s}
    assert kinds_of == {"KVSnapshot"}  # the CacheList layer
    got, st = ask(pc, hist, m, p[:25] + prompt_of(rng, 3), 4, start)
    assert st.restored_tokens == 25  # past the start, both layers


#: The log-prob bound for a model whose quantized rows are computed from inputs that went
#: through sliding windows (gemma3 below). Those inputs differ from the reference's by float
#: noise δ (~1e-6 relative: another buffer layout, another summation order; see FLOAT_TOL),
#: and 8-bit quantization (groups of 32: step s = group range / 255) rounds an element to the
#: other side of a rounding boundary when it lies within δ of one: a chance of about 2δ/s
#: (~1e-4) for each of the ~5,000 quantized elements of a request, so about one flipped step
#: per request, more or less depending on the BLAS kernel's order. Measured, one step flipped
#: in one of 300 random elements of this model's quantized cache: median 1.1e-5, 90th
#: percentile 1.2e-3, max 5.5e-3 in the next log-probs; seen across OpenBLAS kernels: 3.8e-6
#: (Cooperlake, SkylakeX), 1.4e-5 (Haswell, Zen), 1.3e-4 (Prescott). So 1e-2: the worst
#: single flip measured, with a margin of ~2. What it still catches here: any wrong row (1.9)
#: or wrong window; what it cannot, a switch one token late (1.3e-3), is held to FLOAT_TOL by
#: the window-free tests above, whose rows are computed in the reference's own order.
WINDOW_FLIP_TOL = 1e-2


def test_sliding_window_model_quantizes_only_its_full_attention_layers():
    """gemma3 (window 8 / full attention): mlx-lm's generate raises for rotating caches
    with kv_bits; here the full-attention layers follow the schedule and the windows stay
    in full precision (the reference converts only mlx-lm's ``KVCache`` entries).

    A window's buffer layout depends on the prefill chunking and on what was restored, so
    the inputs of the full-attention layers (computed through the windows) differ from the
    reference's by float noise, and quantization can round that noise to a whole step (see
    `WINDOW_FLIP_TOL`). The reference prefills in the cache's chunk size, which keeps the
    noise small (mlx-lm's own cold runs with 5-token and whole-prompt chunks differ by
    1.2e-4 here), and the log-probs are held to `WINDOW_FLIP_TOL`, not `FLOAT_TOL`."""
    from mlx_lm.models import gemma3_text

    mx.random.seed(2)
    m = gemma3_text.Model(gemma3_text.ModelArgs(
        model_type="gemma3_text", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
        num_attention_heads=2, head_dim=32, num_key_value_heads=1, vocab_size=V,
        query_pre_attn_scalar=32, sliding_window=8, sliding_window_pattern=2))
    mx.eval(m.parameters())
    rng, start = random.Random(12), 14
    pc = new_cache(m, kv_bits=BITS, kv_group_size=GROUP, quantized_kv_start=start,
                   prefill_step_size=5, snapshot_interval=8, max_bytes=1 << 30)
    hist = History()
    conv = prompt_of(rng, 20)
    for _ in range(3):
        got, st = ask(pc, hist, m, conv, 4, start, chunk=5, tol=WINDOW_FLIP_TOL)
        conv = conv + [t for t, _ in got][:3] + prompt_of(rng, 5)
    assert st.restored_tokens > start
    got, st = ask(pc, hist, m, conv[:17] + prompt_of(rng, 4), 4, start, chunk=5,
                  tol=WINDOW_FLIP_TOL)
    assert 8 < st.restored_tokens <= 17
    check_no_leaks(pc)
    # Quantized rows in the full-attention layers (1 and 3) past the start, never in a window.
    past = [n for n in pc.manager.trie.nodes() if n.start >= start and n.snapshots]
    assert past and all({type(n.snapshots[i]).__name__ for i in (1, 3)} == {"QuantizedSnapshot"}
                        and all(type(n.snapshots[i]).__name__ != "QuantizedSnapshot"
                                for i in (0, 2)) for n in past)
    # The bound still tells a wrong cache: one prompt row changed moves the first answer
    # token's log-probs by far more (1.9 measured).
    p = conv[:20]
    wrong = p[:10] + [(p[10] + 1) % V] + p[11:]
    a, b = canonical(m, p, 1, start, chunk=5), canonical(m, wrong, 1, start, chunk=5)
    assert mx.abs(a[0][1] - b[0][1]).max().item() > 10 * WINDOW_FLIP_TOL


def test_passes_of_many_tokens_attend_over_the_dequantized_rows():
    """From two tokens a pass on, our quantized caches meet the model as plain ones
    (`DequantizedView`): the rows are written quantized as always, attention reads them
    dequantized (the same attention: a quantized matmul is a matmul with the dequantized
    matrix); one-token passes and mlx-lm's own caches keep mlx-lm's quantized path."""
    from mlx_kvcache.caches import QuantizedKVCache
    from mlx_kvcache.caches.quantized import DequantizedView
    from mlx_kvcache.generation.model_pair import attention_views

    m = model()
    rng = random.Random(5)
    prompt = [rng.randrange(V) for _ in range(40)]

    def cached(n):
        cs = [QuantizedKVCache(GROUP, BITS, 0) for _ in m.layers]
        m(mx.array(prompt[:n])[None], cache=cs)
        mx.eval([c.state for c in cs])
        return cs

    quant, plain = cached(24), cached(24)
    x = mx.array(prompt[24:])[None]
    views = attention_views(plain, 16)
    assert all(type(v) is DequantizedView and not hasattr(v, "bits") for v in views)
    assert views[0].offset == 24 and views[0].make_mask(16) is not None
    a, b = m(x, cache=quant)[0], m(x, cache=views)[0]
    a, b = a - mx.logsumexp(a, axis=-1, keepdims=True), b - mx.logsumexp(b, axis=-1, keepdims=True)
    assert mx.abs(a - b).max().item() < FLOAT_TOL
    # What they store: quantized rows, the first layer's identical (the same inputs), the
    # later ones' at most a quantization step apart (their inputs differ by float noise).
    for i, (q, p) in enumerate(zip(quant, plain)):
        assert type(p) is QuantizedKVCache and p.offset == q.offset == 40
        for u, w in ((q.keys, p.keys), (q.values, p.values)):
            if i == 0:
                assert all(mx.array_equal(s[..., :40, :], t[..., :40, :]) for s, t in zip(u, w))
            du = mx.dequantize(*(t[..., :40, :] for t in u), group_size=GROUP, bits=BITS)
            dw = mx.dequantize(*(t[..., :40, :] for t in w), group_size=GROUP, bits=BITS)
            step = mx.abs(u[1][..., :40, :]).max().item()
            assert mx.abs(du - dw).max().item() <= 1.01 * step + 1e-6
    assert attention_views(plain, 1) == plain  # one token: mlx-lm's quantized path
    native = [mlc.QuantizedKVCache(group_size=GROUP, bits=BITS)]
    assert attention_views(native, 8) == native
