"""The weights cache live (`spec.model.cache.weights`, docs/weights-cache.md): a model of
three replicas on a live node agent, its weights on a Hub stand-in (testkit.fake_hub,
reached through `hubEndpoint`). The operator runs one download Job (the real program,
`python -m sluice_server.weights fetch`, in the serving image's sandbox) into the claim,
reads its result from the pod's termination message, and only then creates the Deployment;
every pod mounts the commit read-only and starts offline, without the token.

Verdicts come from what the Hub stand-in recorded (bytes per file, requests and their
tokens), the objects in the API server and the files on the claim's host folder."""

from __future__ import annotations

import time

import pytest
from e2e_harness.kube import eventually
from kubernetes import client

from .conftest import TIMINGS
from .live_helpers import live_pods, pod_ready, ready_model, rwx_claim, sim_model

fake_hub = pytest.importorskip("testkit.fake_hub", reason="the Hub stand-in")
pytest.importorskip("sluice_server.weights", reason="the download program")

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("footprint")]

TOKEN = "hf_e2e_token"
FILES = {
    "config.json": b'{"model_type": "llama", "hidden_size": 64}',
    "tokenizer.json": b'{"version": "1.0"}' * 200,
    "model.safetensors": bytes(range(256)) * 8192,  # 2 MiB, stored with LFS
}


def test_three_replicas_start_from_one_download_offline_and_without_the_token(
    operator, models, namespace, live_nodes
):
    core, batch = models.core, client.BatchV1Api(models.core.api_client)
    (node,), placement = live_nodes(1)
    core.create_namespaced_secret(namespace, {"metadata": {"name": "hf"},
                                              "stringData": {"token": TOKEN}})  # fmt: skip
    rwx_claim(core, namespace, "weights")
    with fake_hub.FakeHub() as hub:
        repo = hub.add_repo("org/tiny", FILES, gated=True, tokens={TOKEN})
        commit = repo.refs["main"]
        body = sim_model(namespace, "cached", placement, replicas=3)
        body["spec"].pop("ingress", None)
        body["spec"]["model"] = {
            "uri": "hf://org/tiny@main",
            "hfTokenSecretRef": {"name": "hf"},
            "cache": {"weights": {"claimName": "weights", "hubEndpoint": hub.url}},
        }
        began = time.monotonic()
        models.create(body)

        def weights_ready():
            st = models.get(namespace, "cached").get("status") or {}
            cond = {c["type"]: c for c in st.get("conditions") or []}.get("WeightsReady", {})
            return cond.get("status") == "True" and st

        st = eventually(weights_ready, timeout=180, interval=0.5, message="WeightsReady")
        served_at_ready = len(hub.requests)
        w = st["weights"]
        assert (w["commit"], w["revision"], w["files"]) == (commit, "main", len(FILES))
        assert w["bytes"] == sum(len(b) for b in FILES.values())
        downloaded = time.monotonic() - began
        st = ready_model(models, namespace, "cached", timeout=180)
        TIMINGS["weights cache: apply -> WeightsReady, -> 3 replicas Ready (s)"] = (
            f"{downloaded:.1f}, {time.monotonic() - began:.1f}"
        )

        # One download: one Job, each file's bytes served once, with the token.
        jobs = batch.list_namespaced_job(namespace).items
        assert [j.metadata.name for j in jobs] == [w["job"]]
        for path, data in FILES.items():
            assert hub.bytes_served(path) == len(data), path
        # The token went with the download's calls (a redirect may drop it, as
        # huggingface_hub does), and nothing was refused.
        # (huggingface_hub also lists /api/agent-harnesses, without a token.)
        calls = [r for r in hub.requests if r.path != "/api/agent-harnesses"]
        odd = [(r.method, r.path, r.status, r.token) for r in calls
               if r.token != TOKEN or r.status >= 400]  # fmt: skip
        assert calls and not odd, odd
        # The files on the claim, complete (the marker is written last).
        folder = node.pvc_dir(namespace, "weights") / "org" / "tiny" / commit
        assert {p.name for p in folder.iterdir()} >= {*FILES, ".sluice-weights.json"}

        # Every pod: the commit read-only, the Hub off, no token anywhere in its spec.
        pods = live_pods(models, namespace, "cached")
        assert len(pods) == 3 and all(pod_ready(p) for p in pods)
        for pod in pods:
            spec = client.ApiClient().sanitize_for_serialization(pod.spec)
            (c,) = spec["containers"]
            env = {e["name"]: e.get("value") for e in c["env"]}
            assert env["HF_HUB_OFFLINE"] == "1"
            assert not {"HF_TOKEN", "HF_TOKEN_PATH", "HUGGING_FACE_HUB_TOKEN"} & env.keys()
            assert not any("secret" in v for v in spec["volumes"])
            mount = [m for m in c["volumeMounts"] if m["name"] == "weights"]
            assert mount == [{"name": "weights", "mountPath": "/mnt/weights", "readOnly": True,
                              "subPath": f"org/tiny/{commit}"}]  # fmt: skip
            assert c["args"][:2] == ["--model", "/mnt/weights"]
        # No model pod asked the Hub anything.
        assert len(hub.requests) == served_at_ready

        # A revision change: the new files beside the old, the pods roll onto them, then
        # the old commit is removed from the claim.
        new = repo.add_commit({**FILES, "config.json": b'{"model_type": "llama", "v": 2}'}, "v2")
        models.patch(namespace, "cached", {"spec": {"model": {"uri": "hf://org/tiny@v2"}}})

        def rolled():
            st = models.get(namespace, "cached").get("status") or {}
            pods = live_pods(models, namespace, "cached")
            subpaths = {
                m.sub_path for p in pods for m in p.spec.containers[0].volume_mounts
                if m.name == "weights"
            }  # fmt: skip
            return (
                (st.get("weights") or {}).get("commit") == new
                and subpaths == {f"org/tiny/{new}"}
                and len(pods) == 3
                and all(pod_ready(p) for p in pods)
            )

        eventually(rolled, timeout=240, interval=1, message="the pods on the new commit")
        root = node.pvc_dir(namespace, "weights") / "org" / "tiny"
        eventually(lambda: not (root / commit).exists(), timeout=120, interval=1,
                   message="the old commit removed")  # fmt: skip
        assert (root / new / ".sluice-weights.json").exists()
        names = sorted(j.metadata.name for j in batch.list_namespaced_job(namespace).items)
        assert len(names) == 3 and sum(n.startswith("sluice-weights-rm-") for n in names) == 1
