"""``max_bytes`` means all memory the cache holds — snapshots and live caches — at every
moment, measured with ``mx.get_active_memory()``, not inferred from ``nbytes``."""

import gc
import random

import mlx.core as mx

from models import V
from reference import (  # noqa: F401  (track_snapshots is an autouse fixture)
    MARGIN, TOK, assert_same, check_no_leaks, cold, model, new_cache, run, track_snapshots,
)


def active() -> int:
    gc.collect()
    mx.clear_cache()
    return mx.get_active_memory()


def test_counted_bytes_are_the_bytes_freed_one_kv_head():
    """gemma3_text has one KV head: a slice of its live buffer is row-contiguous, and a
    snapshot that kept it would pin the whole 256-row buffer while counting a few rows."""
    m = model("gemma3_text")
    pc = new_cache(m, max_bytes=256 << 10, pre_end_margin=MARGIN, snapshot_interval=8)
    rng = random.Random(1)
    head = [rng.randrange(V) for _ in range(12)]
    for i in range(10):
        run(pc, head + [rng.randrange(V) for _ in range(rng.randrange(3, 40))], 3)
    counted = pc.nbytes
    assert counted > 0
    before = active()
    pc.clear()
    freed = before - active()
    print(f"counted {counted} B, clear() freed {freed} B")
    assert freed <= counted + (16 << 10), (counted, freed)
    assert freed >= counted * 0.9, (counted, freed)


def test_budget_holds_during_a_request():
    """A hybrid model with frequent prefill snapshots stays within max_bytes mid-request,
    skipping (and reporting) the snapshots that do not fit."""
    m = model("qwen3_next")
    budget = 96 << 10
    pc = new_cache(m, max_bytes=budget, pre_end_margin=MARGIN, snapshot_interval=4)
    mgr = pc.manager
    peaks = []
    record = mgr._record

    def watched(*a, **k):
        node = record(*a, **k)
        peaks.append(mgr.nbytes)
        return node
    mgr._record = watched
    rng = random.Random(2)
    skipped = 0
    for i in range(4):
        p = [rng.randrange(V) for _ in range(120)]
        got, s = run(pc, p, 3)
        assert_same(cold(m, p, 3), got)
        skipped += s.snapshots_skipped
        assert pc.nbytes <= budget
        check_no_leaks(pc)
    print(f"budget {budget} B, peak during requests {max(peaks)} B, snapshots skipped {skipped}")
    assert max(peaks) <= budget, (max(peaks), budget)
    assert skipped > 0 and pc.stats.snapshots_skipped == skipped


def test_live_caches_are_counted_and_reported():
    m = model("llama")
    p = list(range(1, 100))
    pc = new_cache(m)
    g = pc.stream_generate(TOK, p, 3)
    next(g)  # a request in flight: its caches are live bytes
    st = pc.stats
    assert st.live_bytes > 0 and st.bytes_held == st.live_bytes + st.snapshot_bytes == pc.nbytes
    list(g)
    st = pc.stats  # finished: only the trie holds its tokens
    assert st.live_bytes == 0 and st.snapshot_bytes > 0 and st.bytes_held == pc.nbytes
    # Kept for a copy-free next turn, the idle set counts too, and goes first when tight.
    keep = new_cache(m, keep_live=True)
    run(keep, p, 3)
    st = keep.stats
    assert st.live_bytes > 0 and st.snapshot_bytes > 0
    assert st.bytes_held == st.live_bytes + st.snapshot_bytes == keep.nbytes
    small = new_cache(m, keep_live=True, max_bytes=st.snapshot_bytes + 1024)
    got, s = run(small, p, 3)
    assert_same(cold(m, p, 3), got)
    assert small.stats.live_bytes == 0 and small.nbytes <= small.stats.max_bytes
    got, s = run(small, p, 3)  # still a hit, restored from the trie
    assert s.restored_tokens == len(p) - 1
    check_no_leaks(small)
