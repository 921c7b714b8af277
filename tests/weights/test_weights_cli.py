"""`python -m sluice_server.weights` as the Job runs it: HF_ENDPOINT, the token file, the
progress endpoint, the result file and the exit codes; `remove`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest
from sluice_server.weights.__main__ import main
from sluice_server.weights.layout import MARKER
from testkit.fake_hub import FakeHub
from testkit.net import free_port
from testkit.process import ManagedProcess
from testkit.wait import eventually

from .weights_helpers import BIG, REPO, model_files, run

TOKEN = "hf_secret_token_value"


def _argv(hub_root: Path, result: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "sluice_server.weights", "fetch", "--repo", REPO,
            "--revision", "main", "--root", str(hub_root), "--result-file", str(result), *extra]  # fmt: skip


def _env(hub: FakeHub) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    # The environment's token is never used: only --token-file's.
    return {**env, "HF_ENDPOINT": hub.url, "HF_TOKEN": "hf_from_the_environment"}


def _progress(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/progress", timeout=5) as r:
        return json.loads(r.read())


def test_the_job_fetches_through_hf_endpoint_with_the_token_file(
    hub: FakeHub, tmp_path: Path
) -> None:
    files = model_files(shard=BIG)
    commit = hub.add_repo(REPO, files, gated=True, tokens={TOKEN}).refs["main"]
    (tmp_path / "token").write_text(TOKEN + "\n")
    result_file, port = tmp_path / "result.json", free_port()
    held = hub.hold["model.safetensors"] = threading.Event()
    argv = _argv(tmp_path / "weights", result_file, "--token-file", str(tmp_path / "token"),
                 "--progress-port", str(port))  # fmt: skip
    proc = ManagedProcess("weights-fetch", argv, tmp_path, env=_env(hub)).start()
    try:
        # Mid-file: the bytes of the shard received so far count (one 10 MiB chunk at least).
        seen = eventually(lambda: (p := _progress(port))["bytes_done"] >= 10 * 1024 * 1024 and p,
                          timeout=30, message=lambda: proc.tail(), retry_on=(OSError,))  # fmt: skip
        assert seen["phase"] == "downloading" and seen["commit"] == commit
        assert seen["files_total"] == 3 and seen["bytes_total"] == sum(map(len, files.values()))
        assert seen["bytes_done"] < seen["bytes_total"]
        held.set()
        assert proc.started().wait(timeout=60) == 0, proc.tail()
    finally:
        held.set()
        proc.stop()
    result = json.loads(result_file.read_text())
    assert result == {"outcome": "ready", "repo": REPO, "revision": "main", "commit": commit,
                      "files": 3, "bytes": seen["bytes_total"], "message": result["message"]}  # fmt: skip
    assert (tmp_path / "weights" / "acme" / "tiny" / commit / MARKER).exists()
    # Every request for the repository carried the file's token (huggingface_hub also asks
    # the endpoint, token-less, for its agent-harness list: not the repository's).
    repo_requests = [r for r in hub.requests if r.revision or r.path.startswith("/api/models/")]
    assert len(repo_requests) == 7 and {r.token for r in repo_requests} == {TOKEN}
    assert all(r.status < 400 for r in hub.requests)
    log = proc.log_path.read_text()
    assert TOKEN not in log and "hf_from_the_environment" not in log
    assert log.count("] fetched ") == 3 and "ready in" in log
    assert log.strip().splitlines()[-1] == result_file.read_text()  # the result, last on stdout


@pytest.mark.parametrize(
    ("setup", "outcome", "code"),
    [({"gated": True}, "gated", 4), ({"private": True}, "unauthorized", 3)],
)
def test_the_exit_code_is_the_outcome_s(hub: FakeHub, tmp_path: Path, setup: dict, outcome: str,
                                        code: int) -> None:  # fmt: skip
    hub.add_repo(REPO, model_files(), **setup)
    result_file = tmp_path / "result.json"
    done = subprocess.run(_argv(tmp_path / "weights", result_file), env=_env(hub), timeout=60,
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == code, done.stderr
    assert json.loads(result_file.read_text())["outcome"] == outcome


def test_an_unreadable_token_file_is_an_error_that_names_it(tmp_path: Path) -> None:
    result_file = tmp_path / "result.json"
    code = main(["fetch", "--repo", REPO, "--revision", "main", "--root", str(tmp_path),
                 "--token-file", str(tmp_path / "nope"), "--result-file", str(result_file)])  # fmt: skip
    result = json.loads(result_file.read_text())
    assert (code, result["outcome"]) == (1, "error")
    assert f"the token file {tmp_path / 'nope'} cannot be read" in result["message"]


def test_remove_keeps_the_listed_commits_only(hub: FakeHub, tmp_path: Path) -> None:
    root = tmp_path / "weights"
    repo = hub.add_repo(REPO, model_files(seed=1))
    first = repo.refs["main"]
    run(hub, root)
    second = repo.add_commit(model_files(seed=2))
    run(hub, root)
    third = repo.add_commit(model_files(seed=3))
    run(hub, root)
    other = hub.add_repo("acme/other", model_files()).refs["main"]
    run(hub, root, repo="acme/other")
    (root / "acme" / "tiny" / "notes.txt").write_text("not a commit")
    result_file = tmp_path / "result.json"
    code = main(["remove", "--root", str(root), "--repo", REPO, "--keep", f"{second},{third}",
                 "--result-file", str(result_file)])  # fmt: skip
    assert code == 0
    doc = json.loads(result_file.read_text())
    assert (doc["outcome"], doc["removed"], doc["kept"]) == ("removed", [first], [second, third])
    assert doc["bytes"] > 0
    left = sorted(p.name for p in (root / "acme" / "tiny").iterdir())
    assert left == sorted([second, third, "notes.txt"])
    assert (root / "acme" / "other" / other / MARKER).exists()
    # --all (the repository's last model deleted): every commit folder of the repository,
    # nothing else, nothing of another repository.
    code = main(["remove", "--root", str(root), "--repo", REPO, "--all",
                 "--result-file", str(result_file)])  # fmt: skip
    doc = json.loads(result_file.read_text())
    assert (code, doc["removed"], doc["kept"]) == (0, sorted([second, third]), [])
    assert [p.name for p in (root / "acme" / "tiny").iterdir()] == ["notes.txt"]
    assert (root / "acme" / "other" / other / MARKER).exists()


def test_remove_skips_a_commit_a_download_is_writing(hub: FakeHub, tmp_path: Path) -> None:
    """A folder whose writer lock a download holds (a model the operator's clean-up did not
    know of yet) is left; once the lock is free, the same command removes it (the control)."""
    import filelock
    from sluice_server.weights.layout import lock_path

    root = tmp_path / "weights"
    repo = hub.add_repo(REPO, model_files(seed=1))
    done = repo.refs["main"]
    run(hub, root)
    writing = root / "acme" / "tiny" / ("c" * 40)
    lock_path(writing).parent.mkdir(parents=True)
    (writing / "model.safetensors").write_bytes(b"half")
    result_file = tmp_path / "result.json"
    argv = ["remove", "--root", str(root), "--repo", REPO, "--all", "--result-file",
            str(result_file)]  # fmt: skip
    with filelock.FileLock(lock_path(writing)):
        assert main(argv) == 0
    doc = json.loads(result_file.read_text())
    assert (doc["removed"], doc["skipped"]) == ([done], ["c" * 40])
    assert (writing / "model.safetensors").exists()
    assert main(argv) == 0
    doc = json.loads(result_file.read_text())
    assert (doc["removed"], doc["skipped"]) == (["c" * 40], []) and not writing.exists()


def test_remove_refuses_what_resolves_outside_the_root(tmp_path: Path) -> None:
    root, outside = tmp_path / "weights", tmp_path / "outside"
    (outside / ("a" * 40)).mkdir(parents=True)
    (outside / ("a" * 40) / "precious").write_text("keep me")
    (root / "acme").mkdir(parents=True)
    (root / "acme" / "tiny").symlink_to(outside)
    result_file = tmp_path / "result.json"
    code = main(["remove", "--root", str(root), "--repo", REPO, "--keep", "b" * 40,
                 "--result-file", str(result_file)])  # fmt: skip
    assert code == 2 and json.loads(result_file.read_text())["outcome"] == "refused"
    assert (outside / ("a" * 40) / "precious").exists()
    # A commit folder that is a symlink out of the root is refused too.
    (root / "acme" / "tiny").unlink()
    (root / "acme" / "tiny").mkdir()
    (root / "acme" / "tiny" / ("c" * 40)).symlink_to(outside / ("a" * 40))
    assert main(["remove", "--root", str(root), "--repo", REPO, "--keep", "b" * 40,
                 "--result-file", str(result_file)]) == 2  # fmt: skip
    assert (outside / ("a" * 40) / "precious").exists()
    for bad in (["--repo", "../etc", "--keep", "b" * 40], ["--repo", REPO, "--keep", "main"],
                ["--repo", REPO, "--keep", ","]):  # fmt: skip
        assert main(["remove", "--root", str(root), *bad, "--result-file", str(result_file)]) == 2
    for bad in ([], ["--keep", "b" * 40, "--all"]):  # neither, or both: argparse refuses
        with pytest.raises(SystemExit) as exc:
            main(["remove", "--root", str(root), "--repo", REPO, *bad])
        assert exc.value.code == 2


def test_a_job_killed_mid_file_is_finished_by_the_next_without_refetching(hub: FakeHub,
                                                                          tmp_path: Path) -> None:  # fmt: skip
    """SIGKILL while the shard is half received (a pod evicted): the next run keeps the file
    the killed one finished and checked, deletes the killed one's temporary file, and
    fetches the rest."""
    files = model_files(shard=BIG)
    commit = hub.add_repo(REPO, files).refs["main"]
    root, result_file = tmp_path / "weights", tmp_path / "result.json"
    held = hub.hold["model.safetensors"] = threading.Event()
    proc = ManagedProcess(
        "weights-fetch", _argv(root, result_file), tmp_path, env=_env(hub)
    ).start()
    try:
        folder = root / "acme" / "tiny" / commit
        eventually(
            lambda: hub.file_requests("model.safetensors", "GET"),
            timeout=30,
            message=lambda: proc.tail(),
        )
        os.kill(proc.started().pid, signal.SIGKILL)
        proc.started().wait(timeout=30)
    finally:
        held.set()
        proc.stop()
    assert not (folder / MARKER).exists() and list(folder.rglob("*.incomplete"))
    del hub.hold["model.safetensors"]
    result, _ = run(hub, root)
    assert result.outcome == "ready"
    assert [len(hub.file_requests(p, "GET")) for p in sorted(files)] == [1, 2, 1]
    assert not (folder / ".cache").exists() and not list(folder.rglob("*.incomplete"))
