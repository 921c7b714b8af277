"""The import contracts in the root pyproject.toml (`[tool.importlinter]`) hold.

They are the architecture written as rules (layers, pure modules without kopf or the
Kubernetes client, no cycles), checked by import-linter, which also sees imports made inside
functions. `make lint` runs the same `lint-imports`; this test makes a plain test run
enforce it. The negative controls break a copy of the packages on purpose and expect the
named contract to report it, so a contract that silently matches nothing is caught too.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Installed from tests/requirements.txt next to the interpreter running the tests.
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
CONTRACT_NAMES = {c["id"]: c["name"] for c in CONFIG["contracts"] if "id" in c}


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    """`lint-imports` over the checkout at `root`, whose own package sources come first on the
    path (a shared venv may have the packages installed from another checkout)."""
    assert LINT_IMPORTS.exists(), "lint-imports missing: pip install -r tests/requirements.txt"
    path = [str(root / "operator"), str(root / "server"), os.environ.get("PYTHONPATH", "")]
    return subprocess.run(
        [str(LINT_IMPORTS), "--config", str(root / "pyproject.toml"), "--no-cache"],
        cwd=root,
        # lint-imports wraps its report at the terminal's width (80 without one): a wide one
        # keeps each contract's name, and its KEPT or BROKEN, on one line.
        env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p), "COLUMNS": "1000"},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_import_contracts_are_kept():
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    for name in CONTRACT_NAMES.values():
        assert f"{name} KEPT" in result.stdout, f"contract {name!r} was not checked"


def copy_of_checkout(root: Path) -> Path:
    """The config and both packages, copied so a test can break a rule in the copy."""
    shutil.copy(ROOT / "pyproject.toml", root / "pyproject.toml")
    for package in ("operator/sluice_operator", "server/sluice_server"):
        shutil.copytree(
            ROOT / package, root / package, ignore=shutil.ignore_patterns("__pycache__")
        )
    return root


# (contract id, new modules, lines appended to existing ones; paths under the repository).
# Most imports sit inside a function, where an AST walk over top-level statements would not
# look.
OP, SRV = "operator/sluice_operator", "server/sluice_server"
VIOLATIONS = [
    ("operator-pure", {f"{OP}/models/_probe.py": "def f():\n    import kopf\n"}, {}),
    (
        "operator-pure",
        {f"{OP}/builders/_probe.py": "def f():\n    from kubernetes import client\n"},
        {},
    ),
    (
        "operator-layers",
        {f"{OP}/builders/_probe.py": "def f():\n    from .. import reconcile\n"},
        {},
    ),
    ("operator-layers", {f"{OP}/_probe.py": '"""A top-level module without a layer."""\n'}, {}),
    (
        "operator-generated-files",
        {},
        {f"{OP}/generate/apidocs.py": "def f():\n    from . import crd\n"},
    ),
    (
        "operator-acyclic",
        {f"{OP}/models/_probe.py": "from . import spec\n"},
        {f"{OP}/models/spec.py": "from . import _probe\n"},
    ),
    (
        "server-layers",
        {},
        {f"{SRV}/core/streaming/stream.py": "def f():\n    from ...protocols import openai\n"},
    ),
    ("server-layers", {}, {f"{SRV}/engine/base.py": "def f():\n    from ..core import errors\n"}),
    ("server-protocols", {}, {f"{SRV}/protocols/websocket.py": "from . import token_sse\n"}),
    (
        "server-core",
        {},
        {f"{SRV}/core/streaming/stream.py": "def f():\n    from .. import services\n"},
    ),
    ("server-core", {f"{SRV}/core/_probe.py": '"""A core module without a layer."""\n'}, {}),
    ("server-core-auth", {}, {f"{SRV}/core/auth/identity.py": "from . import credentials\n"}),
    ("server-core-limits", {}, {f"{SRV}/core/limits/shared_memory.py": "from . import slots\n"}),
    ("server-core-streaming", {}, {f"{SRV}/core/streaming/keepalive.py": "from . import events\n"}),
    (
        "server-core-telemetry",
        {},
        {f"{SRV}/core/telemetry/tracing.py": "from . import accesslog\n"},
    ),
    ("server-engines", {}, {f"{SRV}/engine/simulator.py": "from . import vllm_engine\n"}),
    (
        "server-engines",
        {f"{SRV}/engine/_probe.py": '"""An engine module without a layer."""\n'},
        {},
    ),
    ("server-router", {}, {f"{SRV}/router/models.py": "def f():\n    from . import app\n"}),
    (
        "server-router-without-vllm",
        {},
        {f"{SRV}/router/upstream.py": "def f():\n    import torch\n"},
    ),
    (
        "server-router-without-vllm",
        {},
        {f"{SRV}/router/proxy.py": "def f():\n    from ..engine import vllm_engine\n"},
    ),
    (
        "server-simulator-without-vllm",
        {},
        {f"{SRV}/engine/builtin_api.py": "def f():\n    from vllm import SamplingParams\n"},
    ),
    (
        "server-router-without-vllm",
        {},
        {f"{SRV}/kvcache/blockhash.py": "def f():\n    import torch\n"},
    ),
    (
        "server-layers",
        {},
        {f"{SRV}/kvcache/kvevents.py": "def f():\n    from ..engine import base\n"},
    ),
]


@pytest.mark.parametrize(
    "contract,new,appended",
    VIOLATIONS,
    ids=[f"{c}:{','.join(Path(p).name for p in [*n, *a])}" for c, n, a in VIOLATIONS],
)
def test_each_contract_catches_a_violation(tmp_path, contract, new, appended):
    root = copy_of_checkout(tmp_path)
    for rel, source in new.items():
        (root / rel).write_text(source)
    for rel, source in appended.items():
        (root / rel).write_text((root / rel).read_text() + "\n\n" + source)
    result = lint_imports(tmp_path)
    assert result.returncode != 0, result.stdout
    assert f"{CONTRACT_NAMES[contract]} BROKEN" in result.stdout, result.stdout + result.stderr
