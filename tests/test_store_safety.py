"""An index edited by someone else: names outside the directory, links to devices, FIFOs
and wrong sizes are damaged nodes (one warning, the answer of a cold run, never a hang or
a read outside the directory); ``clear_disk`` is durable and names a directory it cannot
write; an older format's directory is reported once and left alone."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import mlx_kvcache  # noqa: F401  (before mlx)

import numpy as np
import pytest

from mlx_kvcache import PrefixCache
from mlx_kvcache.store import FORMAT_VERSION, save

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _index import edit, query  # noqa: E402
from _persist_child import TOK, build_model, prompts  # noqa: E402
from reference import FLOAT_TOL  # noqa: E402



def ours(ws, part=""):
    return [str(w.message) for w in ws if issubclass(w.category, RuntimeWarning)
            and str(w.message).startswith("mlx_kvcache: ") and part in str(w.message)]


def run_lp(pc, prompt, n=4):
    return [np.array(r.logprobs) for r in pc.stream_generate(TOK, prompt, n)], pc.last_request


def cold_lps(prompt, n=4):
    return run_lp(PrefixCache(build_model("llama")), prompt, n)[0]


def same(a, b):
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b)) < FLOAT_TOL


@pytest.fixture()
def one_prompt(tmp_path):
    """A cache of one prompt: one node, one snapshot file."""
    p = prompts(1, length=40, seed=7)[0]
    root = tmp_path / "root"
    pc = PrefixCache(build_model("llama"), cache_dir=str(root))
    run_lp(pc, p)
    pc.close()
    d = pc.cache_path
    ((name, size, crc),) = query(d, "SELECT name, size, crc32 FROM files")
    return root, d, p, name, size, crc


def _rename_in_index(d, old, new, size=None, crc=None):
    (layers,) = query(d, "SELECT layers FROM nodes")[0]
    edit(d, "UPDATE nodes SET layers = ?", layers.replace(json.dumps(old), json.dumps(new)))
    edit(d, "UPDATE refs SET file = ? WHERE file = ?", new, old)
    edit(d, "UPDATE files SET name = ? WHERE name = ?", new, old)
    if size is not None:
        edit(d, "UPDATE files SET size = ?, crc32 = ? WHERE name = ?", size, crc, new)


def _damage(kind, d, name, size, crc, tmp_path):
    f = d / name
    if kind == "absolute":  # a valid copy outside the directory, named by absolute path
        out = tmp_path / "elsewhere" / name
        out.parent.mkdir()
        shutil.copy(f, out)
        _rename_in_index(d, name, str(out))
    elif kind == "dotdot":  # a valid copy one level up
        shutil.copy(f, d.parent / name)
        _rename_in_index(d, name, f"../{name}")
    elif kind == "dev_zero":  # a link to an endless file, with a size that passes a stat
        f.unlink()
        f.symlink_to("/dev/zero")
        edit(d, "UPDATE files SET size = 0, crc32 = 0")
    elif kind == "fifo":  # opening it for reading would wait for a writer forever
        f.unlink()
        os.mkfifo(f)
        edit(d, "UPDATE files SET size = 0, crc32 = 0")
    elif kind == "wrong_size":
        edit(d, "UPDATE files SET size = ?", size + 1)
    else:
        raise KeyError(kind)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["absolute", "dotdot", "dev_zero", "fifo", "wrong_size"])
def test_a_bad_index_entry_is_a_damaged_node(one_prompt, tmp_path, kind):
    root, d, p, name, size, crc = one_prompt
    _damage(kind, d, name, size, crc, tmp_path)
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        pc = PrefixCache(build_model("llama"), cache_dir=str(root))
        lps, st = run_lp(pc, p)
        pc.close()
    msgs = ours(ws)
    assert len(msgs) == 1 and "damaged" in msgs[0], msgs
    assert st.restored_tokens == 0  # nothing was read from outside or from a device
    assert same(lps, cold_lps(p))


def test_a_file_swapped_for_a_fifo_after_loading_never_hangs(one_prompt):
    """Checked at load, replaced before first use: the read refuses it."""
    root, d, p, name, size, crc = one_prompt
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        pc = PrefixCache(build_model("llama"), cache_dir=str(root))
        (d / name).unlink()
        os.mkfifo(d / name)
        lps, st = run_lp(pc, p)
        pc.close()
    msgs = ours(ws)
    assert len(msgs) == 1 and "not a regular file" in msgs[0], msgs
    assert st.restored_tokens == 0 and same(lps, cold_lps(p))


# -- clear_disk ----------------------------------------------------------------------------

def test_clear_disk_drops_writes_still_queued(tmp_path, monkeypatch):
    """Prompts whose background write is still queued when the disk is cleared never
    come back (the old store wrote them after the clear)."""
    real = save.write_atomic

    def slow(path, parts):
        time.sleep(0.2)
        return real(path, parts)
    monkeypatch.setattr(save, "write_atomic", slow)
    pc = PrefixCache(build_model("llama"), cache_dir=str(tmp_path))
    for p in prompts(4, length=40, seed=31):
        run_lp(pc, p)
    pc.manager.clear()
    pc.store.clear_disk()
    pc.close()
    fresh = PrefixCache(build_model("llama"), cache_dir=str(tmp_path))
    assert sum(1 for _ in fresh.manager.trie.nodes()) == 0


def test_clear_disk_is_durable_when_it_returns(tmp_path):
    """A process killed right after ``clear_disk`` returns loads nothing on restart."""
    code = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(HERE)!r})
        from _persist_child import build_model, prompts, run
        from mlx_kvcache import PrefixCache
        pc = PrefixCache(build_model("llama"), cache_dir={str(tmp_path)!r})
        for p in prompts(3, length=40, seed=33):
            run(pc, p, 2)
        pc.flush()
        print(sum(1 for _ in pc.manager.trie.nodes()), flush=True)
        pc.store.clear_disk()
        os._exit(0)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout.split()[0]) > 0
    fresh = PrefixCache(build_model("llama"), cache_dir=str(tmp_path))
    assert sum(1 for _ in fresh.manager.trie.nodes()) == 0


def _read_only(d):
    """Make ``d`` read-only for this process (a read-only bind mount when root, whom
    permissions do not stop); returns a function that undoes it, or None."""
    if os.geteuid() != 0:
        mode = d.stat().st_mode
        d.chmod(0o555)
        return lambda: d.chmod(mode)
    r = subprocess.run(["mount", "--bind", str(d), str(d)], capture_output=True)
    if r.returncode != 0:
        return None
    r = subprocess.run(["mount", "-o", "remount,bind,ro", str(d)], capture_output=True)
    if r.returncode != 0:
        subprocess.run(["umount", str(d)], capture_output=True)
        return None

    def undo():
        if subprocess.run(["umount", str(d)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(d)], capture_output=True)  # still busy
    return undo


def test_clear_disk_on_a_read_only_directory_names_it(tmp_path):
    ps = prompts(2, length=40, seed=35)
    pc = PrefixCache(build_model("llama"), cache_dir=str(tmp_path))
    for p in ps:
        run_lp(pc, p)
    pc.flush()
    d = pc.cache_path
    undo = _read_only(d)
    if undo is None:
        pytest.skip("cannot make a read-only directory here")
    try:
        with pytest.raises(OSError) as err:
            pc.store.clear_disk()
    finally:
        undo()
    msg = str(err.value)
    assert "cannot clear" in msg and str(d) in msg, msg
    pc.close()
    # Nothing was half-deleted: the cache still serves.
    fresh = PrefixCache(build_model("llama"), cache_dir=str(tmp_path))
    lps, st = run_lp(fresh, ps[0])
    assert st.restored_tokens > 0 and same(lps, cold_lps(ps[0]))


def test_a_read_only_cache_loads_and_serves(tmp_path):
    p = prompts(1, length=40, seed=37)[0]
    pc = PrefixCache(build_model("llama"), cache_dir=str(tmp_path))
    run_lp(pc, p)
    pc.close()
    undo = _read_only(pc.cache_path)
    if undo is None:
        pytest.skip("cannot make a read-only directory here")
    try:
        with warnings.catch_warnings(record=True) as ws:
            warnings.simplefilter("always")
            ro = PrefixCache(build_model("llama"), cache_dir=str(tmp_path))
            lps, st = run_lp(ro, p)
            ro.flush()
            ro.close()
    finally:
        undo()
    assert st.restored_tokens > 0 and same(lps, cold_lps(p))
    assert len(ours(ws, "could not save")) == 1, ours(ws)


# -- older formats --------------------------------------------------------------------------

def test_a_format_2_directory_is_reported_once_and_left_alone(tmp_path):
    model = build_model("llama")
    fp = PrefixCache(model).fingerprint()
    old = tmp_path / "v2" / fp[:16]
    old.mkdir(parents=True)
    (old / "index.json").write_text(json.dumps({"format": "mlx_kvcache.prefix_trie",
                                                "version": 2, "nodes": [], "files": {}}))
    (old / "n0123456789abcdef0123.safetensors").write_bytes(b"\0" * 64)
    before = {q.name: q.read_bytes() for q in old.iterdir()}
    p = prompts(1, seed=39)[0]
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        for _ in range(2):
            pc = PrefixCache(model, cache_dir=str(tmp_path))
            run_lp(pc, p)
            pc.close()
    msgs = ours(ws)
    assert len(msgs) == 1 and "format 2" in msgs[0] and str(old.parent) in msgs[0], msgs
    assert {q.name: q.read_bytes() for q in old.iterdir()} == before
    assert (tmp_path / f"v{FORMAT_VERSION}").is_dir()


def test_a_cache_directory_deleted_while_running_is_written_again(tmp_path):
    """A user cleaning ~/.cache under a running server: the next save starts a new index
    instead of writing into the deleted one."""
    ps = prompts(3, length=40, seed=41)
    pc = PrefixCache(build_model("llama"), cache_dir=str(tmp_path))
    run_lp(pc, ps[0])
    pc.flush()
    shutil.rmtree(pc.cache_path)
    for p in ps[1:]:
        run_lp(pc, p)
    pc.close()
    fresh = PrefixCache(build_model("llama"), cache_dir=str(tmp_path))
    lps, st = run_lp(fresh, ps[2])
    assert st.restored_tokens == len(ps[2]) - 1 and same(lps, cold_lps(ps[2]))
