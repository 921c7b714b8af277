"""Secrets read from files at start: `--redis-url-file` (the Redis URL) and HF_TOKEN_PATH
(the Hugging Face token huggingface_hub reads), each refused at start with a message that
names the file and what it must hold when it is missing or empty."""

from __future__ import annotations

import pytest
from sluice_server.__main__ import main
from sluice_server.settings import parse_settings

BASE = ["--model", "tiny", "--engine", "simulator"]
REDIS = [*BASE, "--rate-limit-backend", "redis"]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in ("SLUICE_REDIS_URL", "SLUICE_REDIS_URL_FILE", "HF_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)


def test_redis_url_read_from_its_file_stripped(tmp_path):
    path = tmp_path / "url"
    path.write_text("  redis://:p%40ss@redis.cache:6379/0\n")  # kubectl --from-file keeps the \n
    s = parse_settings([*REDIS, "--redis-url-file", str(path)])
    assert s.redis_url is not None
    assert s.redis_url.get_secret_value() == "redis://:p%40ss@redis.cache:6379/0"
    assert "p%40ss" not in repr(s) and "p%40ss" not in str(s.model_dump())


def test_redis_url_file_from_the_environment(tmp_path, monkeypatch):
    path = tmp_path / "url"
    path.write_text("redis://r:6379/1")
    monkeypatch.setenv("SLUICE_REDIS_URL_FILE", str(path))
    assert parse_settings(REDIS).redis_url.get_secret_value() == "redis://r:6379/1"


@pytest.mark.parametrize(
    "content, says",
    [
        (None, "/url: no such file; it must hold the Redis URL"),
        ("", "/url is empty; it must hold the Redis URL"),
        (" \n\n", "/url is empty; it must hold the Redis URL"),
    ],
    ids=["missing", "empty", "blank"],
)
def test_a_missing_or_empty_redis_url_file_stops_the_server(tmp_path, capsys, content, says):
    path = tmp_path / "url"
    if content is not None:
        path.write_text(content)
    assert main([*REDIS, "--redis-url-file", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"sluice-server: invalid settings: --redis-url-file {tmp_path}{says}")
    assert "(on Kubernetes: " in err and "Traceback" not in err


def test_an_unreadable_redis_url_file_says_why(tmp_path, capsys):
    assert main([*REDIS, "--redis-url-file", str(tmp_path)]) == 2  # a directory
    assert f"--redis-url-file {tmp_path}: cannot read it" in capsys.readouterr().err


def test_a_url_and_a_url_file_together_are_refused(tmp_path, monkeypatch, capsys):
    path = tmp_path / "url"
    path.write_text("redis://file:6379/0")
    monkeypatch.setenv("SLUICE_REDIS_URL", "redis://env:6379/0")
    assert main([*REDIS, "--redis-url-file", str(path)]) == 2
    assert "give --redis-url-file or --redis-url (SLUICE_REDIS_URL), not both" in (
        capsys.readouterr().err
    )


def test_redis_without_a_url_names_both_ways(capsys):
    assert main(REDIS) == 2
    assert "--rate-limit-backend redis needs --redis-url-file or --redis-url" in (
        capsys.readouterr().err
    )


def test_the_url_file_alone_does_not_turn_redis_on(tmp_path):
    path = tmp_path / "url"
    path.write_text("redis://r:6379/0")
    assert parse_settings([*BASE, "--redis-url-file", str(path)]).rate_limit_backend == "memory"


def test_hf_token_path_is_checked_at_start(tmp_path, monkeypatch, capsys):
    token = tmp_path / "token"
    monkeypatch.setenv("HF_TOKEN_PATH", str(token))
    assert main(BASE) == 2
    assert f"HF_TOKEN_PATH {token}: no such file; it must hold a Hugging Face token" in (
        capsys.readouterr().err
    )
    token.write_text("\n")
    assert main(BASE) == 2
    assert f"HF_TOKEN_PATH {token} is empty" in capsys.readouterr().err
    token.write_text("hf_abc\n")
    parse_settings(BASE)  # accepted: huggingface_hub reads the file itself


def test_hf_token_path_unset_or_empty_checks_nothing(monkeypatch):
    parse_settings(BASE)
    monkeypatch.setenv("HF_TOKEN_PATH", "")
    parse_settings(BASE)


def test_huggingface_hub_reads_the_token_from_hf_token_path(tmp_path):
    """The contract the operator relies on (HF_TOKEN_PATH instead of HF_TOKEN), in a fresh
    interpreter: huggingface_hub reads the variable when it is imported."""
    import os
    import subprocess
    import sys

    token = tmp_path / "token"
    token.write_text("hf_from_the_file\n")
    env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")}
    out = subprocess.run(
        [sys.executable, "-c", "import huggingface_hub; print(huggingface_hub.get_token())"],
        env={**env, "HF_TOKEN_PATH": str(token)}, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert out.stdout.strip() == "hf_from_the_file"
