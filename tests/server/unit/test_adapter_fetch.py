"""hf:// adapters: resolved with huggingface_hub against a local fake of the hub cache's file
layout (no hub is reachable here), and downloaded once per pod: concurrent workers wait on
the file lock in the cache and use the first one's files."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from sluice_server.core import adapters
from sluice_server.engine.base import AdapterLoadError

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def fake_hub_cache(root: Path, repo: str, revision: str = "main") -> Path:
    """The layout huggingface_hub writes: models--org--name/{refs/<rev>, snapshots/<commit>}."""
    folder = root / ("models--" + repo.replace("/", "--"))
    (folder / "refs").mkdir(parents=True, exist_ok=True)
    (folder / "refs" / revision).write_text(COMMIT)
    snap = folder / "snapshots" / COMMIT
    snap.mkdir(parents=True, exist_ok=True)
    (snap / "adapter_config.json").write_text('{"r": 8}')
    (snap / "adapter_model.safetensors").write_bytes(b"\0")
    return snap


@pytest.fixture
def hub(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return tmp_path / "hub"


def test_hf_uri_resolves_from_the_cache_layout(hub):
    snap = fake_hub_cache(hub, "acme/sql-lora", "v3")
    assert Path(adapters.fetch("hf://acme/sql-lora@v3")) == snap
    with pytest.raises(Exception):  # noqa: B017 - not cached and offline: huggingface_hub's error
        adapters.fetch("hf://acme/other")


def test_local_folder_used_in_place_and_a_missing_one_refused(tmp_path):
    assert adapters.fetch(str(tmp_path)) == str(tmp_path)
    with pytest.raises(AdapterLoadError, match="no adapter folder"):
        adapters.fetch(str(tmp_path / "missing"))


def test_workers_download_once_per_pod(hub, monkeypatch):
    """Four workers fetch the same adapter at once: one download, four equal answers."""
    import huggingface_hub

    downloads = []
    entered = threading.Barrier(4)

    def snapshot_download(repo, revision=None, local_files_only=False, **_):
        if local_files_only:
            snap = hub / ("models--" + repo.replace("/", "--")) / "snapshots" / COMMIT
            if not snap.exists():
                raise FileNotFoundError(repo)
            return str(snap)
        downloads.append(repo)
        time.sleep(0.3)  # a download takes a while: the other workers ask meanwhile
        return str(fake_hub_cache(hub, repo, revision or "main"))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    got: list[str] = []

    def worker() -> None:
        entered.wait()
        got.append(adapters.fetch("hf://acme/sql-lora"))

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert downloads == ["acme/sql-lora"] and len(set(got)) == 1 and len(got) == 4
    assert (hub / ".sluice-locks").is_dir()
