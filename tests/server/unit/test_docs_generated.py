"""The server's flag tables and module map are generated (`make docs`) and in step."""

from __future__ import annotations

import pytest
from sluice_server import docgen
from sluice_server.settings import Settings, build_parser


def test_generated_docs_are_in_step():
    assert docgen.main(["--check"]) == 0, "run `make docs`"


def test_a_stale_table_is_detected():
    path, parts = next(iter(docgen.sections().items()))
    text = path.read_text()
    stale = text.replace("`--max-body-bytes`", "`--max-body-size`", 1)
    assert stale != text and docgen.render(stale, parts) == text  # negative control


def test_every_flag_has_a_description_shown_by_help():
    help_text = "".join(build_parser().format_help().split())  # argparse re-wraps lines
    for name, info in Settings.model_fields.items():
        assert info.description, f"Settings.{name} has no description"
        if name != "engine_args":
            assert "".join(info.description.split()) in help_text, name


def test_missing_markers_are_an_error():
    with pytest.raises(ValueError, match="generated:flags"):
        docgen.render("no markers here", {"flags": "x"})


def test_the_flag_table_is_written_once():
    """Other docs link to server/README.md's table instead of carrying a copy of it."""
    repo = docgen.REPO
    docs = [*repo.glob("*.md"), *(repo / "docs").rglob("*.md"), *repo.glob("*/README.md")]
    copies = [
        p.relative_to(repo).as_posix() for p in docs if "| `--max-body-bytes` |" in p.read_text()
    ]
    assert copies == ["server/README.md"]
    assert "../server/README.md#flags" in (repo / "docs" / "design.md").read_text()
