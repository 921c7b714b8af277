"""A generated block of docs/benchmarks.md: the text between `<!-- bench:<name>:begin -->`
and `<!-- bench:<name>:end -->`, replaced whole by the benchmark that measures it; the
hand-written method and reading guide around it stay."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from testkit.repo import ROOT

DOC = ROOT / "docs" / "benchmarks.md"


def markers(name: str) -> tuple[str, str]:
    return f"<!-- bench:{name}:begin -->", f"<!-- bench:{name}:end -->"


def write(name: str, writer: str, text: str, doc: Path = DOC) -> None:
    """Replace block `name` with `text`, saying that `writer` wrote it. SystemExit when the
    document has no such block (a block is placed by hand, once)."""
    begin, end = markers(name)
    page = doc.read_text()
    if begin not in page:
        raise SystemExit(f"{doc} has no {begin} ... {end} block")
    block = f"{begin}\n<!-- Written by {writer}; edits here are overwritten. -->\n{text}{end}"
    doc.write_text(re.sub(re.escape(begin) + r".*?" + re.escape(end), lambda _: block, page,
                          flags=re.S))  # fmt: skip


def targets_table(rows: Sequence[tuple[str, str, bool | None]]) -> str:
    """A benchmark's `(target, measured, met)` rows as the markdown table every target
    table in docs/benchmarks.md uses (met: yes, **no**, or - when not applicable)."""
    lines = ["| target | measured | met |", "|---|---|:---:|"]
    lines += [f"| {goal} | {measured} | {met_cell(met)} |" for goal, measured, met in rows]
    return "\n".join(lines)


def met_cell(met: bool | None) -> str:
    return "-" if met is None else ("yes" if met else "**no**")
