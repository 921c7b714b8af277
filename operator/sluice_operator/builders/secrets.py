"""The Secrets a model's server reads: mounted as files, never put in its environment.

An environment variable is readable by everything the container runs (and shown by `kubectl
describe` of an env-dumping tool, a crash report, `/proc/<pid>/environ`); a file in a Secret
volume is readable by the pod's user only, and the kubelet keeps it on tmpfs. So the pod gets:

- `spec.model.hfTokenSecretRef`: the key mounted at HF_TOKEN_DIR/HF_TOKEN_FILE and
  `HF_TOKEN_PATH` pointing there (a path, not a secret). `huggingface_hub` reads its token
  from that file in every process that downloads (the server, vLLM's engine core, adapter
  downloads), in any server image: no server flag is involved.
  With `spec.model.cache.weights` the token goes to the download Job only
  (builders/weights.py): the pods get neither the file nor any token variable.
- `spec.auth.rateLimit.redisUrlSecretRef` (backend redis): the key mounted at
  REDIS_DIR/REDIS_FILE and the server's `--redis-url-file` pointing there.

`--redis-url-file` is a server flag, so a server from before it (an image tagged with a
version below FILES_SINCE, from `spec.image` or the operator's default) would refuse the
argument and never start: such a pod gets the URL as `SLUICE_REDIS_URL` from the Secret, as
those servers expect. Any other image (that version or a later one, a tag such as `latest`,
a digest) gets the file. What counts is the image the container gets (`StreamingModel.image`).

Pure: the model in, volumes, mounts, environment and arguments out.
"""

from __future__ import annotations

import re
from typing import Any

from ..models.auth import RedisUrlSecretRef
from ..models.refs import SecretKeyRef
from ..models.resource import StreamingModel

HF_TOKEN_DIR = "/etc/sluice/hf-token"
HF_TOKEN_FILE = "token"
REDIS_DIR = "/etc/sluice/redis"
REDIS_FILE = "url"
# The first server release with `--redis-url-file`. Images tagged with an earlier version
# get the Redis URL in their environment. Never above the operator's own version (a test
# checks it): the default model image must get the file.
FILES_SINCE = (0, 1, 0)
REDIS_URL_ENV = "SLUICE_REDIS_URL"
REDIS_VOLUME = "redis-url"
# Variables that would win over HF_TOKEN_PATH in huggingface_hub: a model with a token
# Secret drops them from `spec.engine.env`, so the Secret's token is the one used.
HF_TOKEN_ENVS = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")

_VERSION_TAG = re.compile(r"^v?(\d+)\.(\d+)\.(\d+)(?:[-+.].*)?$")


def image_version(image: str) -> tuple[int, int, int] | None:
    """The release a server image's tag names (`repo/sluice-server:0.1.0`, `:v0.1.0-rc.1`),
    or None for a tag that names no version (`latest`, `main`), no tag, or a digest only."""
    name = image.split("@", 1)[0]
    repo, sep, tag = name.rpartition(":")
    if not sep or "/" in tag:  # no tag, or the colon was a registry's port
        return None
    m = _VERSION_TAG.match(tag)
    return (int(m.group(1)), int(m.group(2)), int(m.group(3))) if m else None


def redis_url_ref(model: StreamingModel) -> RedisUrlSecretRef | None:
    limit = model.spec.auth.rate_limit
    return limit.redis_url_secret_ref if limit.backend == "redis" else None


def redis_url_in_env(model: StreamingModel) -> bool:
    """Whether the pod's server image predates `--redis-url-file` (see the module's doc)."""
    version = image_version(model.image)
    return version is not None and version < FILES_SINCE


def pod_hf_token(model: StreamingModel) -> SecretKeyRef | None:
    """The token Secret the model's pods mount: none with the weights cache."""
    if model.spec.model.cache.weights is not None:
        return None
    return model.spec.model.hf_token_secret_ref


def _secret_volume(name: str, secret: str, key: str, path: str) -> dict[str, Any]:
    items = [{"key": key, "path": path}]
    return {"name": name, "secret": {"secretName": secret, "items": items, "defaultMode": 0o440}}


def secret_volumes(model: StreamingModel) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The Secret volumes and the container's mounts for the HF token and the Redis URL."""
    volumes: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    token = pod_hf_token(model)
    if token:
        volumes.append(_secret_volume("hf-token", token.name, token.key, HF_TOKEN_FILE))
        mounts.append({"name": "hf-token", "mountPath": HF_TOKEN_DIR, "readOnly": True})
    redis = redis_url_ref(model)
    if redis and not redis_url_in_env(model):
        volumes.append(_secret_volume(REDIS_VOLUME, redis.name, redis.key, REDIS_FILE))
        mounts.append({"name": REDIS_VOLUME, "mountPath": REDIS_DIR, "readOnly": True})
    return volumes, mounts


def secret_env(model: StreamingModel, env: dict[str, dict[str, Any]]) -> None:
    """Adds to (and takes from) the container's environment, by name, after the user's
    `spec.engine.env`: what points at the mounted files, and what must not shadow them."""
    if model.spec.model.cache.weights is not None:  # no token in a pod that never downloads
        for name in (*HF_TOKEN_ENVS, "HF_TOKEN_PATH"):
            env.pop(name, None)
    elif pod_hf_token(model):
        for name in HF_TOKEN_ENVS:
            env.pop(name, None)
        env.pop("HF_TOKEN_PATH", None)  # re-added last, whatever the user set
        env["HF_TOKEN_PATH"] = {"name": "HF_TOKEN_PATH", "value": f"{HF_TOKEN_DIR}/{HF_TOKEN_FILE}"}
    redis = redis_url_ref(model)
    if redis:
        env.pop(REDIS_URL_ENV, None)  # the server refuses both a URL and a URL file
        if redis_url_in_env(model):
            ref = {"secretKeyRef": {"name": redis.name, "key": redis.key}}
            env[REDIS_URL_ENV] = {"name": REDIS_URL_ENV, "valueFrom": ref}


def secret_args(model: StreamingModel) -> list[str]:
    """The server's arguments that name the mounted files."""
    if redis_url_ref(model) and not redis_url_in_env(model):
        return ["--redis-url-file", f"{REDIS_DIR}/{REDIS_FILE}"]
    return []
