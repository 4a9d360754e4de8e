"""The real agent CLIs against a server, each request recorded, and each request's cost
against a cache-perfect replay of the same session: ``scripts/bench_agents.py
--clients`` (its module doc says what is measured; this file drives the clients).

Clients (`CLIENTS`), headless, each in a HOME of its own with a fake key, through a
recording proxy (`mlx_kvcache.testing.agent_replay.Recorder`) in front of the server:

  claude              ``claude -p`` then ``claude -p --continue``: 3 ``Read`` steps a turn
                      (side traffic off: ``CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1``)
  claude-agents       two ``Agent`` calls in one answer (general-purpose subagents, in the
                      background: each reads a file, then the main loop answers each
                      ``<task-notification>``); side traffic on
  claude-forks        the same with ``subagent_type: "fork"`` (the parent's whole prefix)
  codex               ``codex exec`` then ``codex exec resume --last``: 3 ``exec_command``
                      (``cat``) steps a turn
  opencode            ``opencode run`` then ``opencode run --continue`` through an
                      ``@ai-sdk/openai-compatible`` provider: chat completions; 3 ``read``
                      steps a turn; ``OPENCODE_EXPERIMENTAL_CACHE_STABILIZATION=1``
  opencode-anthropic  the same through an ``@ai-sdk/anthropic`` provider: ``/v1/messages``
  qwen                ``qwen -p`` then ``qwen -p --continue`` (``OPENAI_BASE_URL``): chat
                      completions; 3 ``read_file`` steps a turn

The CLIs are installed from npm (`install_clients`) into a folder outside the repository.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from mlx_kvcache.testing.agent_templates import CUE, SUBCUE

#: The npm packages (and the versions measured; a newer one is installed where asked).
PACKAGES = {"claude": "@anthropic-ai/claude-code@2.1.332", "codex": "@openai/codex@0.171.0",
            "opencode": "opencode-ai@1.18.33", "qwen": "@qwen-code/qwen-code@0.24.4"}


def install_clients(where: Path) -> Dict[str, Path]:
    """The four CLIs, installed from npm under ``where`` once (a folder outside the
    repository); their commands."""
    bins = {k: where / "node_modules" / ".bin" / k for k in PACKAGES}
    if not all(b.exists() for b in bins.values()):
        where.mkdir(parents=True, exist_ok=True)
        subprocess.run(["npm", "install", "--prefix", str(where), "--no-audit", "--no-fund",
                        *PACKAGES.values()], check=True)
    return bins


def versions(bins: Dict[str, Path]) -> Dict[str, str]:
    """Each CLI's ``--version`` line."""
    out = {}
    for k, b in bins.items():
        r = subprocess.run([str(b), "--version"], capture_output=True, text=True, timeout=120)
        out[k] = (r.stdout.strip() or r.stderr.strip()).splitlines()[-1]
    return out


@dataclass
class Client:
    """How one client is driven: which CLI, the route it speaks, the scripted model's
    calls (per step, the calls made at once; ``sub``: a subagent's), and `turn`."""

    name: str
    cli: str
    route: str
    steps: Callable[[Sequence[Path]], List[List[Tuple[str, Dict[str, Any]]]]]
    sub: Optional[Callable[[Sequence[Path]], List[List[Tuple[str, Dict[str, Any]]]]]] = None
    question: str = "{q}"

    def turn(self, bins: Dict[str, Path], base: str, cwd: Path, home: Path, prompt: str,
             first: bool, timeout: float = 7200, model: str = "local") -> str:
        """One headless CLI turn against the server at ``base`` (``http://127.0.0.1:PORT``),
        asking for ``model`` (the name the server serves: stock ``mlx_lm.server`` serves
        ``default_model``, and loads any other name from the Hugging Face hub); its output.
        Raises on a failed turn."""
        home.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, HOME=str(home), PWD=str(cwd), XDG_CONFIG_HOME=str(home / ".config"),
                   XDG_DATA_HOME=str(home / ".local" / "share"),
                   XDG_CACHE_HOME=str(home / ".cache"), XDG_STATE_HOME=str(home / ".state"))
        exe = str(bins[self.cli])
        if self.cli == "claude":
            env.update(ANTHROPIC_BASE_URL=base, ANTHROPIC_AUTH_TOKEN="local",
                       ANTHROPIC_MODEL=model, ANTHROPIC_SMALL_FAST_MODEL=model,
                       CLAUDE_CODE_MAX_CONTEXT_TOKENS="262144")
            if self.name == "claude":
                env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] = "1"
            argv = [exe, *([] if first else ["--continue"]), "-p", prompt, "--max-turns", "10",
                    "--allowedTools", "Read", "Agent"]
        elif self.cli == "codex":
            (home / "config.toml").write_text(
                f'model = "{model}"\nmodel_provider = "bench"\n[model_providers.bench]\n'
                f'name = "bench"\nbase_url = "{base}/v1"\nwire_api = "responses"\n'
                'stream_idle_timeout_ms = 3600000\n')
            env.update(CODEX_HOME=str(home), OPENAI_API_KEY="local")
            argv = [exe, "exec", "--skip-git-repo-check",
                    "--dangerously-bypass-approvals-and-sandbox",
                    *([] if first else ["resume", "--last"]), prompt]
        elif self.cli == "opencode":
            anthropic = self.route == "messages"
            provider = {
                "npm": "@ai-sdk/anthropic" if anthropic else "@ai-sdk/openai-compatible",
                "name": "local", "options": {"baseURL": f"{base}/v1", "apiKey": "local"},
                "models": {model: {"name": "local", "reasoning": True, "tool_call": True,
                                   "limit": {"context": 262144, "output": 32000}}}}
            cfg = home / "opencode.json"
            cfg.write_text(json.dumps({"$schema": "https://opencode.ai/config.json",
                                       "model": f"local/{model}", "autoupdate": False,
                                       "share": "disabled", "provider": {"local": provider}}))
            env.update(OPENCODE_CONFIG=str(cfg), OPENCODE_DISABLE_AUTOUPDATE="1",
                       OPENCODE_DISABLE_MODELS_FETCH="1",
                       OPENCODE_EXPERIMENTAL_CACHE_STABILIZATION="1")
            argv = [exe, "run", "--model", f"local/{model}", "--dir", str(cwd),
                    *([] if first else ["--continue"]), prompt]
        elif self.cli == "qwen":
            env.update(OPENAI_BASE_URL=f"{base}/v1", OPENAI_API_KEY="local",
                       OPENAI_MODEL=model, QWEN_CODE_SUPPRESS_YOLO_WARNING="1")
            argv = [exe, *([] if first else ["--continue"]), "-p", prompt, "--auth-type",
                    "openai", "--yolo"]
        else:
            raise ValueError(self.cli)
        r = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True,
                           timeout=timeout)
        if r.returncode != 0:
            raise RuntimeError(f"{self.name} failed ({r.returncode}): {r.stderr[-2000:]}")
        return r.stdout


def _reads(tool: str, arg: str, fmt: str = "{}"):
    return lambda files: [[(tool, {arg: fmt.format(f)})] for f in files]


def _agents(kind: str):
    def steps(files):
        return [[("Agent", {"description": f"read part {k + 1}",
                            "prompt": f"Read {f} and sum it up. {SUBCUE}",
                            "subagent_type": kind}) for k, f in enumerate(files[:2])]]
    return steps


CLIENTS: Dict[str, Client] = {
    "claude": Client("claude", "claude", "messages", _reads("Read", "file_path")),
    "claude-agents": Client("claude-agents", "claude", "messages", _agents("general-purpose"),
                            sub=lambda files: [[("Read", {"file_path": str(files[0])})]],
                            question="Use two agents: {q}"),
    "claude-forks": Client("claude-forks", "claude", "messages", _agents("fork"),
                           sub=lambda files: [[("Read", {"file_path": str(files[0])})]],
                           question="Fork two agents: {q}"),
    "codex": Client("codex", "codex", "responses", _reads("exec_command", "cmd", "cat {}")),
    "opencode": Client("opencode", "opencode", "chat", _reads("read", "filePath")),
    "opencode-anthropic": Client("opencode-anthropic", "opencode", "messages",
                                 _reads("read", "filePath")),
    "qwen": Client("qwen", "qwen", "chat", _reads("read_file", "file_path")),
}


def prompt_of(client: Client, question: str) -> str:
    """The turn's prompt: the question as the client variant asks it, with the cue."""
    return client.question.format(q=question) + f" {CUE}"
