"""The download program against the fake Hub, through the real `huggingface_hub` client:
the layout and marker, resume, integrity, the failures a person must act on, reruns."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from pathlib import Path

import pytest
from sluice_server.weights.layout import MARKER, WORK_DIR
from sluice_server.weights.result import Outcome
from testkit.fake_hub import FakeHub
from testkit.net import free_port
from testkit.wait import eventually

from .weights_helpers import BIG, REPO, gets, model_files, run


def test_a_revision_is_laid_out_by_commit_with_the_marker_last(hub: FakeHub, root: Path) -> None:
    files = model_files()
    commit = hub.add_repo(REPO, files).refs["main"]
    result, progress = run(hub, root)
    assert result.outcome == "ready" and result.commit == commit
    assert (result.files, result.bytes) == (3, sum(map(len, files.values())))
    folder = root / "acme" / "tiny" / commit
    assert sorted(p.name for p in folder.iterdir()) == sorted([*files, MARKER])  # no .cache left
    for name, data in files.items():
        assert (folder / name).read_bytes() == data
        assert gets(hub, name) == 1
    marker = json.loads((folder / MARKER).read_text())
    assert {k: marker[k] for k in ("repo", "revision", "commit", "files", "bytes")} == {
        "repo": REPO, "revision": "main", "commit": commit, "files": 3, "bytes": result.bytes}  # fmt: skip
    assert marker["verifiedAt"].endswith("Z")
    shard = next(e for e in marker["manifest"] if e["path"] == "model.safetensors")
    assert shard["sha256"] == hashlib.sha256(files["model.safetensors"]).hexdigest()
    # The marker was the last write into the folder.
    newest = max((p for p in folder.rglob("*") if p.is_file()), key=lambda p: p.stat().st_mtime_ns)
    assert newest.name == MARKER
    assert progress.snapshot() == {"phase": "ready", "commit": commit, "files_done": 3,
                                   "files_total": 3, "bytes_done": result.bytes,
                                   "bytes_total": result.bytes}  # fmt: skip


def test_a_cut_connection_resumes_where_it_stopped(hub: FakeHub, root: Path) -> None:
    files = model_files(shard=BIG)
    hub.add_repo(REPO, files)
    hub.cut["model.safetensors"] = 1
    result, _ = run(hub, root)
    assert result.outcome == "ready"
    requests = hub.file_requests("model.safetensors", "GET")
    assert len(requests) == 2 and requests[0].range is None and requests[1].range is not None
    assert requests[1].status == 206
    # Half a file cut, then the rest from the last chunk written: far less than two copies.
    assert hub.bytes_served("model.safetensors") < 2 * BIG
    assert hub.bytes_served("model.safetensors") <= BIG + BIG // 2


def test_a_damaged_file_is_deleted_and_fetched_again(hub: FakeHub, root: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    hub.add_repo(REPO, model_files())
    hub.corrupt["model.safetensors"] = 1
    with caplog.at_level(logging.INFO, "sluice.weights"):
        result, _ = run(hub, root)
    assert result.outcome == "ready"
    assert gets(hub, "model.safetensors") == 2
    assert "model.safetensors arrived damaged (sha256" in caplog.text
    # The result (the Job's termination message, the operator's Event) says so too.
    assert "downloaded again after a check failed: model.safetensors (arrived damaged: sha256" in (
        result.message
    )


def test_a_file_damaged_every_time_ends_corrupt_without_a_marker(hub: FakeHub, root: Path) -> None:
    repo = hub.add_repo(REPO, model_files())
    hub.corrupt["model.safetensors"] = -1
    result, progress = run(hub, root)
    assert result.outcome == "corrupt" and Outcome.CORRUPT.exit_code == 7
    assert "model.safetensors" in result.message and "arrived damaged twice" in result.message
    assert "downloaded again" not in result.message
    assert gets(hub, "model.safetensors") == 2
    folder = root / "acme" / "tiny" / repo.refs["main"]
    assert not (folder / MARKER).exists() and not (folder / "model.safetensors").exists()
    assert progress.phase == "failed"


def test_without_the_hash_check_a_damaged_file_would_be_marked_ready(
    hub: FakeHub, root: Path
) -> None:
    """Negative control: same size, one byte changed. huggingface_hub checks the size only;
    the sha256 is what catches it."""
    files = model_files()
    repo = hub.add_repo(REPO, files)
    hub.corrupt["model.safetensors"] = -1
    result, _ = run(hub, root, verify_hashes=False)
    assert result.outcome == "ready"
    shard = root / "acme" / "tiny" / repo.refs["main"] / "model.safetensors"
    assert shard.stat().st_size == len(files["model.safetensors"])
    assert shard.read_bytes() != files["model.safetensors"]


def test_a_small_file_is_checked_by_its_git_blob_hash(hub: FakeHub, root: Path) -> None:
    hub.add_repo(REPO, model_files())
    hub.corrupt["config.json"] = -1
    result, _ = run(hub, root)
    assert result.outcome == "corrupt" and "git blob SHA-1" in result.message


def test_a_rerun_keeps_the_files_an_earlier_run_finished(hub: FakeHub, root: Path) -> None:
    files = model_files()
    repo = hub.add_repo(REPO, files)
    hub.corrupt["tokenizer.json"] = -1  # the first run stops there (files in name order)
    assert run(hub, root)[0].outcome == "corrupt"
    assert gets(hub, "config.json") == 1
    hub.corrupt.clear()
    result, _ = run(hub, root)
    assert result.outcome == "ready"
    assert gets(hub, "config.json") == 1  # not fetched again
    assert gets(hub, "tokenizer.json") == 3 and gets(hub, "model.safetensors") == 1
    assert (root / "acme" / "tiny" / repo.refs["main"] / "tokenizer.json").read_bytes() == files[
        "tokenizer.json"
    ]


def test_a_file_left_on_the_volume_is_hashed_before_it_is_kept(hub: FakeHub, root: Path) -> None:
    """A file of the right size but no record of a check (a run killed between the
    download's rename and its check, or bytes put there by hand) is hashed; a wrong one is
    fetched again."""
    files = model_files()
    commit = hub.add_repo(REPO, files).refs["main"]
    folder = root / "acme" / "tiny" / commit
    folder.mkdir(parents=True)
    (folder / "config.json").write_bytes(files["config.json"])
    (folder / "model.safetensors").write_bytes(bytes(len(files["model.safetensors"])))
    assert run(hub, root)[0].outcome == "ready"
    assert gets(hub, "config.json") == 0 and gets(hub, "model.safetensors") == 1
    assert (folder / "model.safetensors").read_bytes() == files["model.safetensors"]


def test_a_complete_commit_needs_no_network_and_a_branch_one_api_call(
    hub: FakeHub, root: Path
) -> None:
    commit = hub.add_repo(REPO, model_files()).refs["main"]
    assert run(hub, root)[0].outcome == "ready"
    before = len(hub.requests)
    result, _ = run(hub, root, revision="main")
    assert result.outcome == "ready" and result.commit == commit
    assert [r.path for r in hub.requests[before:]] == [f"/api/models/{REPO}/revision/main"]
    hub.stop()  # with the commit as revision, not even the Hub's address is needed
    result, progress = run(hub, root, revision=commit, endpoint=f"http://127.0.0.1:{free_port()}")
    assert (result.outcome, result.commit, result.files) == ("ready", commit, 3)
    assert progress.snapshot()["phase"] == "ready"


def test_a_damaged_complete_folder_is_filled_again(hub: FakeHub, root: Path) -> None:
    commit = hub.add_repo(REPO, model_files()).refs["main"]
    run(hub, root)
    folder = root / "acme" / "tiny" / commit
    (folder / "model.safetensors").unlink()
    hub.hold["model.safetensors"] = held = threading.Event()
    box: list = []
    refill = threading.Thread(target=lambda: box.append(run(hub, root, revision=commit)[0]))
    refill.start()
    try:
        # While the file is fetched again, the folder is not marked complete.
        eventually(lambda: gets(hub, "model.safetensors") == 2, timeout=30)
        assert not (folder / MARKER).exists()
    finally:
        held.set()
        refill.join(60)
    assert box[0].outcome == "ready" and (folder / MARKER).exists()
    assert gets(hub, "model.safetensors") == 2 and gets(hub, "config.json") == 1


def test_a_gated_model_without_a_token_fails_before_any_download(hub: FakeHub, root: Path) -> None:
    hub.add_repo(REPO, model_files(), gated=True, tokens={"hf_good"})
    result, _ = run(hub, root)
    assert result.outcome == "gated" and Outcome.GATED.exit_code == 4
    assert "gated" in result.message and "accept its license" in result.message
    assert hub.file_requests() == []


def test_a_gated_model_refuses_a_token_that_has_not_accepted_the_license(
    hub: FakeHub, root: Path
) -> None:
    hub.add_repo(REPO, model_files(), gated=True, tokens={"hf_good"})
    result, _ = run(hub, root, token="hf_other")
    assert result.outcome == "gated"
    assert result.message.startswith(f"the Hub refused the token for {REPO}")
    assert "accept the model's license" in result.message
    assert "hf_other" not in result.message
    result, _ = run(hub, root, token="hf_good")
    assert result.outcome == "ready"
    assert {r.token for r in hub.file_requests()} == {"hf_other", "hf_good"}


@pytest.mark.parametrize(
    ("token", "repo", "revision", "outcome", "words"),
    [
        (None, "acme/private", "main", "unauthorized", "without a token (401)"),
        ("hf_x", "acme/missing", "main", "not_found", "does not exist"),
        (None, REPO, "v9", "not_found", "has no revision 'v9'"),
        ("bad-token", REPO, "main", "unauthorized", "refused the token"),
    ],
)
def test_hub_refusals_are_outcomes_a_person_can_act_on(hub: FakeHub, root: Path, token: str | None,
                                                       repo: str, revision: str, outcome: str,
                                                       words: str) -> None:  # fmt: skip
    hub.add_repo(REPO, model_files())
    hub.add_repo("acme/private", model_files(), private=True, tokens={"hf_good"})
    result, _ = run(hub, root, revision, repo=repo, token=token)
    assert (result.outcome, result.commit) == (outcome, None)
    assert words in result.message and repo in result.message
    assert not list(root.rglob(MARKER))


def test_a_volume_too_small_fails_before_downloading(hub: FakeHub, root: Path) -> None:
    files = model_files()
    hub.add_repo(REPO, files)
    total = sum(map(len, files.values()))
    result, _ = run(hub, root, free_bytes=lambda _: 1000)
    assert result.outcome == "no_space" and Outcome.NO_SPACE.exit_code == 6
    assert str(root) in result.message and "1,000 bytes free" in result.message
    assert f"{total:,} bytes) more" in result.message
    assert hub.file_requests() == []
    # Negative control: with room, the same repository downloads.
    assert run(hub, root, free_bytes=lambda _: total)[0].outcome == "ready"


@pytest.mark.filterwarnings("ignore:Not enough free disk space")
def test_a_real_full_volume_is_no_space(hub: FakeHub, tmp_path: Path) -> None:
    """ENOSPC from the kernel (a 1 MiB tmpfs), past an up-front check told there is room."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    small = tmp_path / "small"
    small.mkdir()
    if os.system(f"mount -t tmpfs -o size=1m tmpfs {small}") != 0:
        pytest.skip("mount -t tmpfs is not permitted here")
    try:
        hub.add_repo(REPO, model_files(shard=3 * 1024 * 1024))
        result, _ = run(hub, small, free_bytes=lambda _: 1 << 40)
        assert result.outcome == "no_space"
        assert f"volume at {small} ran out of space" in result.message
        assert not list(small.rglob("*.incomplete"))
    finally:
        os.system(f"umount {small}")


def test_an_unreachable_hub_is_retried_then_reported(hub: FakeHub, root: Path) -> None:
    endpoint = f"http://127.0.0.1:{free_port()}"
    result, _ = run(hub, root, endpoint=endpoint)
    assert result.outcome == "unreachable" and Outcome.UNREACHABLE.exit_code == 8
    assert endpoint in result.message and "HF_ENDPOINT" in result.message


def test_a_new_revision_goes_beside_the_old_one(hub: FakeHub, root: Path) -> None:
    repo = hub.add_repo(REPO, model_files(seed=1))
    old = repo.refs["main"]
    assert run(hub, root)[0].outcome == "ready"
    new = repo.add_commit(model_files(seed=2))
    result, _ = run(hub, root)
    assert result.commit == new != old
    assert (root / "acme" / "tiny" / old / MARKER).exists() and (
        root / "acme" / "tiny" / new / MARKER
    ).exists()
    assert not (root / "acme" / "tiny" / new / WORK_DIR).exists()


def test_lfs_files_through_a_cdn_redirect_as_the_hub_sends_them(hub: FakeHub, root: Path) -> None:
    """The Hub answers an LFS file's /resolve with a 302 to another host carrying the file's
    metadata; huggingface_hub downloads from there without the token, and resumes there."""
    files = model_files(shard=BIG)
    hub.add_repo(REPO, files, gated=True, tokens={"hf_good"})
    hub.cdn_host = "localhost"
    hub.cut["model.safetensors"] = 1
    hub.corrupt["model.safetensors"] = 1
    result, _ = run(hub, root, token="hf_good")
    assert result.outcome == "ready"
    resolves = [r for r in hub.file_requests("model.safetensors") if r.status == 302]
    cdn = [r for r in hub.file_requests("model.safetensors", "GET") if r.status in (200, 206)]
    assert resolves and all(r.token == "hf_good" for r in resolves)
    # Damaged once (fetched again), cut once (resumed with a range): three GETs, no token.
    assert len(cdn) == 3 and {r.token for r in cdn} == {None}
    assert [r.range is not None for r in cdn].count(True) == 1
    assert hub.bytes_served("model.safetensors") < 3 * BIG
