"""The download program's pieces without a Hub: the result's size, the names the layout
refuses, how errors read."""

from __future__ import annotations

import errno
import json

import httpx2
import pytest
from sluice_server.weights.hub import Hub
from sluice_server.weights.layout import check_repo, relative_file
from sluice_server.weights.progress import Progress
from sluice_server.weights.result import Outcome, Result


def test_the_result_fits_a_termination_message() -> None:
    text = Result("error", "a/b", "main", None, 0, 0, "é" * 10_000).to_json()
    assert len(text.encode()) <= 4000
    assert json.loads(text)["message"].endswith("...")


def test_exit_codes_are_distinct_and_zero_only_for_ready() -> None:
    codes = [o.exit_code for o in Outcome]
    assert len(set(codes)) == len(codes) and Outcome.READY.exit_code == 0
    assert 2 not in codes  # argparse's


@pytest.mark.parametrize(
    "path", ["../x", "/etc/passwd", "a/../../x", ".cache/x", ".sluice-weights.json"]
)
def test_file_names_that_would_leave_the_folder_are_refused(path: str) -> None:
    with pytest.raises(ValueError):
        relative_file(path)


@pytest.mark.parametrize("repo", ["gpt2", "a/b/c", "../b", "a/..", "a b/c", ""])
def test_repository_ids_are_org_slash_name(repo: str) -> None:
    with pytest.raises(ValueError):
        check_repo(repo)


@pytest.mark.parametrize(
    ("error", "outcome"),
    [
        (OSError(errno.ENOSPC, "No space left on device"), Outcome.NO_SPACE),
        (httpx2.ConnectError("refused"), Outcome.UNREACHABLE),
        (RuntimeError("odd"), Outcome.ERROR),
    ],
)
def test_errors_read_as_outcomes(error: Exception, outcome: Outcome) -> None:
    hub = Hub(None, endpoint="http://hub.example")
    try:
        raise ValueError("wrapped") from error
    except ValueError as wrapped:
        assert hub.classify(wrapped, repo="a/b", revision="main").outcome is outcome


def test_progress_counts_the_file_in_flight_and_never_past_the_total() -> None:
    p = Progress()
    p.set(phase="downloading", files_total=2, bytes_total=100)
    p.chunk(30)
    assert p.snapshot()["bytes_done"] == 30
    p.restart_file()  # a file downloaded again starts from zero
    p.chunk(80)
    p.file_done(80)
    p.chunk(40)
    assert p.snapshot() | {"commit": None} == {"phase": "downloading", "commit": None, "files_done": 1,
                                               "files_total": 2, "bytes_done": 100, "bytes_total": 100}  # fmt: skip
