"""The weights cache live (`spec.model.cache.weights`, docs/weights-cache.md): a model of
three replicas on a live node agent, its weights on a Hub stand-in (testkit.fake_hub,
reached through `hubEndpoint`). The operator runs one download Job (the real program,
`python -m sluice_server.weights fetch`, in the serving image's sandbox) into the claim,
reads its result from the pod's termination message, and only then creates the Deployment;
every pod mounts the commit read-only and starts offline, without the token. A revision
change rolls the pods while streams run through the model's route, and cuts none of them;
deleting the model removes its commit from the claim. A file the Hub stand-in damages in
transit is caught by its sha256 and fetched again before any model pod exists.

Verdicts come from what the Hub stand-in recorded (bytes per file, requests and their
tokens), the objects in the API server (the Job's result in its pod's termination message,
the operator's Events, creation times), how each stream ended (traffic.py, cross-checked
with the servers' access logs) and the files on the claim's host folder."""

from __future__ import annotations

import time
from datetime import datetime

import pytest
from e2e_harness.kube import eventually
from e2e_harness.traffic import Traffic, server_outcomes, verdict
from kubernetes import client

from .conftest import TIMINGS
from .live_helpers import (
    LONG_TOKENS,
    drained_streams,
    live_pods,
    pod_ready,
    ready_model,
    routed,
    rwx_claim,
    sim_model,
)

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
    operator, models, namespace, live_nodes, ingress
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

        # A revision change: the new files beside the old, the pods roll onto them while
        # streams run through the model's route (none is cut), then the old commit is
        # removed from the claim.
        url = routed(ingress, core, namespace, "cached", 3)
        old_pods = [p.metadata.name for p in pods]
        traffic = Traffic(url, node.workdir, long=6, long_tokens=LONG_TOKENS, rate=2).start()
        try:
            traffic.wait_long_started()
            new = repo.add_commit({**FILES, "config.json": b'{"model_type": "llama", "v": 2}'},
                                  "v2")  # fmt: skip
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
            outcomes = traffic.finish()
        finally:
            traffic.process.stop()
        v = verdict(outcomes, server_outcomes(node.log_dir))
        drained = {p: drained_streams(node, namespace, p) for p in old_pods}
        TIMINGS["weights cache: revision change under load, streams cut / requests failed"] = (
            f"{v['long_cut']} of {v['long']} / {v['short_failed']} of {v['short']}")  # fmt: skip
        assert v["long"] == 6 and v["short"] > 0, v
        assert (v["long_cut"], v["short_failed"], v["not_finished_in_server_log"]) == (0, 0, 0), (
            v["failures"])  # fmt: skip
        # The rollout did cross the long streams: old pods drained them at SIGTERM.
        assert sum(n or 0 for n in drained.values()) > 0, drained
        root = node.pvc_dir(namespace, "weights") / "org" / "tiny"
        eventually(lambda: not (root / commit).exists(), timeout=120, interval=1,
                   message="the old commit removed")  # fmt: skip
        assert (root / new / ".sluice-weights.json").exists()
        names = sorted(j.metadata.name for j in batch.list_namespaced_job(namespace).items)
        assert len(names) == 3 and sum(n.startswith("sluice-weights-rm-") for n in names) == 1

        # The model deleted: it was the repository's last user on the claim, so its commit
        # goes too (a second clean-up Job, `remove --all`); the claim stays.
        models.delete(namespace, "cached")
        eventually(lambda: not (root / new).exists(), timeout=120, interval=1,
                   message="the deleted model's commit removed")  # fmt: skip
        rms = [j for j in batch.list_namespaced_job(namespace).items
               if j.metadata.name.startswith("sluice-weights-rm-")]  # fmt: skip
        assert len(rms) == 2
        assert ["--all"] in [j.spec.template.spec.containers[0].args[-1:] for j in rms]
        assert core.read_namespaced_persistent_volume_claim("weights", namespace)


def _time(stamp) -> float:
    if isinstance(stamp, datetime):
        return stamp.timestamp()
    return datetime.fromisoformat(str(stamp).replace("Z", "+00:00")).timestamp()


def test_a_file_damaged_in_transit_is_fetched_again_before_any_pod_starts(
    operator, models, namespace, live_nodes
):
    """The Hub stand-in flips a byte of the shard the first time it is served (same size:
    only the sha256 tells). The download Job catches it, fetches the file again and ends
    ready; the model's first pod is created only after WeightsReady, from files that match.
    (tests/weights: without the hash check the damaged file would be marked ready.)"""
    core, batch = models.core, client.BatchV1Api(models.core.api_client)
    (node,), placement = live_nodes(1)
    rwx_claim(core, namespace, "weights")
    with fake_hub.FakeHub() as hub:
        commit = hub.add_repo("org/tiny", FILES).refs["main"]
        hub.corrupt["model.safetensors"] = 1
        body = sim_model(namespace, "damaged", placement, replicas=1)
        body["spec"].pop("ingress", None)
        body["spec"]["model"] = {
            "uri": "hf://org/tiny@main",
            "cache": {"weights": {"claimName": "weights", "hubEndpoint": hub.url}},
        }
        models.create(body)
        st = ready_model(models, namespace, "damaged", timeout=240)
        assert st["weights"]["commit"] == commit
        # The shard went out twice (the first copy damaged), every other file once.
        gets = hub.file_requests("model.safetensors", "GET")
        assert len(gets) == 2 and hub.corrupt["model.safetensors"] == 0
        assert hub.bytes_served("model.safetensors") == 2 * len(FILES["model.safetensors"])
        for path in set(FILES) - {"model.safetensors"}:
            assert len(hub.file_requests(path, "GET")) == 1, path
        # The Job says so in its result (its pod's termination message) ...
        (job,) = batch.list_namespaced_job(namespace).items
        (pod,) = core.list_namespaced_pod(
            namespace, label_selector=f"job-name={job.metadata.name}"
        ).items
        term = pod.status.container_statuses[0].state.terminated
        assert term.exit_code == 0 and '"outcome":"ready"' in term.message
        assert "downloaded again after a check failed: model.safetensors (arrived damaged: sha256" in (
            term.message)  # fmt: skip
        # ... and the operator's WeightsReady Event carries it.
        events = core.list_namespaced_event(
            namespace, field_selector="involvedObject.name=damaged"
        ).items
        (ready,) = [e for e in events if e.reason == "WeightsReady"]
        assert "model.safetensors (arrived damaged: sha256" in ready.message
        # The files on the claim match the Hub's.
        folder = node.pvc_dir(namespace, "weights") / "org" / "tiny" / commit
        for path, data in FILES.items():
            assert (folder / path).read_bytes() == data, path
        # No model pod, nor its Deployment, existed before WeightsReady.
        cond = {c["type"]: c for c in st["conditions"]}["WeightsReady"]
        ready_at = _time(cond["lastTransitionTime"])
        dep = client.AppsV1Api(core.api_client).read_namespaced_deployment("damaged", namespace)
        assert _time(dep.metadata.creation_timestamp) >= ready_at
        pods = models.pods(namespace, "damaged")
        assert pods and all(_time(p.metadata.creation_timestamp) >= ready_at for p in pods)
        assert _time(pod.metadata.creation_timestamp) <= ready_at  # the Job's pod came first
