"""The server's assembly (`serving/app.py`, `serving/seam.py`), in process: the mlx-lm
version guard and its one-line exit, our options on mlx-lm's parser, an empty admin
token refused at start."""

from __future__ import annotations

import inspect

import pytest

from mlx_kvcache.serving import app, seam


def test_seam_probe_and_one_line_exit(monkeypatch, capsys):
    from mlx_lm import server as S

    assert seam.check() is None  # the installed mlx-lm is a supported one
    monkeypatch.setattr("mlx_lm.__version__", "0.40.0")
    assert "outside the tested range" in seam.check()

    def changed(self, tokenizer, request):  # a future signature
        pass
    monkeypatch.setattr(S.ResponseGenerator, "_tokenize", changed)
    with pytest.raises(seam.SeamError, match="_tokenize changed"):
        seam.check()
    assert app.main(["--model", "x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: mlx-kvcache serve cannot run")


def test_serve_options_join_mlx_lm_parser():
    import argparse

    p = argparse.ArgumentParser()
    app.add_options(p)
    a = p.parse_args(["--checkpoint-interval", "64", "--no-persist", "--max-disk-bytes", "2G"])
    # sizes read as in the chat command: G is a power of 1024, GB of 1000
    assert a.checkpoint_interval == 64 and a.no_persist and a.max_disk_bytes == 2 << 30
    assert p.parse_args(["--max-disk-bytes", "2GB"]).max_disk_bytes == 2 * 10**9
    assert a.shutdown_grace == 30 and a.admin_token is None
    a = p.parse_args(["--shutdown-grace", "2.5", "--admin-token", "t", "--max-disk-bytes", "1.5G"])
    assert a.shutdown_grace == 2.5 and a.admin_token == "t" and a.max_disk_bytes == int(1.5 * 2**30)
    for bad in (["--shutdown-grace", "-1"], ["--shutdown-grace", "nan"],
                ["--shutdown-grace", "inf"], ["--max-disk-bytes", "-1"],
                ["--max-disk-bytes", "lots"], ["--max-disk-bytes", "4X"],
                ["--max-disk-bytes", ""], ["--max-disk-bytes", "1.2.3G"]):
        with pytest.raises(SystemExit):
            p.parse_args(bad)
    with pytest.raises(SystemExit):
        p.parse_args(["--checkpoint-interval", "0"])
    assert "DEFAULT_CHECKPOINT_INTERVAL" in inspect.getsource(app)
    text = p.format_help()  # every help string formats (a bare % would raise)
    assert "--memory-limit" in text and "--prompt-excerpts" in text
    a = p.parse_args(["--memory-limit", "8G", "--memory-wait", "5"])
    assert a.memory_limit == 8 << 30 and a.memory_wait == 5
    with pytest.raises(SystemExit):
        p.parse_args(["--memory-limit", "-1"])


def test_an_empty_admin_token_is_refused_at_start(monkeypatch, capsys):
    import argparse
    import subprocess
    import sys

    from mlx_kvcache.serving.guards.admin import TOKEN_ENV, AdminPolicy

    def parser():
        p = argparse.ArgumentParser()
        app.add_options(p)
        return p
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    for bad in ("", "  "):
        with pytest.raises(SystemExit):
            parser().parse_args(["--admin-token", bad])
        assert "admin token is empty" in capsys.readouterr().err
        monkeypatch.setenv(TOKEN_ENV, bad)  # the variable, as the flag's default
        with pytest.raises(SystemExit):
            parser().parse_args([])
        assert "admin token is empty" in capsys.readouterr().err
        with pytest.raises(ValueError, match="empty"):
            AdminPolicy.make(None, "127.0.0.1")
        with pytest.raises(ValueError, match="empty"):
            AdminPolicy.make(bad, "127.0.0.1")
        monkeypatch.delenv(TOKEN_ENV)
    monkeypatch.setenv(TOKEN_ENV, "s3cret")
    assert parser().parse_args([]).admin_token == "s3cret"
    assert parser().parse_args(["--admin-token", "x"]).admin_token == "x"
    # The whole command: one line, exit 2, before any model is loaded.
    r = subprocess.run([sys.executable, "-m", "mlx_kvcache.cli", "serve", "--model",
                        "/nonexistent", "--admin-token", ""], capture_output=True, text=True)
    assert r.returncode == 2 and "admin token is empty" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
