"""`mlx-kvcache serve` on two ranks over loopback (``mlx.launch -n 2 --backend ring``):
tensor parallel (llama) and pipeline parallel (deepseek_v3, and qwen3_5 — a hybrid whose
ranks hold different kinds of layers), three layers so pipeline ranks hold different bytes.
The same greedy answers as one process, identical cached tokens on every rank, eviction on
every rank, persistence per rank with a damaged or missing rank directory, and a clean
stop that leaves no process behind."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from mlx_kvcache.testing import write_model_dir
from mlx_kvcache.testing.launch import LaunchedServer
from mlx_kvcache.testing.servers import Server, answer, same_answer

SYSTEM = "You are terse. Reply with one short line."
LONG = "Tell me about the weather in the mountains and the rivers near the lake in spring"
PLANS = {"llama": [], "deepseek_v3": ["--pipeline"], "qwen3_5": ["--pipeline"]}


def requests():
    """A branching sequence: repeats, a divergence inside the user message, a new branch."""
    a = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": LONG}]
    b = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": LONG[:50] + " at night"}]
    c = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello there."}]
    return [a, a, b, b, c, a, b]


def play(server):
    return [server.chat(m, max_tokens=6) for m in requests()]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {k: write_model_dir(root / k, k) for k in PLANS}


@pytest.mark.parametrize("kind", list(PLANS))
def test_two_ranks_agree_and_answer_like_one_process(kind, dirs, tmp_path):
    common = ["--checkpoint-interval", "16", "--prompt-cache-bytes", "60000"]
    with Server.ours(dirs[kind], tmp_path / "one.log", tmp_path, "--no-persist", *common) as s:
        ref = play(s)
    with LaunchedServer(dirs[kind], *PLANS[kind], *common, "--cache-dir", str(tmp_path / "c"),
                        home=tmp_path) as s:
        got = play(s)
        lines = s.wait_for_lines(len(requests()))
        report = s.cache()
        s.stop()
        assert not s.job.members()
    tol = 0 if PLANS[kind] else 2e-3  # pipeline: the same arithmetic; tensor: reduced in parts
    for a, b in zip(ref, got):
        same_answer(a, b, tol=max(tol, 1e-4))
    cached = [answer(r)[2] for r in got]
    print(kind, "cached per request", cached, "ranks", report["ranks"])
    assert sorted(lines) == [0, 1] and len(lines[0]) == len(requests())
    assert lines[0] == lines[1], lines  # every rank reprocessed exactly the same tokens
    assert [x["cached"] for x in lines[0]] == cached
    assert cached[1] > 0 and cached[3] > 0  # repeats hit
    assert all(r["evicted_bytes"] > 0 for r in report["ranks"]), report["ranks"]
    assert all(r["bytes_held"] <= 60000 for r in report["ranks"]), report["ranks"]


@pytest.mark.parametrize("damage", ["missing", "corrupt"])
def test_a_damaged_rank_directory_makes_all_ranks_agree(damage, dirs, tmp_path):
    kind = "qwen3_5"
    args = [*PLANS[kind], "--checkpoint-interval", "16", "--cache-dir", str(tmp_path / "c")]
    msgs = requests()
    with LaunchedServer(dirs[kind], *args, home=tmp_path) as s:
        first = [s.chat(m, max_tokens=6) for m in msgs[:3]]
        s.wait_for_lines(3)
        s.stop()  # SIGTERM to the group: every rank flushes its writes
    rank_dirs = sorted(p for p in Path(tmp_path / "c").glob("v*/*") if p.is_dir())
    assert len(rank_dirs) == 2, rank_dirs  # one directory per rank of this plan
    victim = rank_dirs[1]
    if damage == "missing":
        shutil.rmtree(victim)
    else:
        for f in sorted(victim.glob("*.safetensors")):
            raw = bytearray(f.read_bytes())
            raw[-9] ^= 0x40
            f.write_bytes(bytes(raw))
    with LaunchedServer(dirs[kind], *args, home=tmp_path) as s:
        again = [s.chat(m, max_tokens=6) for m in msgs[:3]]
        lines = s.wait_for_lines(3)
        s.stop()
    for a, b in zip(first, again):
        same_answer(a, b)
    assert lines[0] == lines[1], lines
    if damage == "missing":  # the other rank's intact files are dropped too
        assert lines[0][0]["cached"] == 0, lines
