"""The weights cache's objects (`spec.model.cache.weights`, docs/weights-cache.md): the
claim, the download Job, the clean-up Job, and what a model pod gets instead of the Hub.

The Job runs the serving image's `python -m sluice_server.weights fetch` (the download
program: it resolves the revision, checks every file against the Hub's metadata and writes
`<root>/<org>/<name>/<commit>/.sluice-weights.json` last), and says how it ended as JSON in
its container's termination message (`weightsstate.py` reads it). Its name is a hash of the
claim, the repository, the revision and the model's refresh annotation, so every model of
the namespace that wants the same files names the same Job: the first creates it, the
others find it (no owner reference: no one model owns a shared download; the Job is removed
by its TTL once finished, and a model whose status already records the commit never looks
for it again). The claim is never deleted by the operator.

Model pods mount the claim read-only at the commit's folder, get `--model` that folder (the
served name stays org/name), `HF_HUB_OFFLINE=1`, and no token: neither the Secret volume nor
any token variable. /cache stays writable (emptyDir or `cache.pvcName`) for the Hugging Face
home and vLLM's compile cache.

Pure: the model in, manifests out.
"""

from __future__ import annotations

import hashlib
from typing import Any

from ..models.resource import WEIGHTS_DIR, StreamingModel
from ..models.weights import WeightsCache
from .common import (
    MANAGED_BY_LABEL,
    MANAGER,
    NAME_LABEL,
    container_security_context,
    pod_security_context,
)
from .secrets import HF_TOKEN_DIR, HF_TOKEN_FILE

JOB_ROOT = "/weights"  # where the download Job mounts the claim (writable)
PROGRESS_PORT = 8090  # the download program's GET /progress
RESULT_FILE = "/dev/termination-log"  # the Job container's termination message
MARKER_FILE = ".sluice-weights.json"
# A finished Job (either way) stays this long for `kubectl logs`, then the TTL controller
# removes it; a model that recorded the commit in its status never reads it again.
FINISHED_TTL_SECONDS = 24 * 3600
# Pod failures before the Job is Failed; the Job controller backs off 10 s, 20 s, 40 s
# between them. A Failed Job stays failed: a new refresh annotation or a spec change retries.
BACKOFF_LIMIT = 2
FETCH_COMPONENT = "weights-download"
REMOVE_COMPONENT = "weights-cleanup"
CLAIM_LABEL = "serving.sluice.dev/weights-claim"
REPO_LABEL = "serving.sluice.dev/weights-repo"  # a hash: org/name may not fit a label value
DEFAULT_REVISION = "main"


def cache_of(model: StreamingModel) -> WeightsCache | None:
    return model.spec.model.cache.weights


def repo_and_revision(model: StreamingModel) -> tuple[str, str]:
    """(org/name, revision) of an hf:// model; the revision defaults to main as on the Hub."""
    src = model.source
    return src.model_arg, src.revision or DEFAULT_REVISION


def _digest(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def repo_hash(repo: str) -> str:
    return _digest(repo)[:16]


def fetch_job_name(model: StreamingModel) -> str:
    """The download Job every model wanting these files names (see the module's doc)."""
    cache = cache_of(model)
    assert cache is not None
    repo, revision = repo_and_revision(model)
    return "sluice-weights-" + _digest(cache.claim_name, repo, revision, model.weights_refresh)[:16]


def remove_job_name(model: StreamingModel, keep: list[str], salt: str = "") -> str:
    """`salt` tells apart two clean-ups with the same `keep` (a model moving A -> B twice
    in a day, a claim's last model deleted twice): the earlier Job may still be there."""
    cache = cache_of(model)
    assert cache is not None
    repo, _ = repo_and_revision(model)
    return "sluice-weights-rm-" + _digest(cache.claim_name, repo, *sorted(keep), salt)[:16]


def _labels(model: StreamingModel, component: str) -> dict[str, str]:
    cache = cache_of(model)
    assert cache is not None
    repo, _ = repo_and_revision(model)
    return {
        NAME_LABEL: "sluice-weights",
        MANAGED_BY_LABEL: MANAGER,
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/part-of": "sluice",
        CLAIM_LABEL: cache.claim_name,
        REPO_LABEL: repo_hash(repo),
    }


def desired_weights_claim(model: StreamingModel) -> dict[str, Any] | None:
    """The claim to create when absent (`create` set); None: the claim must exist."""
    cache = cache_of(model)
    if cache is None or cache.create is None:
        return None
    spec: dict[str, Any] = {
        "accessModes": [cache.create.access_mode],
        "resources": {"requests": {"storage": str(cache.create.size)}},
    }
    if cache.create.storage_class_name:
        spec["storageClassName"] = cache.create.storage_class_name
    labels = {k: v for k, v in _labels(model, "weights-cache").items() if k != REPO_LABEL}
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": cache.claim_name, "namespace": model.namespace, "labels": labels},
        "spec": spec,
    }


def _job(
    model: StreamingModel,
    name: str,
    component: str,
    args: list[str],
    env: list[dict[str, Any]],
    extra_volumes: list[dict[str, Any]],
    extra_mounts: list[dict[str, Any]],
    ports: list[dict[str, Any]],
) -> dict[str, Any]:
    cache = cache_of(model)
    assert cache is not None
    labels = _labels(model, component)
    container: dict[str, Any] = {
        "name": "weights",
        "image": model.image,
        "imagePullPolicy": model.spec.image_pull_policy,
        "command": ["python", "-m", "sluice_server.weights"],
        "args": args,
        "env": [{"name": "HOME", "value": "/tmp"}, {"name": "HF_HOME", "value": "/tmp/hf"}, *env],
        "volumeMounts": [
            {"name": "weights", "mountPath": JOB_ROOT},
            {"name": "tmp", "mountPath": "/tmp"},
            *extra_mounts,
        ],
        "resources": {
            "requests": {"cpu": "500m", "memory": "512Mi"},
            "limits": {"memory": "2Gi"},
        },
        "securityContext": container_security_context(),
        # The program writes its JSON result there; the kubelet reports it in the pod's
        # status (terminated.message), which is how the operator learns the commit.
        "terminationMessagePath": RESULT_FILE,
        "terminationMessagePolicy": "File",
    }
    if ports:
        container["ports"] = ports
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "containers": [container],
        "volumes": [
            {"name": "weights", "persistentVolumeClaim": {"claimName": cache.claim_name}},
            {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}},
            *extra_volumes,
        ],
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": pod_security_context(),
    }
    # The model's placement: with ReadWriteOnce the Job must land where the pods do.
    r = model.spec.resources
    if r.node_selector:
        pod_spec["nodeSelector"] = dict(r.node_selector)
    if r.tolerations:
        pod_spec["tolerations"] = [
            t.model_dump(by_alias=True, exclude_none=True) for t in r.tolerations
        ]
    if model.spec.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": s.name} for s in model.spec.image_pull_secrets]
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": model.namespace, "labels": labels},
        "spec": {
            "backoffLimit": BACKOFF_LIMIT,
            "ttlSecondsAfterFinished": FINISHED_TTL_SECONDS,
            "template": {"metadata": {"labels": labels}, "spec": pod_spec},
        },
    }


def desired_fetch_job(model: StreamingModel) -> dict[str, Any]:
    """The download Job of the model's repository and revision (the token as a file, the
    Hub mirror as HF_ENDPOINT)."""
    cache = cache_of(model)
    assert cache is not None
    repo, revision = repo_and_revision(model)
    args = ["fetch", "--repo", repo, "--revision", revision, "--root", JOB_ROOT]
    volumes: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    token = model.spec.model.hf_token_secret_ref
    if token:
        items = [{"key": token.key, "path": HF_TOKEN_FILE}]
        secret = {"secretName": token.name, "items": items, "defaultMode": 0o440}
        volumes.append({"name": "hf-token", "secret": secret})
        mounts.append({"name": "hf-token", "mountPath": HF_TOKEN_DIR, "readOnly": True})
        args += ["--token-file", f"{HF_TOKEN_DIR}/{HF_TOKEN_FILE}"]
    args += ["--progress-port", str(PROGRESS_PORT), "--result-file", RESULT_FILE]
    env = [{"name": "HF_ENDPOINT", "value": cache.hub_endpoint}] if cache.hub_endpoint else []
    ports = [{"name": "progress", "containerPort": PROGRESS_PORT, "protocol": "TCP"}]
    return _job(model, fetch_job_name(model), FETCH_COMPONENT, args, env, volumes, mounts, ports)


def desired_remove_job(model: StreamingModel, keep: list[str], salt: str = "") -> dict[str, Any]:
    """Removes the repository's commits on the claim other than `keep`; every one of them
    when `keep` is empty (the last model of the repository on the claim was deleted)."""
    repo, _ = repo_and_revision(model)
    args = ["remove", "--root", JOB_ROOT, "--repo", repo]
    args += ["--keep", ",".join(sorted(keep))] if keep else ["--all"]
    name = remove_job_name(model, keep, salt)
    return _job(model, name, REMOVE_COMPONENT, args, [], [], [], [])


# --- what a model pod of a cache-mode model gets ----------------------------------------


def awaiting_weights(model: StreamingModel) -> bool:
    """A model of the cache whose first commit is not ready: no workload yet, so nothing
    that scales one either (an HPA or a ScaledObject would only report its target missing)."""
    return cache_of(model) is not None and model.weights_commit is None


def serves_cached(model: StreamingModel) -> bool:
    """The pods mount a commit of the cache (cache mode, and a commit is ready)."""
    return cache_of(model) is not None and model.weights_commit is not None


def weights_subpath(model: StreamingModel) -> str:
    repo, _ = repo_and_revision(model)
    return f"{repo}/{model.weights_commit}"


def weights_volumes(model: StreamingModel) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    cache = cache_of(model)
    if cache is None or model.weights_commit is None:
        return [], []
    claim = {"claimName": cache.claim_name, "readOnly": True}
    mount = {
        "name": "weights",
        "mountPath": WEIGHTS_DIR,
        "subPath": weights_subpath(model),
        "readOnly": True,
    }
    return [{"name": "weights", "persistentVolumeClaim": claim}], [mount]


# Set last in a cache-mode pod's environment: nothing may turn the Hub back on.
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
