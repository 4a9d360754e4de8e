"""Model-level parity: our caches vs mlx-lm's own, with snapshot / restore in between."""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache as mlx_make_prompt_cache

import mlx_kvcache as mk
from models import MODELS, V, build
from reference import FLOAT_TOL


@pytest.fixture(scope="module", params=MODELS)
def model(request):
    return request.param, build(request.param)


def forward(m, caches, toks):
    out = m(toks, cache=caches)
    mk.settle(caches, toks.shape[1])
    return out


def snapshot_all(caches):
    return [c.snapshot(0) for c in mk.leaf_caches(caches)]


def restore_all(caches, snaps, target):
    for c, s in zip(mk.leaf_caches(caches), snaps):
        assert c.restore(None, target) or c.restore(s, target), (c, target)


@pytest.mark.parametrize("split", [5, 23])
def test_prefix_snapshot_diverge_restore_suffix(model, split):
    name, m = model
    mx.random.seed(0)
    toks = mx.random.randint(0, V, (1, 40))
    ref = m(toks, cache=mlx_make_prompt_cache(m))  # one pass, mlx-lm caches

    caches = mk.make_prompt_cache(m)
    a = forward(m, caches, toks[:, :split])
    snaps = snapshot_all(caches)
    forward(m, caches, mx.random.randint(0, V, (1, 11)))  # a divergent continuation
    restore_all(caches, snaps, split)
    b = forward(m, caches, toks[:, split:])
    out = mx.concatenate([a, b], axis=1)
    assert mx.abs(out - ref).max().item() < FLOAT_TOL
    assert all(c.offset == 40 for c in mk.leaf_caches(caches))


def test_decode_steps_wrap_and_restore_across_the_wrap(model):
    """Single-token steps exercise the in-place ring path of sliding windows (window 8)."""
    name, m = model
    mx.random.seed(1)
    toks = mx.random.randint(0, V, (1, 36))
    ref_cache = mlx_make_prompt_cache(m)
    ref = [m(toks[:, :12], cache=ref_cache)]
    ref += [m(toks[:, i : i + 1], cache=ref_cache) for i in range(12, 36)]
    ref = mx.concatenate(ref, axis=1)

    caches = mk.make_prompt_cache(m)
    outs = [forward(m, caches, toks[:, :12])]
    outs += [forward(m, caches, toks[:, i : i + 1]) for i in range(12, 20)]  # window wraps
    snaps = snapshot_all(caches)
    for t in mx.random.randint(0, V, (13,)).tolist():  # diverge, one token at a time
        forward(m, caches, mx.array([[t]]))
    restore_all(caches, snaps, 20)
    outs += [forward(m, caches, toks[:, i : i + 1]) for i in range(20, 36)]
    out = mx.concatenate(outs, axis=1)
    assert mx.abs(out - ref).max().item() < FLOAT_TOL


def test_rotating_restore_refused_inside_wrapped_window():
    m = build("gemma3_text")
    caches = mk.make_prompt_cache(m)
    forward(m, caches, mx.random.randint(0, V, (1, 20)))
    rot = [c for c in mk.leaf_caches(caches) if isinstance(c, mk.RotatingKVCache)]
    assert rot and all(c.wrapped for c in rot)
    snap = rot[0].snapshot(0)
    before = rot[0].offset
    assert rot[0].restore(None, 15) is False
    assert rot[0].restore(snap, 15) is False
    assert rot[0].offset == before


def test_stream_generate_with_our_caches_matches_mlx_lm(model):
    from mlx_lm.generate import generate_step

    name, m = model
    prompt = mx.array([3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 38, 32, 79, 50, 28, 8, 41])

    def run(cache):
        return [(int(t), lp) for (t, lp), _ in zip(generate_step(prompt, m, prompt_cache=cache, max_tokens=8), range(8))]

    ours, theirs = run(mk.make_prompt_cache(m)), run(mlx_make_prompt_cache(m))
    assert [t for t, _ in ours] == [t for t, _ in theirs]
    assert max(mx.abs(a - b).max().item() for (_, a), (_, b) in zip(ours, theirs)) < FLOAT_TOL
