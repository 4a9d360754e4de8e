"""The SQLite index: per request it writes only the nodes that changed, the rows always
mirror the trie, a split keeps referencing the file it cut, and node ids survive a
restart. Answers are compared with a cold run by log-probs."""

from __future__ import annotations

import random
import sys
import time
import warnings
from pathlib import Path

import mlx_kvcache  # noqa: F401  (before mlx)

import numpy as np
import pytest

from mlx_kvcache import PrefixCache
from mlx_kvcache.store import FORMAT_VERSION, save
from mlx_kvcache.store.index import decode_layers

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _index import query, referenced_files  # noqa: E402
from _persist_child import TOK, build_model, prompts  # noqa: E402
from reference import FLOAT_TOL  # noqa: E402



def model_dir(root):
    (d,) = [p for p in (Path(root) / f"v{FORMAT_VERSION}").iterdir() if p.is_dir()]
    return d


def ours(ws, part=""):
    return [str(w.message) for w in ws if issubclass(w.category, RuntimeWarning)
            and str(w.message).startswith("mlx_kvcache: ") and part in str(w.message)]


def run_lp(pc, prompt, n=4):
    lps = [np.array(r.logprobs) for r in pc.stream_generate(TOK, prompt, n)]
    return lps, pc.last_request


def assert_cold(name, prompt, lps, n=4):
    cold, st = run_lp(PrefixCache(build_model(name)), prompt, n)
    assert st.restored_tokens == 0
    assert max(float(np.abs(a - b).max()) for a, b in zip(lps, cold)) < FLOAT_TOL


def assert_mirrors(pc):
    """The index's rows are exactly the trie's nodes (id, parent, edge, end), and every
    file a row references is listed and on disk."""
    trie = pc.manager.trie
    d = pc.cache_path
    live = {n.uid: (0 if n.parent is trie.root else n.parent.uid, list(n.tokens), n.end)
            for n in trie.nodes()}
    rows = {u: (p, np.frombuffer(t, dtype="<i8").tolist(), e)
            for u, p, t, e in query(d, "SELECT uid, parent, tokens, end_ FROM nodes")}
    assert rows == live
    files = referenced_files(d)
    refs = {f for (f,) in query(d, "SELECT DISTINCT file FROM refs")}
    assert refs <= files and all((d / f).is_file() for f in files)
    kids = dict(query(d, "SELECT uid, nchildren FROM nodes"))
    assert kids == {n.uid: len(n.children) for n in trie.nodes()}


def test_requests_never_walk_the_trie_to_save(tmp_path):
    pc = PrefixCache(build_model("llama"), cache_dir=str(tmp_path))
    ps = prompts(12, length=40, seed=3)
    for p in ps[:8]:
        run_lp(pc, p)
    pc.flush()
    trie = pc.manager.trie
    walks = []
    real = trie.nodes
    trie.nodes = lambda: walks.append(1) or real()
    try:
        for p in ps[8:]:
            run_lp(pc, p)
        pc.flush()
    finally:
        del trie.nodes
    assert walks == [], f"{len(walks)} walks of the whole trie during 4 requests"
    assert_mirrors(pc)


def _changes_per_request(pc, ps):
    out = []
    for p in ps:
        run_lp(pc, p)
        pc.flush()
        db = pc.store._index.db
        before = db.total_changes
        run_lp(pc, p[:-1] + [(p[-1] + 1) % 128])  # a sibling leaf under the same head
        pc.flush()
        out.append(db.total_changes - before)
    return out


def test_index_writes_per_request_do_not_grow_with_the_trie(tmp_path):
    pc = PrefixCache(build_model("llama"), cache_dir=str(tmp_path), snapshot_interval=1 << 20)
    small = _changes_per_request(pc, prompts(3, length=40, seed=5))
    _changes_per_request(pc, prompts(30, length=40, seed=6))
    assert sum(1 for _ in pc.manager.trie.nodes()) > 60
    large = _changes_per_request(pc, prompts(3, length=40, seed=7))
    print("rows changed per request", small, large)
    assert max(large) <= max(small)
    assert_mirrors(pc)


def test_a_split_keeps_referencing_the_file_it_cut(tmp_path):
    a = prompts(1, length=48, seed=9)[0]
    b = a[:24] + [(t + 1) % 128 for t in a[24:]]
    pc = PrefixCache(build_model("llama"), cache_dir=str(tmp_path))
    lp_a, _ = run_lp(pc, a)
    pc.flush()
    d = pc.cache_path
    first = referenced_files(d)
    assert len(first) == 1
    run_lp(pc, b)  # diverges inside a's edge: the edge is split at 24
    pc.flush()
    after = referenced_files(d)
    assert first < after and len(after) == 2, "the split rewrote the edge it cut"
    (f,) = first
    slices = {tuple(ly["slice"]) for (layers,) in query(d, "SELECT layers FROM nodes")
              for ly in decode_layers(layers) if ly and ly["file"] == f}
    assert slices == {(0, 24), (24, len(a) + 3)}  # the prompt and 3 of the 4 answer tokens
    assert_mirrors(pc)
    pc.close()
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        fresh = PrefixCache(build_model("llama"), cache_dir=str(tmp_path))
        for p in (a, b):
            lps, st = run_lp(fresh, p)
            assert st.restored_tokens == len(p) - 1, st
            assert_cold("llama", p, lps)
    assert ours(ws) == []


def test_node_ids_and_files_survive_a_restart(tmp_path):
    ps = prompts(4, length=40, seed=13)
    pc = PrefixCache(build_model("llama"), cache_dir=str(tmp_path))
    for p in ps[:3]:
        run_lp(pc, p)
    pc.close()
    d = pc.cache_path
    uids = {n.uid for n in pc.manager.trie.nodes()}
    files = referenced_files(d)
    fresh = PrefixCache(build_model("llama"), cache_dir=str(tmp_path))
    assert {n.uid for n in fresh.manager.trie.nodes()} == uids
    db = fresh.store._index.db
    before = db.total_changes
    run_lp(fresh, ps[3])
    fresh.flush()
    assert db.total_changes - before < 12  # the new leaf, its parent's count, two stamps
    assert files < referenced_files(d)  # nothing rewritten, one file more
    assert_mirrors(fresh)


def test_rows_mirror_the_trie_through_splits_merges_evictions_and_slow_writes(tmp_path, monkeypatch):
    """Random prompts over a small alphabet (shared prefixes, splits), a memory budget
    that evicts and merges, and a writer slow enough that captures pile up and merge."""
    real = save.write_atomic

    def slow(path, parts):
        time.sleep(0.01)
        return real(path, parts)
    monkeypatch.setattr(save, "write_atomic", slow)
    rng = random.Random(17)
    heads = [[rng.randrange(128) for _ in range(rng.randrange(4, 20))] for _ in range(4)]
    pc = PrefixCache(build_model("llama"), cache_dir=str(tmp_path), max_bytes=60_000)
    asked = []
    for i in range(40):
        p = rng.choice(heads) + [rng.randrange(128) for _ in range(rng.randrange(1, 24))]
        if asked and rng.random() < 0.3:
            q = rng.choice(asked)
            p = q[:rng.randrange(1, len(q))] + p
        asked.append(p)
        run_lp(pc, p, 2)
        if rng.random() < 0.2:
            pc.flush()
            assert_mirrors(pc)
    pc.flush()
    assert_mirrors(pc)
    assert pc.stats.evicted_bytes > 0, "the budget never evicted: the test proves less"
    pc.close()
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        fresh = PrefixCache(build_model("llama"), cache_dir=str(tmp_path), max_bytes=1 << 30)
        fresh.manager.trie.check_invariants()
        for p in asked[-3:]:
            lps, st = run_lp(fresh, p, 2)
            assert_cold("llama", p, lps, 2)
    assert ours(ws) == []


@pytest.mark.parametrize("name", ["gemma3_text", "qwen3_next"])
def test_whole_state_layers_restart_exactly(tmp_path, name):
    """Sliding-window and recurrent snapshots (whole states, never sliced) round-trip."""
    ps = prompts(3, length=48, seed=23)
    pc = PrefixCache(build_model(name), cache_dir=str(tmp_path))
    for p in ps:
        run_lp(pc, p)
    pc.close()
    fresh = PrefixCache(build_model(name), cache_dir=str(tmp_path))
    lps, st = run_lp(fresh, ps[1])
    assert st.restored_tokens > 0
    assert_cold(name, ps[1], lps)


def test_two_writers_on_one_directory_never_serve_wrong_answers(tmp_path):
    """Two caches (as two processes would) saving into one directory, with budgets that
    evict: every transaction leaves a consistent index, and a restart serves only right
    answers."""
    rng = random.Random(3)
    a, b = (PrefixCache(build_model("llama"), cache_dir=str(tmp_path), max_bytes=40_000)
            for _ in range(2))
    ps = prompts(6, length=40, seed=51) + prompts(6, length=40, seed=52)
    for _ in range(30):
        pc = rng.choice((a, b))
        run_lp(pc, rng.choice(ps), 2)
        if rng.random() < 0.5:
            pc.flush()
    a.close()
    b.close()
    d = a.cache_path
    uids = {u for (u,) in query(d, "SELECT uid FROM nodes")}
    assert all(p == 0 or p in uids for (p,) in query(d, "SELECT parent FROM nodes"))
    assert all((d / f).is_file() for f in referenced_files(d))
    fresh = PrefixCache(build_model("llama"), cache_dir=str(tmp_path))
    restored = 0
    for p in ps:
        lps, st = run_lp(fresh, p, 2)
        assert_cold("llama", p, lps, 2)
        restored += st.restored_tokens
    assert restored > 0


def test_one_disk_budget_per_directory_across_processes(tmp_path):
    """A process with the default budget (a quarter of the free disk: far more than here)
    follows the budget another process set for the directory, and a budget set later is
    followed by every writer: the directory, counted as the shared index holds it (every
    process's files), stays within the one budget."""
    import json
    import subprocess

    from mlx_kvcache.store import disk_usage

    def fill(seed, budget):
        r = subprocess.run([sys.executable, str(HERE / "_persist_child.py"), "fill",
                            str(tmp_path), str(seed), str(budget)],
                           capture_output=True, text=True, check=True)
        return json.loads(r.stdout.strip().splitlines()[-1])
    here = PrefixCache(build_model("llama"), cache_dir=str(tmp_path), max_disk_bytes=400_000)
    for p in prompts(8, length=64, seed=61):
        run_lp(here, p, 2)
    here.flush()
    d = model_dir(tmp_path)
    assert 0 < disk_usage(d) <= 400_000
    other = fill(62, "none")  # another process, default budget
    assert other["max_disk_bytes"] == 400_000 and other["worst"] <= 400_000, other
    other = fill(63, 250_000)  # another process sets a smaller one
    assert other["max_disk_bytes"] == 250_000 and other["worst"] <= 250_000, other
    for p in prompts(8, length=64, seed=64):  # this one follows it at its next write
        run_lp(here, p, 2)
        here.flush()
        assert disk_usage(d) <= 250_000
    assert here.stats.max_disk_bytes == 250_000
    here.close()
