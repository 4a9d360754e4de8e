"""Helpers for tests/test_persist.py, also run as a fresh process (``python _persist_child.py``).

Child modes (argv[1]):
  * ``restart JSON``: for each job ``{"model", "dir", "prompt", "max_tokens"}`` build the
    model (same seed), construct ``PrefixCache(cache_dir=dir)``, run the prompt, print one
    JSON line per job with the tokens, the request stats and the warnings seen.
  * ``saver DIR``: build tiny llama, then run requests forever with autosave, writing
    slowly (a sleep between file parts) so a SIGKILL is likely to land inside a save.
  * ``fill DIR SEED BUDGET``: run prompts into DIR with that disk budget (``none``: the
    default), print the budget in force and the largest directory size seen (JSON).
"""

from __future__ import annotations

import json
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import mlx_kvcache  # noqa: E402,F401  (before mlx)

import mlx.core as mx  # noqa: E402

from mlx_kvcache import PrefixCache  # noqa: E402
from mlx_kvcache.testing import TokenIdTokenizer  # noqa: E402


TOK = TokenIdTokenizer()


def build_model(name: str, perturb: bool = False, seed: int = 1):
    if name == "smollm2":
        from mlx_kvcache.models.default import load_default_model

        return load_default_model()[0]
    from models import build

    m = build(name, seed=seed)
    if perturb:  # a "fine-tune": one row of one layer moves by 1e-3
        lin = m.layers[1].mlp.down_proj if hasattr(m, "layers") else None
        if lin is None:
            raise KeyError(name)
        w = lin.weight
        w[3] = w[3] + 1e-3
        lin.weight = w
        mx.eval(m.parameters())
    return m


def run(pc: PrefixCache, prompt, max_tokens: int):
    toks = [r.token for r in pc.stream_generate(TOK, prompt, max_tokens)]
    return toks, pc.last_request


def prompts(n: int, length: int = 40, seed: int = 0, vocab: int = 128):
    """Deterministic prompts sharing a common head, then diverging."""
    import random

    rng = random.Random(seed)
    head = [rng.randrange(vocab) for _ in range(length // 2)]
    return [head + [rng.randrange(vocab) for _ in range(length - len(head))] for _ in range(n)]


def _restart(jobs):
    for job in jobs:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            m = build_model(job["model"])
            pc = PrefixCache(m, cache_dir=job["dir"], tokenizer=job.get("tokenizer"))
            loaded_nodes = sum(1 for _ in pc.manager.trie.nodes())
            toks, st = run(pc, job["prompt"], job["max_tokens"])
            pc.manager.trie.check_invariants()
        print(json.dumps({
            "model": job["model"], "tokens": toks, "prefilled": st.prefilled_tokens,
            "restored": st.restored_tokens, "loaded_nodes": loaded_nodes,
            "ttft": st.time_to_first_token,
            "warnings": [str(x.message) for x in w if issubclass(x.category, RuntimeWarning)],
        }), flush=True)


def _saver(d):
    import time

    from mlx_kvcache.store import save

    orig = save.write_atomic

    def slow(path, parts):
        def gen():
            for p in parts:
                for i in range(0, len(p), 4096):
                    time.sleep(0.004)
                    yield p[i:i + 4096]
        return orig(path, gen())

    save.write_atomic = slow
    m = build_model("llama")
    pc = PrefixCache(m, cache_dir=d)
    print("ready", flush=True)
    i = 0
    while True:
        for p in prompts(6, length=48, seed=100 + i):
            run(pc, p, 4)
        i += 1


def _fill(d, seed, budget):
    """Run prompts into ``d`` (a budget of ``budget`` bytes, or the default with
    ``none``), flushing after each; print the budget in force and the directory's largest
    size seen after a flush, as JSON."""
    from pathlib import Path

    from mlx_kvcache.store import FORMAT_VERSION, disk_usage

    pc = PrefixCache(build_model("llama"), cache_dir=d,
                     max_disk_bytes=None if budget == "none" else int(budget))
    worst = 0
    for p in prompts(16, length=64, seed=int(seed)):
        run(pc, p, 2)
        pc.flush()
        for sub in (Path(d) / f"v{FORMAT_VERSION}").iterdir():
            worst = max(worst, disk_usage(sub))
    pc.close()
    print(json.dumps({"max_disk_bytes": pc.stats.max_disk_bytes, "worst": worst}), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "restart":
        _restart(json.loads(sys.argv[2]))
    elif sys.argv[1] == "saver":
        _saver(sys.argv[2])
    elif sys.argv[1] == "fill":
        _fill(*sys.argv[2:5])
