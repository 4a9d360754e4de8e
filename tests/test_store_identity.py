"""Model identity of a model directory: every byte counts, each file is read once, a Hugging
Face blob name is its digest, and a model changed in place is never served the old cache."""

from __future__ import annotations

import json
import os
import time
import types
from pathlib import Path

import mlx_kvcache  # noqa: F401  (before mlx)

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.models import cache as mlc

from mlx_kvcache.serving import TriePromptCache
from mlx_kvcache.store import digests, directory_fingerprint
from mlx_kvcache.testing import write_model_dir
from reference import FLOAT_TOL

_OLD_SAMPLES, _OLD_SAMPLE, _OLD_HEAD = 64, 4096, 1 << 16  # what format 2 hashed per weight file


def _unsampled_window(path: Path, tensor: str, width: int = 64) -> int:
    """An offset inside ``tensor``'s data that the old fingerprint's samples never read."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    lo, hi = json.loads(raw[8:8 + n])[tensor]["data_offsets"]
    base = 8 + n
    size = len(raw)
    step = max(size // _OLD_SAMPLES, _OLD_SAMPLE)
    read = [(0, _OLD_HEAD)] + [(o, o + _OLD_SAMPLE) for o in range(0, size, step)]
    for off in range(base + lo, base + hi - width, 16):
        if all(off + width <= a or off >= b for a, b in read):
            return off
    raise AssertionError("no unsampled window: make the model bigger")


def _rewrite_in_place(path: Path, off: int, width: int = 64, keep_mtime: bool = True) -> None:
    st = path.stat()
    with open(path, "r+b") as f:  # same inode, same size
        f.seek(off)
        old = f.read(width)
        f.seek(off)
        f.write(bytes(b ^ 0x40 for b in old))  # flips an exponent bit of each float
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size


@pytest.fixture()
def model_dir(tmp_path):
    # Wide MLPs: the weight file is big enough that the old samples leave gaps.
    return write_model_dir(tmp_path / "model", "llama", intermediate_size=1024)


def test_a_few_bytes_between_old_samples_change_the_fingerprint(model_dir, tmp_path):
    weights = model_dir / "model.safetensors"
    before = directory_fingerprint(model_dir, cache_root=tmp_path / "cache")
    _rewrite_in_place(weights, _unsampled_window(weights, "model.layers.0.mlp.down_proj.weight"))
    assert directory_fingerprint(model_dir, cache_root=tmp_path / "cache") != before
    assert directory_fingerprint(model_dir) != before  # without remembered digests too


def test_digests_are_remembered_until_the_file_changes(model_dir, tmp_path, monkeypatch):
    weights = model_dir / "model.safetensors"
    # Files written a moment ago are not remembered (a change within the same clock tick
    # could repeat their ctime); here 50 ms count as settled.
    monkeypatch.setattr(digests, "RACY_NS", 50_000_000)
    time.sleep(0.1)
    reads = []
    real = digests.file_sha256
    monkeypatch.setattr(digests, "file_sha256", lambda p: reads.append(Path(p).name) or real(p))
    root = tmp_path / "cache"
    first = directory_fingerprint(model_dir, cache_root=root)
    assert "model.safetensors" in reads
    reads.clear()
    assert directory_fingerprint(model_dir, cache_root=root) == first
    assert "model.safetensors" not in reads  # the second start: a stat, no read
    # Changed in place with its mtime restored: its ctime moved, so it is read again.
    _rewrite_in_place(weights, _unsampled_window(weights, "model.layers.1.mlp.up_proj.weight"))
    assert directory_fingerprint(model_dir, cache_root=root) != first
    assert "model.safetensors" in reads


def test_a_file_changed_while_being_hashed_is_not_remembered(tmp_path):
    f = tmp_path / "w.bin"
    f.write_bytes(b"x" * 100)  # changed just now: inside the racy window
    memo = digests.FileDigests(tmp_path / "d.sqlite")
    memo.sha256(f)
    assert memo._lookup(os.path.realpath(f)) is None
    memo.close()


def test_hugging_face_blob_names_are_digests(tmp_path, monkeypatch):
    snap = tmp_path / "models--x--y" / "snapshots" / "abc123"
    blobs = tmp_path / "models--x--y" / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    sha = "ab" * 32
    git = "cd" * 20
    (blobs / sha).write_bytes(b"weights that do not hash to that name")
    (blobs / git).write_bytes(b'{"model_type": "llama"}')
    (snap / "model.safetensors").symlink_to(f"../../blobs/{sha}")
    (snap / "config.json").symlink_to(f"../../blobs/{git}")
    reads = []
    real = digests.file_sha256
    monkeypatch.setattr(digests, "file_sha256", lambda p: reads.append(Path(p).name) or real(p))
    fp = directory_fingerprint(snap)
    assert reads == [git]  # the 64-hex blob is never read; a 40-hex (git) name is
    assert digests.hf_blob_sha256(snap / "model.safetensors") == sha
    sha2 = "ef" * 32
    (blobs / sha2).write_bytes(b"other weights")
    (snap / "model.safetensors").unlink()
    (snap / "model.safetensors").symlink_to(f"../../blobs/{sha2}")
    assert directory_fingerprint(snap) != fp


# -- end to end: the server's prompt cache after a model changed in place -----------------

def _provider(path):
    model, tok = load(str(path))
    key = (str(path), None, None)
    return types.SimpleNamespace(model=model, tokenizer=tok, draft_model=None, model_key=key), key


def _served(m, prompt, cache=None, n=4):
    cache = cache if cache is not None else mlc.make_prompt_cache(m)
    out = [(int(t), lp) for (t, lp), _ in
           zip(generate_step(mx.array(prompt), m, prompt_cache=cache, max_tokens=n), range(n))]
    return out, cache


def test_a_model_rewritten_in_place_gets_no_cache_of_the_old_one(model_dir, tmp_path):
    cache_dir = str(tmp_path / "cache")
    prompt = [(5 * i + 7) % 90 + 6 for i in range(40)]
    prov, key = _provider(model_dir)
    pc = TriePromptCache(prov, max_bytes=1 << 30, cache_dir=cache_dir)
    pc.prepare(key)
    out, cache = _served(prov.model, prompt)
    pc.insert_cache(key, prompt + [t for t, _ in out], cache)
    pc.close()
    # The control: after a restart, the unchanged model restores from its cache.
    again = TriePromptCache(prov, max_bytes=1 << 30, cache_dir=cache_dir)
    got, rest = again.fetch_nearest_cache(key, prompt + [9, 10])
    assert got is not None and len(rest) < 10
    again.close()

    weights = model_dir / "model.safetensors"
    _rewrite_in_place(weights, _unsampled_window(weights, "model.layers.0.self_attn.k_proj.weight"))
    prov2, key2 = _provider(model_dir)
    pc2 = TriePromptCache(prov2, max_bytes=1 << 30, cache_dir=cache_dir)
    pc2.prepare(key2)
    got, rest = pc2.fetch_nearest_cache(key2, prompt + [9, 10])
    # (a miss hands over empty caches or none: nothing restored)
    assert rest == prompt + [9, 10] and (got is None or all(
        getattr(c, "offset", 0) == 0 for c in got)), "the old model's cache was applied"
    answer, _ = _served(prov2.model, rest, got)
    cold, _ = _served(prov2.model, prompt + [9, 10])
    assert max(mx.abs(a - b).max().item() for (_, a), (_, b) in zip(answer, cold)) < FLOAT_TOL
    pc2.close()


def test_cache_key_combines_what_changes_the_snapshots():
    """One derivation for `PrefixCache` and the server, unchanged (existing caches keep
    their directories): draft, then shard, then cold bits, each a SHA-256 over the last."""
    import hashlib

    from mlx_kvcache.store import cache_key

    fp, d = "a" * 64, "b" * 64
    h = lambda s: hashlib.sha256(s.encode()).hexdigest()  # noqa: E731
    both = h("target " + fp + "\ndraft " + d + "\n")
    assert cache_key(fp) == fp
    assert cache_key(fp, draft_fp=d) == both
    assert cache_key(fp, draft_fp=d, sharding="pipeline-2-rank0", cold_bits=8) == \
        h(h(both + "|pipeline-2-rank0") + "|cold8")
    assert cache_key(fp, cold_bits=4) == h(fp + "|cold4") != cache_key(fp, cold_bits=8)
    # the quantized-KV schedule last (a key without one is unchanged)
    assert cache_key(fp, kv_quant=["quantized", 8, 64, 0]) == h(fp + '|kv["quantized", 8, 64, 0]')
    assert cache_key(fp, cold_bits=8, kv_quant=["quantized", 8, 64, 0]) == \
        h(h(fp + "|cold8") + '|kv["quantized", 8, 64, 0]')


def test_an_export_is_named_by_the_model_it_was_made_from_until_a_byte_changes(tmp_path):
    """`directory_identity`: an exported directory under the cache root's ``models/`` is the
    loaded model it was written from (the chat command's identity: one cache for both);
    a byte changed in place (a fused LoRA re-saved) makes it another model; a record in a
    directory that is not one of our exports, or with an adapter, counts for nothing."""
    from mlx_kvcache.store import directory_identity, exports_dir, record_identity

    root = tmp_path / "cache"
    d = write_model_dir(exports_dir(root) / "m-1", "llama")
    plain = directory_fingerprint(d)
    record_identity(d, "f" * 64)
    assert directory_fingerprint(d) == plain  # the record is not part of the bytes
    assert directory_identity(d, cache_root=root) == "f" * 64
    assert directory_identity(d, cache_root=tmp_path / "elsewhere") == plain
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapters.safetensors").write_bytes(b"lora")
    assert directory_identity(d, adapter, cache_root=root) == directory_fingerprint(d, adapter)
    weights = d / "model.safetensors"
    _rewrite_in_place(weights, _unsampled_window(weights, "model.layers.0.self_attn.k_proj.weight"))
    changed = directory_identity(d, cache_root=root)
    assert changed not in ("f" * 64, plain) and changed == directory_fingerprint(d)
    outside = write_model_dir(tmp_path / "download", "llama")
    record_identity(outside, "f" * 64)
    assert directory_identity(outside, cache_root=root) == directory_fingerprint(outside)
