"""The test process opens vLLM engines in two places only: the session fixture
(`conftest.engine`) and `app_helpers.another_engine`, which hands vLLM's metrics back to the
session engine when it closes. An engine opened anywhere else would leave the process-wide
registry showing that engine's counters once it closed, and every test that reads the session
engine's counters would wait for numbers that never move."""

from __future__ import annotations

import re
from pathlib import Path

from testkit.repo import ROOT

OPENS = re.compile(r"\bopen_engine\(")
ALLOWED = {"tests/server/conftest.py", "tests/server/app_helpers.py"}


def test_every_second_engine_goes_through_another_engine():
    here = Path(__file__).resolve()
    found = {
        str(p.relative_to(ROOT))
        for p in (ROOT / "tests").rglob("*.py")
        if p.resolve() != here and OPENS.search(p.read_text(errors="replace"))
    }
    assert found <= ALLOWED, (
        f"{sorted(found - ALLOWED)} open an engine in the test process: use "
        "app_helpers.another_engine (it restores the session engine's vLLM metrics)"
    )
    assert found == ALLOWED  # the check still sees the two real ones
