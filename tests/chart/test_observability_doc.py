"""docs/observability.md has a runbook line for every alert in the rules file, and the
README links it."""

from __future__ import annotations

import re

import yaml

from .chartlib import OPERATOR_CHART, ROOT

RULES = OPERATOR_CHART / "files" / "prometheus-rules.yaml"
DOC = ROOT / "docs" / "observability.md"


def test_every_alert_has_a_runbook_line():
    alerts = [r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"]
              for r in g["rules"] if "alert" in r]  # fmt: skip
    runbook = DOC.read_text().split("## Runbook", 1)[1]
    lines = re.findall(r"^- \*\*(\w+)\*\*: ", runbook, re.M)
    assert alerts and sorted(lines) == sorted(alerts)


def test_readme_links_it_and_the_picture_exists():
    assert "(docs/observability.md)" in (ROOT / "README.md").read_text()
    assert (ROOT / "docs" / "observability-dashboard.png").is_file()
