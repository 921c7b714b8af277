"""mypy, configured in the root pyproject.toml (`[tool.mypy]`), finds no errors.

`make lint` runs the same `mypy`; this test makes a plain test run enforce it. The seams
are the point: the `Engine`, `Limiter` and `Cluster` Protocols and every implementation,
test fakes included (tests/seams.py hands each to its Protocol). The negative controls
make one implementation drift from its Protocol in a copy of the checkout and expect mypy
to name it, so a configuration that silently stops checking a seam is caught too.

A cold run analyses the libraries too (vLLM, FastAPI, the Kubernetes client: most of its
time); the copies start from the checkout's `.mypy_cache`, which the first test (or
`make lint`) leaves warm, so each control re-checks only our modules.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# mypy again, over copies of the checkout: `make lint` runs it once already; this proves
# the seams fail when they drift (a minute or more).
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
CACHE = ".mypy_cache"


def mypy(root: Path) -> subprocess.CompletedProcess[str]:
    """`mypy` as `make lint` runs it, in the checkout at `root` (its config, its files)."""
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(root / "pyproject.toml")],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture(scope="module")
def checked() -> subprocess.CompletedProcess[str]:
    """One run over this checkout (it also warms the cache the copies start from)."""
    return mypy(ROOT)


def test_mypy_finds_no_errors(checked):
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert checked.stdout.startswith("Success: no issues found"), checked.stdout


def copy_of_checkout(root: Path) -> Path:
    """What mypy reads (the config, both packages, the fakes and seams), and its cache."""
    shutil.copy(ROOT / "pyproject.toml", root / "pyproject.toml")
    skip = shutil.ignore_patterns("__pycache__")
    for tree in ("operator/sluice_operator", "server/sluice_server", "testing"):
        shutil.copytree(ROOT / tree, root / tree, ignore=skip)
    for module in ("tests/seams.py", "tests/operator/operator_helpers.py"):
        (root / module).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / module, root / module)
    if (ROOT / CACHE).is_dir():
        shutil.copytree(ROOT / CACHE, root / CACHE)
    return root


OP, SRV = "operator/sluice_operator", "server/sluice_server"
# (file, text, its drifted replacement, the implementation mypy must name): a parameter
# dropped from a test fake, an argument's type changed (an engine, the API client), a
# coroutine made a plain function (a limiter).
DRIFTS = [
    (
        "tests/operator/operator_helpers.py",
        "def list_pods(self, namespace: str, selector: str)",
        "def list_pods(self, namespace: str)",
        '"FakeCluster"',
    ),
    (
        f"{SRV}/engine/simulator.py",
        "async def abort(self, request_id: str) -> None:",
        "async def abort(self, request_id: int) -> None:",
        '"SimulatorEngine"',
    ),
    (
        f"{SRV}/core/limits/ratelimit.py",
        "    async def close(self) -> None:\n        await self.client.aclose()",
        "    def close(self) -> None:\n        pass",
        '"RedisLimiter"',
    ),
    (
        f"{OP}/cluster.py",
        "name: str) -> None:\n        from kubernetes",
        "name: int) -> None:\n        from kubernetes",
        '"KubeCluster"',
    ),
]


@pytest.mark.parametrize(
    "path,text,drifted,implementation", DRIFTS, ids=[d[3].strip('"') for d in DRIFTS]
)
def test_each_seam_catches_a_drift(checked, tmp_path, path, text, drifted, implementation):
    root = copy_of_checkout(tmp_path)
    source = (root / path).read_text()
    assert source.count(text) == 1, f"{path} changed: update this control"
    (root / path).write_text(source.replace(text, drifted))
    result = mypy(root)
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"{implementation} have conflicts" in result.stdout, result.stdout
