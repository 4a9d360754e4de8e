"""The disk as the trie's second tier (issue 16), in process on `PrefixCache`.

What the memory budget lets go stays on disk (parked: in the trie, no memory held) and
comes back, checked, when a request needs it: answers equal a cold mlx-lm run (log-probs
to 1e-4), both budgets hold after every request, memory is measured with
``mx.get_active_memory()``, a file damaged while its node is parked is recomputed (never
served), the disk budget's evictions remove parked nodes from the trie, a restart keeps
the tier, and compressed cold snapshots are keyed apart from exact ones.
"""

import gc
import random
import sys
import warnings
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from models import V, build
from reference import (  # noqa: F401  (track_snapshots is an autouse fixture)
    MARGIN, TOK, assert_same, check_no_leaks, cold, interleaved, model, new_cache, run,
    track_snapshots,
)

from mlx_kvcache.generation.sizing import checkpoint_bytes
from mlx_kvcache.caches import make_prompt_cache
from mlx_kvcache.prefix.trie import PrefixTrie
from mlx_kvcache.store import FORMAT_VERSION

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _index import query  # noqa: E402
from test_trie import Env  # noqa: E402

N = 3  # answer tokens


def active() -> int:
    gc.collect()
    mx.clear_cache()
    return mx.get_active_memory()


def ours(ws, part=""):
    return [str(w.message) for w in ws if issubclass(w.category, RuntimeWarning)
            and str(w.message).startswith("mlx_kvcache: ") and part in str(w.message)]


def files(pc):
    return sorted(p for p in Path(pc.cache_path).iterdir() if p.name.endswith(".safetensors"))


def rows(pc):
    return {u for (u,) in query(pc.cache_path, "SELECT uid FROM nodes")}


def park_all(pc):
    """Let the memory budget go to zero once: every node with its files on disk parks."""
    pc.flush()
    pc.manager.fit_bytes(0)


class Sessions:
    """``n`` conversations, each a private head, growing turn by turn with the answer
    and a new message."""

    def __init__(self, n, head=24, msg=6, seed=0):
        rng = random.Random(seed)
        self.rng, self.msg = rng, msg
        self.prompts = [[rng.randrange(V) for _ in range(head)] for _ in range(n)]

    def answered(self, i, toks):
        self.prompts[i] = self.prompts[i] + toks + [self.rng.randrange(V) for _ in range(self.msg)]


def park(trie, node) -> int:
    """What the disk tier does to a node once its copies are registered."""
    for s in node.snapshots:
        if s is not None:
            s.park()
    return -trie.recount(node, parked=True)


def per_token(m) -> int:
    return checkpoint_bytes(m, lambda: make_prompt_cache(m), 1)


# -- the round robin: every later turn from disk, exact; both budgets; a restart ----------
def budgets(m, s: "Sessions", turns: int, **kw):
    """Per round, a memory budget that holds one request's own caches and two and a half
    of ``s``'s sessions as they are in that round (measured: session 0 alone through every
    turn; on a hybrid every turn adds whole states): between requests, when the request's
    caches are gone, at most three of the five sessions stay in memory."""
    probe = new_cache(m, max_bytes=1 << 30, **kw)
    p, sizes = list(s.prompts[0]), []
    for _ in range(turns):
        got, _ = run(probe, p, N)
        sizes.append(probe.stats.snapshot_bytes)
        p = p + [t for t, _ in got] + [0] * s.msg
    gen = probe.stream_generate(TOK, p, N)
    next(gen)
    live = probe.stats.live_bytes
    gen.close()
    return [live + int(2.5 * sizes[max(t - 1, 0)]) for t in range(turns)]


@pytest.mark.parametrize("name", ["llama", "qwen3_next"])
def test_round_robin_sessions_are_served_from_disk(tmp_path, name):
    m = model(name)
    # Heads long next to a turn (sessions barely grow) and next to a 256-row buffer step.
    s = Sessions(5, head=400, msg=4, seed=3)
    turns = 3
    kw = dict(pre_end_margin=MARGIN, snapshot_interval=1024)
    per_round = budgets(m, s, turns, **kw)
    disk = 8 << 20
    pc = new_cache(m, cache_dir=str(tmp_path), max_bytes=per_round[0], max_disk_bytes=disk, **kw)
    for t in range(turns):
        budget = pc.manager.max_bytes = per_round[t]
        for i in range(5):
            p = s.prompts[i]
            got, st = run(pc, p, N)
            assert_same(cold(m, p, N), got)
            if t:  # at most three sessions in memory: this one was used five requests ago
                assert st.disk_tokens > 0 and st.restored_tokens >= len(p) - s.msg - 1, st
            pc.flush()
            assert pc.nbytes <= budget and pc.stats.disk_bytes <= disk
            check_no_leaks(pc)
            # Every node is on disk (rows mirror the trie); only parked ones lack memory.
            assert {n.uid for n in pc.manager.trie.nodes()} == rows(pc)
            s.answered(i, [tok for tok, _ in got])
    stats = pc.stats
    assert stats.disk_tokens > 0 and stats.disk_nodes > 0 and stats.demoted_bytes > 0
    pc.close()
    # A restart keeps the tier: nothing read at load, every session continues from disk.
    fresh = new_cache(m, cache_dir=str(tmp_path), max_bytes=per_round[-1], max_disk_bytes=disk, **kw)
    assert fresh.nbytes == 0 and fresh.stats.disk_nodes == fresh.stats.nodes > 0
    for i in range(5):
        p = s.prompts[i]
        got, st = run(fresh, p, N)
        assert_same(cold(m, p, N), got)
        assert st.disk_tokens == st.restored_tokens > 0
        assert fresh.nbytes <= per_round[-1]
    fresh.close()


def test_a_node_whose_write_is_in_progress_is_parked_not_dropped(tmp_path):
    """The writer lags (a slow disk): the budget evicts the last request's nodes while
    their capture is still being written. Eviction waits for that write and parks them;
    the same prompt then reads them back from disk."""
    import time

    m = model("llama")
    rng = random.Random(11)
    p = [rng.randrange(V) for _ in range(40)]
    pc = new_cache(m, cache_dir=str(tmp_path), max_bytes=1 << 30)

    def slow(write):
        def run_slowly(*a, **kw):
            time.sleep(0.5)
            return write(*a, **kw)
        return run_slowly
    pc.core.autosaver.wrap_write(slow)
    got, _ = run(pc, p, N)
    assert pc.core.autosaver.pending  # submitted, not yet written
    nodes = pc.stats.nodes
    pc.manager.fit_bytes(0)  # the budget takes everything now
    st = pc.stats
    assert st.nodes == nodes > 0 and st.disk_nodes == nodes and st.snapshot_bytes == 0, st
    again, st = run(pc, p, N)
    assert_same(got, again)
    assert st.disk_tokens == st.restored_tokens == len(p) - 1, st
    check_no_leaks(pc)
    pc.close()


# -- memory, measured -------------------------------------------------------------------------
def test_parking_frees_memory_and_placeholders_allocate_nothing(tmp_path):
    m = model("llama")
    rng = random.Random(5)
    ps = [[rng.randrange(V) for _ in range(1200)] for _ in range(2)]
    pc = new_cache(m, cache_dir=str(tmp_path), max_bytes=1 << 30)
    for p in ps:
        run(pc, p, N)
    pc.flush()
    counted = pc.stats.snapshot_bytes
    assert counted > 1 << 20
    before = active()
    park_all(pc)
    freed = before - active()
    st = pc.stats
    print(f"counted {counted} B, parking freed {freed} B")
    assert st.snapshot_bytes == 0 and st.disk_nodes == st.nodes
    assert counted * 0.9 <= freed <= counted + (64 << 10), (counted, freed)
    check_no_leaks(pc)
    # Filling one node back brings back its bytes, counted and really held.
    base = active()
    got, st = run(pc, ps[0], N)
    assert_same(cold(m, ps[0], N), got)
    assert st.disk_tokens == st.restored_tokens == len(ps[0]) - 1
    held = pc.stats.snapshot_bytes
    grew = active() - base
    print(f"filled {held} B counted, {grew} B measured")
    assert 0 < held < counted and abs(grew - held) <= held * 0.1 + (64 << 10), (held, grew)
    check_no_leaks(pc)
    pc.close()
    # Loading the directory reads the index only: parked nodes hold nothing.
    base = active()
    fresh = new_cache(m, cache_dir=str(tmp_path), max_bytes=1 << 30)
    loaded = fresh.stats
    assert loaded.nodes > 0 and loaded.snapshot_bytes == 0 and loaded.disk_bytes > counted
    assert active() - base < 256 << 10, active() - base
    fresh.close()


def test_demotion_and_promotion_accounting_on_the_trie():
    """Parking keeps a node's place and its snapshots' shapes, frees its counted bytes,
    refuses reads until filled; eviction with a tier parks branch points too, and drops
    (as without a tier) what the tier has no copy of."""
    env = Env(("kv", "state"))
    t = env.trie
    a = env.insert([1, 2, 3, 4])
    b = env.insert([1, 2, 3, 9, 9])  # splits a: [1,2,3] is a branch point
    c = env.insert([7, 7])
    branch = b.parent
    before = t.nbytes
    park(t, branch)
    assert branch.parked and branch.nbytes == 0 and t.nbytes < before
    t.check_invariants()
    kv = branch.snapshots[0]
    with pytest.raises(Exception, match="parked"):
        kv.content
    assert kv.shapes() and kv.size > 0 and not kv.closed
    kv.fill({"tok": np.asarray([1, 2, 3], dtype=np.int64)})
    t.recount(branch, parked=False)
    assert t.nbytes == before
    t.check_invariants()

    class Tier:
        def __init__(self, copies, writing=()):
            self.copies, self.writing, self.waits = copies, set(writing), 0

        def demotable(self, n):
            return n in self.copies

        def demote(self, n):
            return park(t, n)

        def await_copies(self):  # the writes in progress finish
            self.waits += 1
            done, self.writing = self.writing, set()
            self.copies |= done
            return bool(done)
    t.tier = Tier({branch, a})
    for n in (a, b, c, branch):
        t.touch(n)
    t.evict(0)
    t.check_invariants()
    assert branch.parked and a.parked and not branch.detached and not a.detached
    assert b.detached and c.detached  # no copy: dropped as without a tier
    assert t.nbytes == 0
    assert t.tier.waits == 1  # asked once, before the first drop


def test_eviction_waits_for_a_copy_being_written_before_dropping_its_node():
    """A node whose capture is still being written when the budget evicts it is parked
    once the write is done, not dropped; a node never captured is dropped after that one
    wait (never one wait per node)."""
    env = Env(("kv", "state"))
    t = env.trie
    a, b, c = env.insert([1, 2, 3]), env.insert([4, 5, 6]), env.insert([7, 8])

    class Tier:
        def __init__(self):
            self.copies, self.writing, self.waits = {a}, {b}, 0

        def demotable(self, n):
            return n in self.copies

        def demote(self, n):
            return park(t, n)

        def await_copies(self):
            self.waits += 1
            done, self.writing = self.writing, set()
            self.copies |= done
            return bool(done)
    t.tier = Tier()
    t.candidates.rebuild()
    for n in (c, b, a):  # c oldest: the first victim has no copy yet
        t.touch(n)
    t.evict(0)
    t.check_invariants()
    assert a.parked and b.parked and not b.detached  # b's write finished: parked
    assert c.detached and t.tier.waits == 1  # never captured: dropped after one wait
    assert t.nbytes == 0


# -- the disk budget --------------------------------------------------------------------------
def test_disk_eviction_removes_parked_nodes_and_keeps_resident_ones(tmp_path):
    m = model("llama")
    rng = random.Random(9)
    ps = [[rng.randrange(V) for _ in range(40)] for _ in range(3)]
    pc = new_cache(m, cache_dir=str(tmp_path), max_bytes=1 << 30, max_disk_bytes=1 << 30)
    for p in ps:
        run(pc, p, N)
    pc.flush()
    trie = pc.manager.trie
    nodes = {tuple(trie.tokens_to(n)[:40]): n for n in trie.nodes()}
    a, b, c = (nodes[tuple(p)] for p in ps)
    pc.manager.run(lambda: pc.store.tier.demote(a))  # a parked, b and c in memory
    assert a.parked and not b.parked
    # The disk budget shrinks to one node's files: the writer evicts the oldest rows.
    store = pc.store
    store.max_disk_bytes = store.disk_bytes - 2 * sum(f.stat().st_size for f in files(pc)[:1])
    pc.manager.run(lambda: trie.touch(c))
    pc.save()
    left = rows(pc)
    assert a.uid not in left and b.uid not in left, "the budget did not evict: proves nothing"
    pc.manager.run(store.capture)  # settles what the disk let go
    assert a.detached, "a parked node the disk let go must leave the trie"
    assert not b.detached and not b.parked, "a node in memory stays"
    check_no_leaks(pc)
    # b comes back on disk when a request below it records (its row first).
    store.max_disk_bytes = 1 << 30
    for p in (ps[0], ps[1] + [5, 6, 7]):
        got, st = run(pc, p, N)
        assert_same(cold(m, p, N), got)
    pc.flush()
    assert b.uid in rows(pc) and {n.uid for n in trie.nodes()} == rows(pc)
    pc.close()


# -- damage while parked ----------------------------------------------------------------------
def test_a_file_damaged_while_parked_is_recomputed_never_served(tmp_path):
    m = model("llama")
    rng = random.Random(13)
    p = [rng.randrange(V) for _ in range(60)]
    pc = new_cache(m, cache_dir=str(tmp_path), max_bytes=1 << 30)
    run(pc, p, N)
    park_all(pc)
    (f,) = files(pc)
    data = bytearray(f.read_bytes())
    data[-9] ^= 0x20
    f.write_bytes(bytes(data))
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        got, st = run(pc, p, N)
    assert_same(cold(m, p, N), got)
    assert st.restored_tokens == 0 and st.disk_tokens == 0
    assert len(ours(ws, "checksum")) == 1, ours(ws)
    check_no_leaks(pc)
    got, st = run(pc, p, N)  # recorded anew, from memory now
    assert_same(cold(m, p, N), got)
    assert st.restored_tokens == len(p) - 1 and st.disk_tokens == 0
    pc.close()


# -- concurrency ------------------------------------------------------------------------------
def test_interleaved_requests_while_nodes_park_and_fill(tmp_path):
    """Generators advanced alternately while a tight budget parks the others' nodes and
    each request fills its own: every answer exact, nothing wrong stored."""
    m = model("qwen3_next")
    s = Sessions(4, head=30, seed=21)
    pc = new_cache(m, cache_dir=str(tmp_path), max_bytes=1 << 30, pre_end_margin=MARGIN,
                   snapshot_interval=8)
    budget = None
    for rnd in range(3):
        outs = interleaved([pc.stream_generate(TOK, p, N) for p in s.prompts])
        for i, p in enumerate(s.prompts):
            assert_same(cold(m, p, N), outs[i])
            s.answered(i, [t for t, _ in outs[i]])
        pc.flush()
        check_no_leaks(pc)
        if budget is None:  # four requests' own caches and about one session's snapshots
            budget = pc.manager.max_bytes = 4 * 160_000 + pc.nbytes // 4
        assert pc.nbytes <= budget
        park_all(pc)  # the next round starts with every node on disk only
    st = pc.stats
    assert st.disk_tokens > 0 and st.demoted_bytes > 0 and st.promoted_bytes > 0
    pc.close()


# -- compressed cold snapshots ---------------------------------------------------------------
def test_cold_bits_compress_what_leaves_memory_and_are_keyed_apart(tmp_path):
    # KV layers are compressed (head dim 32: a quantization group), recurrent states not.
    m = build("qwen3_next", head_dim=32)
    rng = random.Random(17)
    ps = [[rng.randrange(V) for _ in range(200)] for _ in range(3)]
    exact = new_cache(m, cache_dir=str(tmp_path), max_bytes=1 << 30, pre_end_margin=MARGIN)
    cold8 = new_cache(m, cache_dir=str(tmp_path), max_bytes=1 << 30, pre_end_margin=MARGIN,
                      cold_bits=8)
    assert exact.cache_path != cold8.cache_path  # keyed apart: never served as exact
    for p in ps:
        for pc in (exact, cold8):
            got, _ = run(pc, p, N)
            assert_same(cold(m, p, N), got)
    for pc in (exact, cold8):
        pc.flush()
    kinds = [json_layers(f) for f in files(cold8)]
    assert any(k.get("quantized") for k in kinds) and all(k.get("recurrent") for k in kinds)
    ratio = cold8.stats.disk_bytes / exact.stats.disk_bytes
    print(f"disk bytes, 8-bit cold / exact: {ratio:.2f}")
    # Memory hits stay exact with cold bits on.
    got, st = run(cold8, ps[0], N)
    assert_same(cold(m, ps[0], N), got)
    # From disk: close to the cold run, not claimed exact.
    park_all(cold8)
    got, st = run(cold8, ps[1], N)
    ref = cold(m, ps[1], N)
    assert st.disk_tokens > 0
    diff = max(mx.abs(a - b).max().item() for (_, a), (_, b) in zip(ref, got))
    print(f"max |d logprob| from 8-bit cold snapshots: {diff:.4f}")
    assert 0 < diff < 0.5
    exact.close()
    cold8.close()
    # Each setting reloads its own directory only.
    again = new_cache(m, cache_dir=str(tmp_path), max_bytes=1 << 30, pre_end_margin=MARGIN)
    got, st = run(again, ps[1], N)
    assert_same(cold(m, ps[1], N), got)
    assert st.disk_tokens > 0
    again.close()
    dirs = [p for p in (tmp_path / f"v{FORMAT_VERSION}").iterdir() if p.is_dir()]
    assert len(dirs) == 2
    assert ratio < 0.8  # (the recurrent states, a good part of these files, stay exact)


def json_layers(f):
    import json
    import struct

    data = f.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    meta = json.loads(data[8:8 + n])["__metadata__"]
    return {ent["kind"]: True for ent in json.loads(meta["layers"]).values()}


# -- budgets that follow the model -----------------------------------------------------------
def test_a_budget_below_one_checkpoint_is_told_once_with_the_size_needed():
    m = model("qwen3_next")
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        small = new_cache(m, max_bytes=4096)
        fine = new_cache(m, max_bytes=1 << 30)
        default = new_cache(m)
    msgs = ours(ws, "cannot hold one checkpoint")
    assert len(msgs) == 1 and "at least" in msgs[0], ours(ws)
    assert small.budget_warning and fine.budget_warning is None
    assert default.stats.max_bytes > 0 and "the model" in default.ram_budget_note
    assert isinstance(PrefixTrie, type)


# -- eviction with a tier, on random tries (hypothesis) ---------------------------------------
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from mlx_kvcache.prefix import eviction  # noqa: E402
from test_trie_fast import OPS, SETTINGS, build as random_trie  # noqa: E402


class FakeDisk:
    """A tier that has a copy of the nodes ``pick`` chooses; parked snapshots are filled
    back from the copy before the trie splits or merges them (as the store's ops do)."""

    def __init__(self, trie, pick):
        self.trie, self.pick, self.copies, self.parked = trie, pick, {}, []
        for i, op in enumerate(trie.ops):
            trie.ops[i] = self.guard(op)

    def guard(self, op):
        disk = self

        class Guarded:
            def split(self, s, at):
                disk.fill(s)
                return op.split(s, at)

            def merge(self, a, b):
                disk.fill(a)
                disk.fill(b)
                return op.merge(a, b)
        return Guarded()

    def fill(self, s):
        if s is not None and s.parked:
            s.fill(self.copies[id(s)])

    def demotable(self, n):
        return self.pick(tuple(self.trie.tokens_to(n)))

    def await_copies(self):
        return False  # nothing is being written

    def demote(self, n):
        for s in n.snapshots:
            if s is not None and not s.parked:
                self.copies[id(s)] = dict(s._arrays)
        self.parked.append(n)
        return park(self.trie, n)


@settings(SETTINGS, max_examples=150)
@given(ops=OPS, budget=st.floats(0, 1), salt=st.integers(0, 3), one_by_one=st.booleans())
def test_eviction_with_a_tier_parks_what_has_a_copy_and_drops_the_rest(ops, budget, salt,
                                                                       one_by_one):
    env = random_trie(ops)
    t = env.trie
    disk = t.tier = FakeDisk(t, lambda toks: (hash(toks) + salt) % 3 != 0)
    t.candidates.rebuild()  # (as the store does when it attaches itself)
    before = {id(n): tuple(t.tokens_to(n)) for n in t.nodes()}
    target = int(t.nbytes * budget)
    if one_by_one:  # as the ranks of a sharded model do: agreed steps
        while t.nbytes > target and eviction.evict_one(t, disk.demotable) is not None:
            pass
    else:
        t.evict(target)
    t.check_invariants()
    t.candidates.check()
    for n in disk.parked:  # parked, never dropped: same place, same tokens
        assert not n.detached and tuple(t.tokens_to(n)) == before[id(n)]
    if t.nbytes > target:  # only what could not go is left in memory
        assert all(n.in_use or n.parked or n.nbytes == 0
                   or (len(n.children) > 1 and not disk.demotable(n)) for n in t.nodes())
    for n in t.nodes():  # every KV snapshot still holds its node's edge, parked or not
        for s in n.snapshots:
            disk.fill(s)
            if s is not None and s.kind == "fake_kv":
                assert s.content == list(n.tokens)
