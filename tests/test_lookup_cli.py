"""Prompt lookup in the chat CLI: the conversation code (`ChatSession`) on copying models of
each kind answers as with lookup off, turn after turn, its status line counting what
lookup proposed; the command itself (a subprocess) answers the same with
``--no-prompt-lookup`` and says so in its status lines."""

import os
import re
import subprocess
import sys
from io import StringIO
from pathlib import Path

import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer
from mlx_lm.utils import load_model

import mlx_kvcache as mk
from mlx_kvcache.cli.session import ChatSession
from mlx_kvcache.testing import write_model_dir
from mlx_kvcache.testing.copy_dirs import chain_table, write_copy_dir
from mlx_kvcache.testing.dirs import CHARS, SPECIALS

ROOT = Path(__file__).resolve().parents[1]
IDS = {t: i for i, t in enumerate(SPECIALS + CHARS)}
TEXT = "abcdefghijklmnopqrstuvwxyz0123456789"
ANSWER = TEXT.replace("k", "#").replace("5", "")
LOOKUP = re.compile(r"\| lookup drafted (\d+) accepted (\d+) \(\d+%\)")


@pytest.mark.parametrize("kind", ["gemma3_text", "qwen3_next"])
def test_chat_session_answers_as_without_lookup(kind, tmp_path):
    chain = [IDS["<|assistant|>"], *(IDS[c] for c in ANSWER), IDS["</s>"]]
    d = write_copy_dir(tmp_path / kind, kind, succ=chain_table([chain], len(IDS)))
    model = load_model(d, trust_remote_code=True)[0]
    tokenizer = load_tokenizer(d)
    turns = [f"Copy: {TEXT}", f"Again: {TEXT}", "And once more."]
    outs = []
    for on in (True, False):
        out = StringIO()
        pc = mk.PrefixCache(model, prompt_lookup=on, pre_end_margin=4)
        session = ChatSession(pc, tokenizer, system="Copy what you are given.", max_tokens=60,
                              out=out, err=StringIO(), progress=False)
        stats = [session.ask(t) for t in turns]
        outs.append((out.getvalue(), stats))
    (text_on, st_on), (text_off, st_off) = outs
    answers = [m for m in text_on.splitlines() if not m.startswith("[")]
    assert answers == [m for m in text_off.splitlines() if not m.startswith("[")]
    assert answers.count(ANSWER) == len(turns)
    assert [s.restored_tokens for s in st_on] == [s.restored_tokens for s in st_off]
    found = [(int(a), int(b)) for a, b in LOOKUP.findall(text_on)]
    assert len(found) == len(turns) and all(a > 0 for _, a in found)
    assert all(s.passes_saved > len(ANSWER) // 2 for s in st_on), st_on
    assert not LOOKUP.search(text_off) and "saved" not in text_off


def test_the_command_with_and_without_lookup(tmp_path):
    d = write_model_dir(tmp_path / "tiny", "llama")
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path), PYTHONUNBUFFERED="1")

    def chat(*extra):
        p = subprocess.run([sys.executable, "-m", "mlx_kvcache.cli", "chat", "--no-persist",
                            "--model", str(d), "--max-tokens", "24", *extra],
                           input="hello hello hello\nagain\n/stats\n", capture_output=True,
                           text=True, timeout=240, env=env, cwd=str(ROOT))
        assert p.returncode == 0, p.stderr
        return p.stdout

    on, off = chat(), chat("--no-prompt-lookup")
    plain = [ln for ln in on.splitlines() if not ln.startswith("[")]
    assert plain == [ln for ln in off.splitlines() if not ln.startswith("[")]
    assert not LOOKUP.search(off) and "[stats] lookup" not in off
    # (this random model repeats itself: "AAAAAeeeeefoofofof...")
    found = [(int(d), int(a)) for d, a in LOOKUP.findall(on)]
    assert len(found) == 2 and sum(a for _, a in found) > 0, on
    assert re.search(r"^\[stats\] lookup drafted \d+ \| accepted \d+ \(\d+%\) \| passes "
                     r"saved \d+$", on, re.M)
    status = [ln for ln in on.splitlines() if ln.startswith("[cache] prompt")]
    assert len(status) == 2
