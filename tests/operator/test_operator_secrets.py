"""Secrets reach model pods as files, never through the environment (builders/secrets.py):
the HF token at HF_TOKEN_PATH, the Redis URL at `--redis-url-file`; the environment only for
the Redis URL of a server image pinned to a version from before that flag."""

from __future__ import annotations

import copy
import tomllib
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from operator_helpers import minimal
from sluice_operator.builders import secrets
from sluice_operator.builders.deployment import desired_deployment
from sluice_operator.builders.leaderworkerset import desired_leaderworkerset
from sluice_operator.render import render_objects
from sluice_operator.validation import load_model
from test_operator_golden import CASES
from testkit.repo import ROOT

REDIS = {"requestsPerMinute": 60, "backend": "redis", "redisUrlSecretRef": {"name": "redis"}}
TOKEN = {"uri": "hf://org/gated", "hfTokenSecretRef": {"name": "hf", "key": "tok"}}


def containers(manifest: Any, at: str = "") -> Iterator[tuple[str, dict]]:
    """Every container (and init container) anywhere in a manifest, with where it is."""
    if isinstance(manifest, dict):
        for key, value in manifest.items():
            if key in ("containers", "initContainers") and isinstance(value, list):
                yield from ((f"{at}.{key}[{c.get('name')}]", c) for c in value)
            else:
                yield from containers(value, f"{at}.{key}")
    elif isinstance(manifest, list):
        for i, value in enumerate(manifest):
            yield from containers(value, f"{at}[{i}]")


def secrets_in_env(manifests: list[dict]) -> list[str]:
    """`env[].valueFrom.secretKeyRef` and `envFrom[].secretRef` of every container."""
    found = []
    for m in manifests:
        for where, c in containers(m, f"{m['kind']}/{m['metadata']['name']}"):
            found += [f"{where} env {e['name']}" for e in c.get("env", [])
                      if "secretKeyRef" in (e.get("valueFrom") or {})]  # fmt: skip
            found += [f"{where} envFrom {e['secretRef'].get('name')}"
                      for e in c.get("envFrom", []) if "secretRef" in e]  # fmt: skip
    return found


@pytest.mark.parametrize("name", sorted(CASES))
def test_no_rendered_pod_takes_a_secret_through_env(name):
    """Every sample and every golden case, every child the operator renders for it."""
    manifests = render_objects(copy.deepcopy(CASES[name]))
    assert any(m["kind"] in ("Deployment", "LeaderWorkerSet") for m in manifests)
    assert secrets_in_env(manifests) == []


def test_the_secret_env_check_has_teeth():
    """Negative control: a model pinned to a server from before `--redis-url-file` does get
    the Redis URL from a Secret in its environment, and the check finds it (as it finds an
    envFrom)."""
    body = minimal(image="registry.example.com/sluice-server:0.0.9", auth={"rateLimit": REDIS})
    manifests = render_objects(body)
    assert secrets_in_env(manifests) == ["Deployment/m.spec.template.spec.containers[server] "
                                         "env SLUICE_REDIS_URL"]  # fmt: skip
    job = {"kind": "Job", "metadata": {"name": "j"}, "spec": {"template": {"spec": {
        "initContainers": [{"name": "x", "envFrom": [{"secretRef": {"name": "s"}}]}]}}}}  # fmt: skip
    assert secrets_in_env([job]) == ["Job/j.spec.template.spec.initContainers[x] envFrom s"]


def _pod(workload: dict, template: str = "leaderTemplate") -> tuple[dict, dict]:
    spec = workload["spec"]
    pod = (
        spec["leaderWorkerTemplate"][template]
        if "leaderWorkerTemplate" in spec
        else spec["template"]
    )
    (c,) = pod["spec"]["containers"]
    return pod["spec"], c


def _file_of(pod: dict, c: dict, path: str) -> tuple[str, str]:
    """The (Secret, key) whose value the container sees at `path`, through its mounts."""
    volumes = {v["name"]: v for v in pod["volumes"]}
    for mount in c["volumeMounts"]:
        if path.startswith(mount["mountPath"] + "/"):
            assert mount["readOnly"] is True and "subPath" not in mount
            secret = volumes[mount["name"]]["secret"]
            assert secret["defaultMode"] == 0o440
            rest = path.removeprefix(mount["mountPath"] + "/")
            (item,) = [i for i in secret["items"] if i["path"] == rest]
            return secret["secretName"], item["key"]
    raise AssertionError(f"nothing mounted at {path}")


def test_hf_token_is_a_mounted_file_named_by_hf_token_path():
    """A user's HF_TOKEN in engine.env would win over the file in huggingface_hub: the
    Secret's token is the one used, as it was when the operator set HF_TOKEN itself."""
    m = load_model(minimal(model=TOKEN, engine={"env": [
        {"name": "HF_TOKEN", "value": "leak"}, {"name": "HUGGING_FACE_HUB_TOKEN", "value": "x"},
        {"name": "HF_TOKEN_PATH", "value": "/elsewhere"}, {"name": "X", "value": "1"}]}))  # fmt: skip
    pod, c = _pod(desired_deployment(m))
    env = {e["name"]: e for e in c["env"]}
    assert "HF_TOKEN" not in env and "HUGGING_FACE_HUB_TOKEN" not in env
    assert c["env"][-1] == {"name": "HF_TOKEN_PATH", "value": "/etc/sluice/hf-token/token"}
    assert env["X"]["value"] == "1" and env["HF_HOME"]["value"] == "/cache/hf"
    assert _file_of(pod, c, env["HF_TOKEN_PATH"]["value"]) == ("hf", "tok")
    assert not any("HF_TOKEN" in a or "hf_" in a.lower() for a in c["args"])


def test_without_a_token_secret_the_users_hf_env_stays():
    m = load_model(minimal(engine={"env": [{"name": "HF_TOKEN", "value": "mine"}]}))
    pod, c = _pod(desired_deployment(m))
    assert {"name": "HF_TOKEN", "value": "mine"} in c["env"]
    assert "HF_TOKEN_PATH" not in {e["name"] for e in c["env"]}
    assert "hf-token" not in {v["name"] for v in pod["volumes"]}


def test_redis_url_is_a_mounted_file_named_by_a_flag():
    m = load_model(minimal(
        auth={"apiKeySecretRef": {"name": "keys"}, "rateLimit": {**REDIS, "failureMode": "closed"}},
        engine={"env": [{"name": "SLUICE_REDIS_URL", "value": "redis://user-set"}]}))  # fmt: skip
    pod, c = _pod(desired_deployment(m))
    args = c["args"]
    assert args[args.index("--rate-limit-backend") + 1] == "redis"
    path = args[args.index("--redis-url-file") + 1]
    assert path == "/etc/sluice/redis/url"
    assert _file_of(pod, c, path) == ("redis", "url")
    # The server refuses a URL and a URL file together: a user's variable is dropped.
    assert "SLUICE_REDIS_URL" not in {e["name"] for e in c["env"]}
    assert not [a for a in args if "redis://" in a or a == "--redis-url"]


def test_memory_rate_limits_mount_no_redis():
    m = load_model(minimal(auth={"rateLimit": {"requestsPerMinute": 5}}))
    pod, c = _pod(desired_deployment(m))
    assert "redis-url" not in {v["name"] for v in pod["volumes"]}
    assert not [a for a in c["args"] if a.startswith("--redis")]


@pytest.mark.parametrize(
    "image, in_env",
    [
        ("registry.example.com/sluice-server:0.0.9", True),
        ("sluice-server:v0.0.1-rc.1", True),
        ("localhost:5000/sluice-server:0.0.9@sha256:" + "a" * 64, True),
        ("ghcr.io/sluice-dev/sluice-server:0.1.0", False),
        ("sluice-server:0.1.0-rc.1", False),
        ("sluice-server:1.4.2", False),
        ("sluice-server:latest", False),
        ("localhost:5000/sluice-server", False),
        ("sluice-server@sha256:" + "b" * 64, False),
    ],
)
def test_a_server_image_from_before_the_file_gets_the_redis_url_in_env(image, in_env):
    """Such a server would refuse `--redis-url-file` and never start."""
    m = load_model(minimal(image=image, auth={"rateLimit": REDIS}))
    pod, c = _pod(desired_deployment(m))
    env = {e["name"]: e for e in c["env"]}
    assert ("--redis-url-file" in c["args"]) is not in_env
    assert ("redis-url" in {v["name"] for v in pod["volumes"]}) is not in_env
    if in_env:
        assert env["SLUICE_REDIS_URL"]["valueFrom"] == {
            "secretKeyRef": {"name": "redis", "key": "url"}
        }
        assert c["env"][-1]["name"] == "SLUICE_REDIS_URL"  # after user env: not shadowed
    else:
        assert "SLUICE_REDIS_URL" not in env


def test_the_hf_token_file_does_not_depend_on_the_image():
    """huggingface_hub, not the server, reads HF_TOKEN_PATH: an old server image reads it too."""
    m = load_model(minimal(image="sluice-server:0.0.9", model=TOKEN))
    pod, c = _pod(desired_deployment(m))
    assert {"name": "HF_TOKEN_PATH", "value": "/etc/sluice/hf-token/token"} in c["env"]


def test_files_since_is_a_released_version_and_the_default_image_gets_the_file():
    """FILES_SINCE names no release after the operator's own, or every model on the default
    image would get the Redis URL in its environment."""
    project = tomllib.loads((ROOT / "operator" / "pyproject.toml").read_text())["project"]
    chart = yaml.safe_load((ROOT / "charts" / "sluice-operator" / "Chart.yaml").read_text())
    for version in (project["version"], chart["appVersion"]):
        assert secrets.image_version(f"x:{version}") >= secrets.FILES_SINCE
    m = load_model(minimal(auth={"rateLimit": REDIS}))
    assert m.spec.image is None and secrets.image_version(m.image) is not None
    assert not secrets.redis_url_in_env(m)


def test_two_node_workers_get_the_token_but_not_the_redis_url():
    """Workers load weights (the token) but never rate-limit (no Redis URL)."""
    for image in ("sluice-server:0.1.0", "sluice-server:0.0.9"):
        m = load_model(minimal(image=image, model=TOKEN, parallelism={"nodes": 2, "tensor": 2},
                               auth={"rateLimit": REDIS}))  # fmt: skip
        lws = desired_leaderworkerset(m)
        leader, lc = _pod(lws)
        worker, wc = _pod(lws, "workerTemplate")
        assert _file_of(worker, wc, "/etc/sluice/hf-token/token") == ("hf", "tok")
        assert "redis-url" not in {v["name"] for v in worker["volumes"]}
        assert "redis-url" not in {v["name"] for v in wc["volumeMounts"]}
        assert "SLUICE_REDIS_URL" not in {e["name"] for e in wc["env"]}
        assert "--rate-limit-backend" not in wc["args"]
        assert ("--redis-url-file" in lc["args"]) is (image.endswith("0.1.0"))
