"""Prometheus's own query engine for tests: `promtool test rules` over synthetic series.

Used by the adapter-rule, alerting-rule and KEDA-query tests. Without promtool (Debian
package `prometheus`, installed by tests/scripts/install-tools.sh) they skip with one line.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterable
from pathlib import Path

import pytest
import yaml


def promtool(what: str) -> str:
    """The promtool binary, or skip the test saying what was not checked."""
    path = shutil.which("promtool")
    if path is None:
        pytest.skip(f"promtool not found (Debian package `prometheus`): {what}")
    return path


def run_tests(
    tmp_path: Path,
    series: Iterable[tuple[str, str]],
    *,
    what: str,
    expr_cases: Iterable[dict] = (),
    alert_cases: Iterable[dict] = (),
    rule_groups: list[dict] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Write a promtool unit-test file (15 s scrape and evaluation interval) for `series`
    ((series, values) pairs in promtool's expanding notation) and run it; the caller asserts
    on the result (also on failures, for negative controls)."""
    binary = promtool(what)
    rule_files = []
    if rule_groups is not None:
        (tmp_path / "rules.yaml").write_text(
            yaml.safe_dump({"groups": rule_groups}, sort_keys=False)
        )
        rule_files = ["rules.yaml"]
    test = {"interval": "15s", "input_series": [{"series": s, "values": v} for s, v in series]}
    if alert_cases:
        test["alert_rule_test"] = list(alert_cases)
    test["promql_expr_test"] = list(expr_cases)
    (tmp_path / "test.yaml").write_text(
        yaml.safe_dump(
            {"rule_files": rule_files, "evaluation_interval": "15s", "tests": [test]},
            sort_keys=False,
        )
    )
    return subprocess.run(
        [binary, "test", "rules", "test.yaml"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
