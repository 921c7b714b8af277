"""The weights cache (`spec.model.cache.weights`, docs/weights-cache.md): what is rendered
(the claim, the shared download Job, the clean-up Job, the pods without the Hub or the
token), the rules, how the Job's result and progress become WeightsReady and
status.weights, sharing one Job between models, a revision change and the clean-up."""

from __future__ import annotations

import copy
import json
import logging

import kopf
import pytest
from operator_helpers import SAMPLES, Events, FakeCluster, body_of, load, validate_manifest
from sluice_operator import handlers, passes
from sluice_operator.builders.deployment import desired_deployment
from sluice_operator.builders.hpa import desired_hpa
from sluice_operator.builders.keda import desired_scaled_object
from sluice_operator.builders.weights import (
    PROGRESS_PORT,
    desired_fetch_job,
    desired_remove_job,
    desired_weights_claim,
    fetch_job_name,
)
from sluice_operator.reconcile import converge
from sluice_operator.render import offline_weights
from sluice_operator.validation import SpecError, load_model
from sluice_operator.weightsstate import WEIGHTS_RECHECK_SECONDS, JobView, weights_verdict
from testkit.k8s import K8S_VERSIONS

NOW = "2026-01-01T00:00:00Z"
A = "a" * 40
B = "b" * 40
TOKEN_NAMES = {"HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_TOKEN_PATH"}


def cached(name="m", revision=None, claim="weights", **weights):
    uri = "hf://org/model" + (f"@{revision}" if revision else "")
    spec = {
        "model": {
            "uri": uri,
            "hfTokenSecretRef": {"name": "hf"},
            "cache": {"weights": {"claimName": claim, **weights}},
        }
    }
    return body_of({"metadata": {"name": name, "namespace": "default"}, "spec": spec})


def model_of(body, commit=None):
    import dataclasses

    return dataclasses.replace(load_model(body), weights_commit=commit)


def server(deployment):
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


# --- rendering -------------------------------------------------------------------------


def test_pods_mount_the_commit_read_only_start_offline_and_never_see_the_token():
    body = cached(revision="v1")
    body["spec"]["engine"] = {"env": [{"name": "HF_TOKEN", "value": "hf_x"},
                                      {"name": "HF_HUB_OFFLINE", "value": "0"}]}  # fmt: skip
    dep = desired_deployment(model_of(body, A))
    validate_manifest(dep, K8S_VERSIONS[-1])
    c, pod = server(dep), dep["spec"]["template"]["spec"]
    assert c["args"][:2] == ["--model", "/mnt/weights"] and "--revision" not in c["args"]
    assert c["args"][c["args"].index("--served-model-name") + 1] == "org/model"
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["HF_HUB_OFFLINE"] == "1" and not TOKEN_NAMES & env.keys()
    assert {"name": "weights", "mountPath": "/mnt/weights", "readOnly": True,
            "subPath": f"org/model/{A}"} in c["volumeMounts"]  # fmt: skip
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["weights"]["persistentVolumeClaim"] == {"claimName": "weights", "readOnly": True}
    assert "emptyDir" in volumes["cache"]  # what the pods write stays writable
    assert not any("secret" in v for v in pod["volumes"])
    # Negative control: the same model without the cache mounts the token and downloads.
    plain = copy.deepcopy(body)
    del plain["spec"]["model"]["cache"]
    c = server(desired_deployment(load_model(plain)))
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["HF_TOKEN_PATH"] and c["args"][:4] == ["--model", "org/model", "--revision", "v1"]


def test_no_pods_and_nothing_to_scale_them_before_a_commit_is_ready():
    body = cached()
    body["spec"]["autoscaling"] = {"enabled": True, "minReplicas": 1, "maxReplicas": 3}
    keda = copy.deepcopy(body)
    keda["spec"]["autoscaling"]["backend"] = "keda"
    for build in (desired_deployment, desired_hpa):
        assert build(model_of(body, None)) is None
        assert build(model_of(body, A)) is not None
    assert desired_scaled_object(model_of(keda, None)) is None
    assert desired_scaled_object(model_of(keda, A)) is not None


def test_the_download_job_gets_the_token_as_a_file_and_the_mirror():
    body = cached(revision="v1", hubEndpoint="http://hub-mirror.internal:8080")
    job = desired_fetch_job(load_model(body))
    validate_manifest(job, K8S_VERSIONS[-1])
    pod = job["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["command"] == ["python", "-m", "sluice_server.weights"]
    assert c["args"] == ["fetch", "--repo", "org/model", "--revision", "v1", "--root", "/weights",
                         "--token-file", "/etc/sluice/hf-token/token",
                         "--progress-port", str(PROGRESS_PORT),
                         "--result-file", "/dev/termination-log"]  # fmt: skip
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["HF_ENDPOINT"] == "http://hub-mirror.internal:8080"
    assert not TOKEN_NAMES & env.keys() and not any("valueFrom" in e for e in c["env"])
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["hf-token"]["secret"]["secretName"] == "hf"
    assert volumes["weights"]["persistentVolumeClaim"] == {"claimName": "weights"}
    assert c["terminationMessagePolicy"] == "File" and pod["restartPolicy"] == "Never"
    assert job["spec"]["backoffLimit"] == 2 and job["spec"]["ttlSecondsAfterFinished"] > 0
    assert "ownerReferences" not in job["metadata"]  # shared: no one model owns it
    # Without a token Secret nor a mirror: neither.
    bare = cached()
    del bare["spec"]["model"]["hfTokenSecretRef"]
    c = desired_fetch_job(load_model(bare))["spec"]["template"]["spec"]["containers"][0]
    assert "--token-file" not in c["args"] and "--revision" in c["args"]
    assert c["args"][c["args"].index("--revision") + 1] == "main"
    assert "HF_ENDPOINT" not in {e["name"] for e in c["env"]}


def test_the_claim_is_created_only_when_asked_and_the_cleanup_job_keeps_what_is_served():
    assert desired_weights_claim(load_model(cached())) is None
    body = cached(create={"size": "200Gi", "storageClassName": "nfs"})
    pvc = desired_weights_claim(load_model(body))
    validate_manifest(pvc, K8S_VERSIONS[-1])
    assert pvc["spec"] == {"accessModes": ["ReadWriteMany"], "storageClassName": "nfs",
                           "resources": {"requests": {"storage": "200Gi"}}}  # fmt: skip
    rm = desired_remove_job(load_model(body), [B, A])
    validate_manifest(rm, K8S_VERSIONS[-1])
    args = rm["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args == ["remove", "--root", "/weights", "--repo", "org/model", "--keep", f"{A},{B}"]
    assert not any("secret" in v for v in rm["spec"]["template"]["spec"]["volumes"])


def test_models_wanting_the_same_files_name_the_same_job():
    a = load_model(cached("a", revision="v1"))
    b = load_model(cached("b", revision="v1"))
    assert fetch_job_name(a) == fetch_job_name(b)
    others = [cached("c", revision="v2"), cached("d", revision="v1", claim="other")]
    refreshed = cached("e", revision="v1")
    refreshed["metadata"]["annotations"] = {"serving.sluice.dev/weights-refresh": "1"}
    assert fetch_job_name(a) not in {fetch_job_name(load_model(o)) for o in [*others, refreshed]}


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.stem)
def test_no_sample_with_the_cache_gives_its_pods_a_token(path):
    body = load(path)
    if not body["spec"]["model"].get("cache", {}).get("weights"):
        return
    dep = desired_deployment(offline_weights(load_model(body), body))
    text = json.dumps(dep)
    secret = body["spec"]["model"].get("hfTokenSecretRef", {}).get("name")
    assert secret is None or f'"{secret}"' not in text
    assert not any(name in text for name in TOKEN_NAMES)
    assert '"HF_HUB_OFFLINE", "value": "1"' in text


# --- rules ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "extra", "says"),
    [
        ({"uri": "hf://gpt2"}, {}, "needs model.uri hf://org/name"),
        ({"uri": "/models/llama"}, {}, "needs model.uri hf://org/name"),
        ({"uri": "hf://org/m"}, {"adapters": [{"name": "a", "uri": "hf://org/a"}]},
         "an hf:// adapter cannot be downloaded"),
        ({"uri": "hf://org/m"}, {"resources": {"gpus": 8},
                                 "parallelism": {"tensor": 8, "pipeline": 2, "nodes": 2}},
         "not supported with parallelism.nodes above 1"),
    ],
)  # fmt: skip
def test_bad_combinations_are_refused_with_a_clear_message(model, extra, says):
    spec = {"model": {**model, "cache": {"weights": {"claimName": "w"}}}, **extra}
    with pytest.raises(SpecError) as exc:
        load_model({"metadata": {"name": "m"}, "spec": spec})
    assert says in str(exc.value)
    # Negative control: without the cache each is accepted.
    del spec["model"]["cache"]
    load_model({"metadata": {"name": "m"}, "spec": spec})


def test_a_hub_mirror_must_be_a_url_and_pvc_adapters_are_fine():
    with pytest.raises(SpecError, match="hubEndpoint must be an http"):
        load_model(cached(hubEndpoint="hub.internal"))
    body = cached()
    body["spec"]["adapters"] = [{"name": "a", "uri": "pvc://adapters/a"}]
    load_model(body)


# --- status from the Job ----------------------------------------------------------------


def job(*conditions):
    return {"metadata": {"name": "j"},
            "status": {"conditions": [{"type": c, "status": "True"} for c in conditions]}}  # fmt: skip


def job_pod(result=None, phase="Succeeded", created="2026-01-01T00:00:00Z", waiting=None):
    status: dict = {"phase": phase, "podIP": "10.0.0.7"}
    if result is not None:
        message = result if isinstance(result, str) else json.dumps(result)
        status["containerStatuses"] = [
            {"state": {"terminated": {"exitCode": 0, "message": message}}}
        ]
    if waiting:
        status["conditions"] = [{"type": "PodScheduled", "status": "False", "message": waiting}]
    return {"metadata": {"name": "p", "creationTimestamp": created}, "status": status}


READY = {"outcome": "ready", "repo": "org/model", "revision": "v1", "commit": A, "files": 12,
         "bytes": 3 << 30, "message": "ok"}  # fmt: skip


def test_a_completed_job_makes_the_commit_ready_with_an_event():
    m = load_model(cached(revision="v1"))
    v = weights_verdict(m, {}, JobView(job("Complete"), [job_pod(READY)]), NOW)
    assert v.commit == A and v.condition["status"] == "True" and not v.settling
    assert v.record == {"claimName": "weights", "repo": "org/model", "revision": "v1",
                        "commit": A, "resolvedAt": NOW, "files": 12, "bytes": 3 << 30,
                        "job": fetch_job_name(m)}  # fmt: skip
    assert [(t, r) for t, r, _ in v.events] == [("Normal", "WeightsReady")]
    assert "12 files, 3.0 GiB" in v.condition["message"]
    # Recorded: the next pass reads nothing and says Ready again, with no new Event.
    again = weights_verdict(m, {"weights": v.record}, None, NOW)
    assert again.commit == A and again.condition["status"] == "True" and not again.events
    assert "downloaded again" not in v.events[0][2]


def test_the_ready_event_names_the_files_the_job_downloaded_again():
    m = load_model(cached(revision="v1"))
    redone = "downloaded again after a check failed: model.safetensors (arrived damaged: x)"
    result = {**READY, "message": f"org/model@v1 (commit {A}) is ready: ...; {redone}"}
    v = weights_verdict(m, {}, JobView(job("Complete"), [job_pod(result)]), NOW)
    assert v.events[0][2].endswith(f"on claim weights; {redone}")
    assert "downloaded again" not in v.condition["message"]


@pytest.mark.parametrize(
    ("outcome", "reason", "fix"),
    [
        ("gated", "Gated", "hfTokenSecretRef"),
        ("unauthorized", "Unauthorized", "valid token"),
        ("not_found", "RevisionNotFound", "spec.model.uri"),
        ("no_space", "NoSpace", "grow the claim"),
        ("corrupt", "Corrupt", "mirror"),
        ("unreachable", "HubUnreachable", "hubEndpoint"),
        ("error", "DownloadFailed", "weights-refresh"),
    ],
)
def test_a_failed_job_says_why_and_how_to_retry_once(outcome, reason, fix):
    m = load_model(cached(revision="v1"))
    result = {"outcome": outcome, "message": "the program's words"}
    v = weights_verdict(m, {}, JobView(job("Failed"), [job_pod(result, "Failed")]), NOW)
    c = v.condition
    assert (c["status"], c["reason"]) == ("False", reason) and v.failed and not v.settling
    assert "the program's words" in c["message"] and fix in c["message"]
    assert "serving.sluice.dev/weights-refresh" in c["message"]
    assert [r for _, r, _ in v.events] == [reason]
    # The same failure on the next pass: no second Event.
    v2 = weights_verdict(m, {"conditions": [c]}, JobView(job("Failed"), [job_pod(result)]), NOW)
    assert v2.events == []


def test_a_running_download_reports_files_and_bytes_and_asks_to_look_again():
    m = load_model(cached(revision="v1"))
    progress = {"phase": "downloading", "commit": A, "files_done": 3, "files_total": 12,
                "bytes_done": 1 << 30, "bytes_total": 4 << 30}  # fmt: skip
    v = weights_verdict(m, {}, JobView(job(), [job_pod(phase="Running")], progress), NOW)
    assert v.condition["reason"] == "Downloading" and v.settling and v.commit is None
    assert "3/12 files, 1.0 GiB of 4.0 GiB" in v.condition["message"]
    # Not yet answering: Resolving; an unschedulable pod (no RWX volume) says why.
    v = weights_verdict(m, {}, JobView(job(), [job_pod(phase="Running")]), NOW)
    assert v.condition["reason"] == "Resolving"
    stuck = job_pod(phase="Pending", waiting="0/3 nodes: pod has unbound PVC")
    v = weights_verdict(m, {}, JobView(job(), [stuck]), NOW)
    assert "cannot be scheduled: 0/3 nodes: pod has unbound PVC" in v.condition["message"]
    # A pod that failed while the Job retries: its result, and the attempt.
    failed = job_pod({"outcome": "unreachable", "message": "timed out"}, "Failed")
    v = weights_verdict(m, {}, JobView(job(), [failed]), NOW)
    assert "attempt 1 of 3" in v.condition["message"] and "timed out" in v.condition["message"]
    # A container that wrote no JSON: its message stands as an error.
    v = weights_verdict(m, {}, JobView(job("Failed"), [job_pod("Killed", "Failed")]), NOW)
    assert v.condition["reason"] == "DownloadFailed" and "Killed" in v.condition["message"]


def test_a_completed_job_whose_result_is_gone_runs_again():
    m = load_model(cached(revision="v1"))
    v = weights_verdict(m, {}, JobView(job("Complete"), []), NOW)
    assert v.delete_job and v.commit is None and v.condition["reason"] == "ResultLost"


# --- passes: sharing, revision change, clean-up ----------------------------------------


class JobCluster(FakeCluster):
    """The fake API server with Jobs whose pods are listed by `job-name`."""

    def __init__(self) -> None:
        super().__init__()
        self.job_pods: dict[str, list[dict]] = {}

    def list_pods(self, namespace, selector):
        if selector.startswith("job-name="):
            self.calls.append(("list", "Pod"))
            return copy.deepcopy(self.job_pods.get(selector.removeprefix("job-name="), []))
        return super().list_pods(namespace, selector)

    def finish(self, name, result, ok=True):
        self.objects[("Job", "default", name)]["status"] = {
            "conditions": [{"type": "Complete" if ok else "Failed", "status": "True"}]
        }
        self.job_pods[name] = [job_pod(result, "Succeeded" if ok else "Failed")]

    def jobs(self):
        return sorted(n for (k, _, n) in self.objects if k == "Job")


def run(cluster, body, events=None, **kw):
    cluster.store(body)
    out = converge(cluster, body, events if events is not None else Events(), now=NOW, **kw)
    stored = cluster.objects[("StreamingModel", "default", body["metadata"]["name"])]
    return out, {**body, "status": copy.deepcopy(stored.get("status") or {})}


def test_two_models_share_one_download_and_start_pods_only_when_it_is_ready():
    cluster = JobCluster()
    cluster.objects[("PersistentVolumeClaim", "default", "weights")] = {"metadata": {}}
    a, b = cached("a", revision="v1"), cached("b", revision="v1")
    out, a = run(cluster, a)
    assert out.weights_settling and cluster.jobs() == [fetch_job_name(load_model(a))]
    assert ("Deployment", "default", "a") not in cluster.objects
    assert a["status"]["phase"] == "Pending"
    ready = {c["type"]: c for c in a["status"]["conditions"]}
    assert ready["WeightsReady"]["reason"] == "Resolving"
    assert ready["Ready"]["reason"] == "WeightsNotReady"
    _, b = run(cluster, b)
    assert cluster.calls.count(("apply", "Job")) == 1  # b found a's Job
    cluster.finish(cluster.jobs()[0], {**READY, "revision": "v1"})
    for body in (a, b):
        events = Events()
        out, body = run(cluster, body, events)
        assert body["status"]["weights"]["commit"] == A and not out.weights_settling
        assert ("Normal", "WeightsReady") in [(t, r) for t, r, _ in events]
        name = body["metadata"]["name"]
        dep = cluster.objects[("Deployment", "default", name)]
        assert server(dep)["volumeMounts"][-1]["subPath"] == f"org/model/{A}"
    assert cluster.calls.count(("apply", "Job")) == 1


def test_the_claim_is_created_when_absent_and_its_absence_is_reported_otherwise():
    cluster = JobCluster()
    _, body = run(cluster, cached(create={"size": "10Gi"}))
    assert cluster.objects[("PersistentVolumeClaim", "default", "weights")]
    cluster = JobCluster()
    out, body = run(cluster, cached())
    cond = {c["type"]: c for c in body["status"]["conditions"]}["WeightsReady"]
    assert cond["reason"] == "ClaimMissing" and "does not exist" in cond["message"]
    assert cluster.jobs() == [] and out.weights_settling


def _ready_on(cluster, body, commit):
    """Run `body` until its commit is ready and its Deployment settled."""
    _, body = run(cluster, body)
    name = fetch_job_name(load_model(body))
    if ("Job", "default", name) in cluster.objects:
        revision = load_model(body).source.revision
        cluster.finish(name, {**READY, "revision": revision, "commit": commit})
    _, body = run(cluster, body)
    cluster.set_deployment_status("default", body["metadata"]["name"], replicas=1,
                                  readyReplicas=1, updatedReplicas=1)  # fmt: skip
    return body


def test_a_revision_change_downloads_beside_rolls_after_and_removes_the_old_commit():
    cluster = JobCluster()
    claim = ("PersistentVolumeClaim", "default", "weights")
    cluster.objects[claim] = {"metadata": {"name": "weights"}}
    body = _ready_on(cluster, cached(revision="v1"), A)
    # The revision changes: a new Job; the pods stay on A until B is ready.
    body["spec"]["model"]["uri"] = "hf://org/model@v2"
    out, body = run(cluster, body)
    assert len(cluster.jobs()) == 2 and out.weights_settling
    dep = cluster.objects[("Deployment", "default", "m")]
    assert server(dep)["volumeMounts"][-1]["subPath"] == f"org/model/{A}"
    cond = {c["type"]: c for c in body["status"]["conditions"]}["WeightsReady"]
    assert cond["status"] == "False" and f"keep serving commit {A[:12]}" in cond["message"]
    cluster.finish(fetch_job_name(load_model(body)), {**READY, "revision": "v2", "commit": B})
    events = Events()
    _, body = run(cluster, body, events)
    dep = cluster.objects[("Deployment", "default", "m")]
    assert server(dep)["volumeMounts"][-1]["subPath"] == f"org/model/{B}"
    assert body["status"]["weights"]["previousCommit"] == A
    assert not any(n.startswith("sluice-weights-rm-") for n in cluster.jobs())  # still rolling
    cluster.set_deployment_status("default", "m", replicas=1, readyReplicas=1, updatedReplicas=1)
    events = Events()
    _, body = run(cluster, body, events)
    removes = [n for n in cluster.jobs() if n.startswith("sluice-weights-rm-")]
    assert len(removes) == 1 and "previousCommit" not in body["status"]["weights"]
    rm = cluster.objects[("Job", "default", removes[0])]
    assert rm["spec"]["template"]["spec"]["containers"][0]["args"][-2:] == ["--keep", B]
    assert [r for _, r, _ in events] == ["WeightsRemoving"]


def test_a_commit_another_model_serves_is_kept():
    """The operator's passes read the namespace's models from memory: another model still
    on the old commit keeps it (the previous test is the control: nobody serves it)."""
    cluster = JobCluster()
    cluster.objects[("PersistentVolumeClaim", "default", "weights")] = {"metadata": {}}
    _ready_on(cluster, cached("other", revision="v1"), A)
    body = _ready_on(cluster, cached("m", revision="v1"), A)
    body["spec"]["model"]["uri"] = "hf://org/model@v2"
    _, body = run(cluster, body, reads=cluster.memory)
    cluster.finish(fetch_job_name(load_model(body)), {**READY, "revision": "v2", "commit": B})
    _, body = run(cluster, body, reads=cluster.memory)
    cluster.set_deployment_status("default", "m", replicas=1, readyReplicas=1, updatedReplicas=1)
    events = Events()
    _, body = run(cluster, body, events, reads=cluster.memory)
    assert not any(n.startswith("sluice-weights-rm-") for n in cluster.jobs())  # A is served
    assert "previousCommit" not in body["status"]["weights"] and events == []


def test_the_handler_polls_while_the_download_runs(monkeypatch):
    monkeypatch.setattr(kopf, "event", lambda body, **kw: None)
    cluster = JobCluster()
    cluster.objects[("PersistentVolumeClaim", "default", "weights")] = {"metadata": {}}
    body = cached(revision="v1")
    cluster.store(body)
    asked = []
    progress = {"phase": "downloading", "files_done": 1, "files_total": 2, "bytes_done": 5,
                "bytes_total": 10}  # fmt: skip
    monkeypatch.setattr(passes, "weights_progress", lambda pod: asked.append(pod) or progress)
    kwargs = dict(body=body, namespace="default", name="m", memo=cluster.memo, retry=0,
                  logger=logging.getLogger("test"))  # fmt: skip
    with pytest.raises(kopf.TemporaryError) as exc:
        handlers.reconcile(**kwargs)
    assert exc.value.delay == WEIGHTS_RECHECK_SECONDS and asked == []  # no pod yet
    name = fetch_job_name(load_model(body))
    cluster.job_pods[name] = [job_pod(phase="Running")]
    with pytest.raises(kopf.TemporaryError):
        handlers.reconcile(**kwargs)
    assert len(asked) == 1
    status = cluster.stored_status[("default", "m")]
    cond = {c["type"]: c for c in status["conditions"]}["WeightsReady"]
    assert cond["reason"] == "Downloading" and "1/2 files" in cond["message"]
    cluster.finish(name, READY)
    handlers.reconcile(**kwargs)  # ready: no retry, no poll
    assert len(asked) == 1
    assert cluster.stored_status[("default", "m")]["weights"]["commit"] == A


def _rm_jobs(cluster):
    return [cluster.objects[("Job", "default", n)] for n in cluster.jobs()
            if n.startswith("sluice-weights-rm-")]  # fmt: skip


def _rm_args(job):
    return job["spec"]["template"]["spec"]["containers"][0]["args"]


def _moved_to_b(cluster, events):
    """Model m on A, then on v2 = B, its rollout settled: the pass that decides A's fate."""
    body = _ready_on(cluster, cached("m", revision="v1"), A)
    body["spec"]["model"]["uri"] = "hf://org/model@v2"
    _, body = run(cluster, body, reads=cluster.memory)
    cluster.finish(fetch_job_name(load_model(body)), {**READY, "revision": "v2", "commit": B})
    _, body = run(cluster, body, reads=cluster.memory)
    cluster.set_deployment_status("default", "m", replicas=1, readyReplicas=1, updatedReplicas=1)
    return run(cluster, body, events, reads=cluster.memory)[1]


def test_a_model_created_a_moment_ago_holds_the_clean_up_until_its_download_resolves():
    """The busy check reads the namespace's specs, not only statuses: a model just created
    on the same claim and repository (no status yet) downloads a branch that may resolve
    to the commit being removed, so the clean-up waits for it. The control is
    test_a_revision_change_...: with nobody else, the Job is created on that pass."""
    cluster = JobCluster()
    cluster.objects[("PersistentVolumeClaim", "default", "weights")] = {"metadata": {}}
    cluster.store(cached("new", revision="main"))  # created a moment ago: no status at all
    events = Events()
    body = _moved_to_b(cluster, events)
    assert _rm_jobs(cluster) == [] and events == []
    assert body["status"]["weights"]["previousCommit"] == A  # decided later
    # Its download resolves main to A: A is kept, nothing is removed.
    _ready_on(cluster, cached("new", revision="main"), A)
    events = Events()
    _, body = run(cluster, body, events, reads=cluster.memory)
    assert _rm_jobs(cluster) == [] and "previousCommit" not in body["status"]["weights"]


def test_a_new_model_on_another_claim_or_repository_does_not_hold_the_clean_up():
    cluster = JobCluster()
    cluster.objects[("PersistentVolumeClaim", "default", "weights")] = {"metadata": {}}
    cluster.store(cached("elsewhere", revision="main", claim="other-claim"))
    events = Events()
    _moved_to_b(cluster, events)
    (rm,) = _rm_jobs(cluster)
    assert _rm_args(rm)[-2:] == ["--keep", B]
    assert [r for _, r, _ in events] == ["WeightsRemoving"]


def test_a_new_model_pinning_the_old_commit_keeps_it_without_waiting():
    cluster = JobCluster()
    cluster.objects[("PersistentVolumeClaim", "default", "weights")] = {"metadata": {}}
    cluster.store(cached("pinned", revision=A))
    body = _moved_to_b(cluster, Events())
    assert _rm_jobs(cluster) == [] and "previousCommit" not in body["status"]["weights"]


def own(name, **kw):
    """A model with a uid of its own (the deletion tells models apart by uid)."""
    body = cached(name, **kw)
    body["metadata"]["uid"] = f"uid-{name}"
    return body


def _deleted(cluster, body, monkeypatch, events):
    """The model is deleted: gone from the API server (and memory), then kopf's DELETED event
    with its last body."""
    monkeypatch.setattr(kopf, "event", lambda obj, type, reason, message: events.append(
        (type, reason, message)))  # fmt: skip
    del cluster.objects[("StreamingModel", "default", body["metadata"]["name"])]
    handlers.model_seen(memo=cluster.memo, body=body, namespace="default",
                        logger=logging.getLogger("test"), type="DELETED")  # fmt: skip


def test_deleting_the_last_model_of_a_commit_removes_it_and_not_before(monkeypatch):
    cluster = JobCluster()
    cluster.objects[("PersistentVolumeClaim", "default", "weights")] = {"metadata": {}}
    a = _ready_on(cluster, own("a", revision="v1"), A)
    b = _ready_on(cluster, own("b", revision="v1"), A)
    c = _ready_on(cluster, own("c", revision="v2"), B)
    events: list = []
    _deleted(cluster, a, monkeypatch, events)
    assert _rm_jobs(cluster) == [] and events == []  # b still serves A (the control)
    _deleted(cluster, b, monkeypatch, events)
    (rm,) = _rm_jobs(cluster)
    assert _rm_args(rm)[-2:] == ["--keep", B]  # c's commit stays
    assert [r for _, r, _ in events] == ["WeightsRemoving"]
    assert f"model b was deleted: removing commit {A}" in events[0][2]
    _deleted(cluster, c, monkeypatch, events)
    rms = _rm_jobs(cluster)
    assert len(rms) == 2 and ["--all"] in [_rm_args(j)[-1:] for j in rms]  # nothing left


def test_a_deleted_models_clean_up_waits_for_a_download_then_the_resync_runs_it(monkeypatch):
    cluster = JobCluster()
    cluster.objects[("PersistentVolumeClaim", "default", "weights")] = {"metadata": {}}
    a = _ready_on(cluster, own("a", revision="v1"), A)
    cluster.store(own("new", revision="main"))  # no status yet: its Job may resolve to A
    events: list = []
    _deleted(cluster, a, monkeypatch, events)
    passes = cluster.runtime.passes
    assert _rm_jobs(cluster) == [] and len(passes.waiting_releases) == 1
    passes.retry_releases(logging.getLogger("test"))  # still downloading: still waiting
    assert _rm_jobs(cluster) == [] and len(passes.waiting_releases) == 1
    _ready_on(cluster, own("new", revision="main"), B)
    passes.retry_releases(logging.getLogger("test"))
    (rm,) = _rm_jobs(cluster)
    assert _rm_args(rm)[-2:] == ["--keep", B] and passes.waiting_releases == {}
    assert [r for _, r, _ in events] == ["WeightsRemoving"]


def test_deleting_a_model_without_the_cache_or_before_its_first_commit_removes_nothing(
    monkeypatch,
):
    cluster = JobCluster()
    cluster.objects[("PersistentVolumeClaim", "default", "weights")] = {"metadata": {}}
    _, pending = run(cluster, own("a", revision="v1"))  # downloading: no commit recorded
    events: list = []
    _deleted(cluster, pending, monkeypatch, events)
    plain = body_of({"metadata": {"name": "p", "namespace": "default"},
                     "spec": {"model": {"uri": "hf://org/model"}}})  # fmt: skip
    cluster.store(plain)
    _deleted(cluster, plain, monkeypatch, events)
    assert _rm_jobs(cluster) == [] and events == []


def test_the_resync_retries_waiting_clean_ups_on_the_leader_only():
    from sluice_operator.resync import Resync

    calls: list = []
    for leading in (True, False):
        r = Resync(JobCluster().memory, 0, logging.getLogger("test"), lambda *a: None,
                   leading=lambda lead=leading: lead,
                   after_round=lambda lead=leading: calls.append(lead))  # fmt: skip
        r.adopt_context()
        r.run_once()
    assert calls == [True]
