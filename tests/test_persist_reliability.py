"""Persistence that never serves wrong output and never wedges: a checksummed index, a full
disk that recovers, a newer build's cache left alone, one warning for a broken directory."""

import errno
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from mlx_kvcache import PrefixCache
from mlx_kvcache.store import FORMAT_VERSION, disk_usage, save

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _index import edit, query  # noqa: E402
from _persist_child import build_model, prompts, run  # noqa: E402


def ours(ws, part=""):
    return [str(w.message) for w in ws if issubclass(w.category, RuntimeWarning)
            and str(w.message).startswith("mlx_kvcache: ") and part in str(w.message)]


def model_dir(root):
    (d,) = [p for p in (Path(root) / f"v{FORMAT_VERSION}").iterdir() if p.is_dir()]
    return d


def cold(prompt, n):
    return run(PrefixCache(build_model("llama")), prompt, n)[0]


def test_edited_index_token_is_detected(tmp_path):
    """One token id changed in the index (every file's size and CRC still right) must not
    let a request restore state computed for other tokens: the prefix digest inside the
    snapshot file no longer matches the edited row's tokens."""
    p = prompts(1, length=41, seed=71)[0]
    pc = PrefixCache(build_model("llama"), cache_dir=str(tmp_path))
    run(pc, p, 4)
    pc.close()
    d = model_dir(tmp_path)
    ((uid, blob),) = query(d, "SELECT uid, tokens FROM nodes")
    tokens = np.frombuffer(blob, dtype="<i8").copy()
    tokens[5] = (tokens[5] + 1) % 128
    edit(d, "UPDATE nodes SET tokens = ? WHERE uid = ?", tokens.tobytes(), uid)
    edited = tokens[:40].tolist()
    q = edited + [p[40]]
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        pc2 = PrefixCache(build_model("llama"), cache_dir=str(tmp_path))
        toks, st = run(pc2, q, 4)
        pc2.flush()
    msgs = ours(ws)
    assert len(msgs) == 1 and "other tokens" in msgs[0], msgs
    assert st.restored_tokens == 0
    assert toks == cold(q, 4)


def _fill_then_shrink(root, cap):
    """Save until the disk is full, then restart with a disk budget far below: the first
    save must free space, succeed, and keep the directory within the budget. (The fill
    needs a budget past the disk: the default, a quarter of the free disk, never fills it.)"""
    model = build_model("llama")
    ps = [p for seed in (81, 82, 84) for p in prompts(40, length=64, seed=seed)]
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        pc = PrefixCache(model, cache_dir=str(root), max_disk_bytes=1 << 50)
        for p in ps:
            run(pc, p, 2)
            pc.flush()
        pc.close()
    full = ours(ws, "could not save")
    budget = cap // 4
    last = prompts(1, length=64, seed=83)[0]
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        pc = PrefixCache(model, cache_dir=str(root), max_disk_bytes=budget)
        run(pc, last, 2)
        pc.flush()
        pc.close()
    assert ours(ws, "could not save") == [], ours(ws)
    d = model_dir(root)
    assert disk_usage(d) <= budget
    fresh = PrefixCache(model, cache_dir=str(root), max_disk_bytes=budget)
    toks, st = run(fresh, last, 2)
    assert st.prefilled_tokens == 1 and toks == cold(last, 2)
    assert len(full) == 1, f"expected one full-disk warning (then quiet), got {full}"


def test_full_disk_recovers_simulated(tmp_path, monkeypatch):
    """A file system of ``cap`` bytes, simulated: writes past it fail with ENOSPC. (The
    budget, a quarter of it, must hold the index's ~100 kB of SQLite files too.)"""
    cap = 1_200_000
    real = save.write_atomic

    def small_disk(path, parts):
        parts = list(parts)
        if disk_usage(path.parent) + sum(len(p) for p in parts) > cap:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(path, parts)
    monkeypatch.setattr(save, "write_atomic", small_disk)
    _fill_then_shrink(tmp_path, cap)


def test_full_disk_recovers_tmpfs(tmp_path):
    """The same on a real 1.5 MiB tmpfs (needs permission to mount; skipped without it),
    where the index's own writes fail too."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    cap = 1536 << 10
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={cap}", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip() or r.returncode}")
    try:
        _fill_then_shrink(mnt, cap)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_newer_format_is_never_touched(tmp_path):
    model = build_model("llama")
    p = prompts(1, seed=91)[0]
    pc = PrefixCache(model, cache_dir=str(tmp_path))
    run(pc, p, 3)
    pc.close()
    ours_dir = model_dir(tmp_path)
    # A newer build's directory beside ours, and a newer index written into ours.
    newer = tmp_path / f"v{FORMAT_VERSION + 1}" / ours_dir.name
    shutil.copytree(ours_dir, newer)
    edit(ours_dir, f"PRAGMA user_version = {FORMAT_VERSION + 1}")
    snapshot = {q: q.read_bytes() for d in (ours_dir, newer) for q in d.iterdir()}
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        pc2 = PrefixCache(model, cache_dir=str(tmp_path))
        for q in prompts(3, seed=92):
            run(pc2, q, 3)
        pc2.close()
        pc2.save()
    msgs = ours(ws)
    assert len(msgs) == 1 and "newer" in msgs[0], msgs
    after = {q: q.read_bytes() for d in (ours_dir, newer) for q in d.iterdir()}
    assert after == snapshot


def test_unusable_cache_dir_warns_once_until_it_works(tmp_path):
    blocker = tmp_path / "cache"
    blocker.write_text("a file where the directory should be")
    model = build_model("llama")
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        pc = PrefixCache(model, cache_dir=str(blocker))
        for q in prompts(4, seed=101):
            run(pc, q, 2)
            pc.flush()
        assert len(ours(ws, "could not save")) == 1, ours(ws)
        os.remove(blocker)
        run(pc, prompts(1, seed=102)[0], 2)
        pc.flush()
    assert len(ours(ws, "could not save")) == 1
    assert ours(ws, "works again")
    assert (model_dir(blocker) / "index.sqlite").exists()
