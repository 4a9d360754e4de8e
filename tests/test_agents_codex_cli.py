"""The real Codex CLI (npm ``@openai/codex``), headless, applies a patch through
``/v1/responses``: Codex offers ``apply_patch`` as a ``custom`` tool, the server offers it
to the model as a function of one string, returns the model's call as a
``custom_tool_call`` with the raw patch, Codex applies it and sends the
``custom_tool_call_output`` back, and the model's final answer ends the turn.

The CLI is installed once with npm into ``~/.cache/mlx_kvcache/codex-cli`` (or
``$MLX_KVCACHE_CODEX_CLI_DIR``); the test is skipped only where npm is not installed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from mlx_kvcache.testing.agent_dirs import PATCHED, write_patch_dir
from mlx_kvcache.testing.servers import Server
from mlx_kvcache.testing.waits import CAP

pytestmark = pytest.mark.timeout(CAP)

#: The Codex release the test was written against (its bundled model catalog names
#: ``gpt-5.5``, whose ``apply_patch`` is the free-form, custom tool).
CODEX_VERSION = "0.171.0"
CODEX_MODEL = "gpt-5.5"


def _codex() -> Path:
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("npm is not installed: the Codex CLI cannot be installed")
    where = Path(os.environ.get("MLX_KVCACHE_CODEX_CLI_DIR")
                 or Path.home() / ".cache" / "mlx_kvcache" / "codex-cli")
    cli = where / "node_modules" / ".bin" / "codex"
    if not cli.exists():
        where.mkdir(parents=True, exist_ok=True)
        subprocess.run([npm, "install", "--prefix", str(where), "--no-audit", "--no-fund",
                        f"@openai/codex@{CODEX_VERSION}"], check=True, timeout=CAP,
                       capture_output=True)
    return cli


def test_codex_applies_a_patch_through_the_server(tmp_path):
    cli = _codex()
    model = write_patch_dir(tmp_path / "model")
    with Server.ours(model, tmp_path / "log.txt", tmp_path / "home", "--no-persist") as s:
        home, work = tmp_path / "codex_home", tmp_path / "work"
        home.mkdir()
        work.mkdir()
        (home / "config.toml").write_text(
            f'model = "{CODEX_MODEL}"\nmodel_provider = "mlx-kvcache"\n\n'
            '[model_providers.mlx-kvcache]\nname = "mlx-kvcache"\n'
            f'base_url = "http://127.0.0.1:{s.port}/v1"\nwire_api = "responses"\n')
        env = dict(os.environ, CODEX_HOME=str(home), OPENAI_API_KEY="local")
        r = subprocess.run([str(cli), "exec", "--skip-git-repo-check",
                            "--dangerously-bypass-approvals-and-sandbox", "Add hello.txt"],
                           cwd=work, env=env, capture_output=True, text=True, timeout=CAP,
                           stdin=subprocess.DEVNULL)
        assert r.returncode == 0, r.stderr[-3000:]
        assert (work / "hello.txt").read_text() == "hello\n"  # the patch, applied by Codex
        assert r.stdout.strip().endswith(PATCHED)
        # Codex saw a custom tool call and sent its output back (its session record)
        (rollout,) = home.glob("sessions/**/*.jsonl")
        kinds = [json.loads(line).get("payload", {}).get("type")
                 for line in rollout.read_text().splitlines()]
        assert "custom_tool_call" in kinds and "custom_tool_call_output" in kinds
        # the second request read the first one's prompt from the cache
        first, second = s.cache()["recent"][-2:]
        assert second["cached_tokens"] >= first["prompt_tokens"] - 1
