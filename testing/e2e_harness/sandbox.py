"""What a container runtime would make of a pod's container, built for bubblewrap.

Pure pieces (no API calls, no processes), unit-tested without a cluster
(tests/harness/test_pod_sandbox.py):

- `resolve_image`: the image name -> a local "image": which executables it provides and
  the environment it sets. There are no image layers here: the serving image
  (`*/sluice-server:*`, any registry and tag) is this checkout's venv, its `sluice-server`
  entrypoint is `<venv python> -m sluice_server`, and its environment carries the test run's
  `PYTHONPATH`, so a pod runs the code under test. What the image holds (the checkout and
  the venv) is bound read-only at its own path after the pod's volumes, as a container's
  image layers are there whatever it mounts: a tmpfs `/tmp` volume must not hide a checkout
  under `/tmp`. `e2e.local/host` runs a command from the
  host's root file system (harness tests: `sh`, `sleep`). Anything else raises `ImageError`
  and the pod reports `ErrImagePull` with the list of images it knows.
- `container_env`: env and envFrom as the kubelet resolves them, `$(VAR)` references
  included, from a lookup of Secrets and ConfigMaps; a missing key or object that is not
  `optional` raises `ConfigError` (the kubelet's `CreateContainerConfigError`).
- `container_argv`: command and args with `$(VAR)` expanded. The sandbox shares the host's
  network namespace (there is no pod network here), so a wildcard bind address (`0.0.0.0`,
  `::`) in the arguments becomes the pod's own loopback address: that is what "listens on
  every interface of the pod" means when the pod's only interface is its address. vLLM's
  `--kv-events-config` ZMQ endpoints likewise (`zmq_own_endpoint`).
- `api_server_env`: the `kubernetes` Service's variables every container gets.
- `bwrap_argv`: the sandbox (measured in the environment notes): read-only root, the pod's
  uid/gid through a user namespace, the command as PID 1 of its own PID namespace (so
  SIGTERM goes to it, as in a container), a private IPC namespace, each volume mount, then
  the image's own folders.
- `Projection`: a Secret or ConfigMap volume written the way the kubelet's atomic writer
  does: files in a timestamped folder, `..data` a symlink to it, each key a symlink through
  `..data`; an update writes a new folder and renames a new `..data` over the old one, so a
  reader sees the old set or the new set, never a mix (credential reloads run for real).
- `ProjectedVolume`: a `projected` (or `downwardAPI`) volume the same way, with the
  ServiceAccount token the kubelet would mint for the pod, refreshed as its token manager
  does.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from testkit.repo import ROOT

BWRAP = "bwrap"
HOST_IMAGE = "e2e.local/host"
WILDCARD_ADDRESSES = ("0.0.0.0", "::")


class ImageError(Exception):
    """No local mapping for the image: the pod reports ErrImagePull."""


class ConfigError(Exception):
    """An env or volume source is missing: the pod reports CreateContainerConfigError."""


@dataclass(frozen=True)
class Image:
    name: str
    # executable name -> host argv prefix (the image's PATH, in effect)
    executables: Mapping[str, tuple[str, ...]]
    env: Mapping[str, str]
    entrypoint: tuple[str, ...] = ()  # used when the container has no command
    user: int = 0  # the image's USER when the pod sets none
    # Host folders the image holds, bound read-only at the same path over the pod's volumes.
    paths: tuple[str, ...] = ()


def outermost(paths: list[str]) -> tuple[str, ...]:
    """`paths` without duplicates and without those inside another one, in order."""
    out: list[str] = []
    for p in paths:
        if not any(p == q or p.startswith(q.rstrip("/") + "/") for q in out):
            out = [q for q in out if not q.startswith(p.rstrip("/") + "/")] + [p]
    return tuple(out)


def _serving_image(name: str) -> Image:
    python = sys.executable
    venv_bin = str(Path(python).parent)
    env = {
        "PATH": f"{venv_bin}:/usr/local/bin:/usr/bin:/bin",
        "PYTHONUNBUFFERED": "1",
        # The code under test: the checkout the test run imports (a worktree's env.sh
        # puts it first on PYTHONPATH), not whatever the venv's editable installs name.
        "PYTHONPATH": os.pathsep.join(p for p in sys.path if p and Path(p).is_dir()),
    }
    run = (python, "-m", "sluice_server")
    paths = outermost([str(ROOT), sys.prefix])  # the code under test, the venv
    return Image(name, {"sluice-server": run}, env, entrypoint=run, user=65532, paths=paths)


def _host_image(name: str) -> Image:
    return Image(name, {}, {"PATH": "/usr/local/bin:/usr/bin:/bin"})


def image_repository(image: str) -> str:
    """`ghcr.io/org/sluice-server:0.1.0@sha256:...` -> `ghcr.io/org/sluice-server`."""
    repo = image.split("@", 1)[0]
    last = repo.rsplit("/", 1)[-1]
    if ":" in last:
        repo = repo[: len(repo) - len(last)] + last.split(":", 1)[0]
    return repo


KNOWN_IMAGES = "*/sluice-server (the checkout's venv), e2e.local/host (host commands)"


def resolve_image(image: str) -> Image:
    repo = image_repository(image)
    if repo.rsplit("/", 1)[-1] == "sluice-server":
        return _serving_image(image)
    if repo == HOST_IMAGE:
        return _host_image(image)
    raise ImageError(f'image "{image}" has no local mapping in the e2e node agent '
                     f"(known: {KNOWN_IMAGES})")  # fmt: skip


# --- env -------------------------------------------------------------------------------
# kind ("secret" | "configmap"), namespace, name -> {key: bytes}, or None when absent
Lookup = Callable[[str, str, str], Mapping[str, bytes] | None]

_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(value: str, env: Mapping[str, str]) -> str:
    """The kubelet's `$(VAR)` expansion: defined names are replaced, `$$` is a literal `$`,
    an undefined reference stays as written."""

    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1)
        return env[name] if name in env else m.group(0)

    return _REF.sub(sub, value)


def _key_of(kind: str, ns: str, ref: Mapping[str, Any], lookup: Lookup, what: str) -> str | None:
    data = lookup(kind, ns, ref["name"])
    optional = bool(ref.get("optional"))
    if data is None:
        if optional:
            return None
        raise ConfigError(f'{what}: {kind} "{ref["name"]}" not found')
    if ref["key"] not in data:
        if optional:
            return None
        raise ConfigError(f'{what}: key "{ref["key"]}" not in {kind} "{ref["name"]}"')
    return data[ref["key"]].decode()


def field_value(path: str, pod: Mapping[str, Any], pod_ip: str, host_ip: str) -> str:
    meta = pod["metadata"]
    simple = {
        "metadata.name": meta.get("name"),
        "metadata.namespace": meta.get("namespace"),
        "metadata.uid": meta.get("uid"),
        "spec.nodeName": pod["spec"].get("nodeName"),
        "spec.serviceAccountName": pod["spec"].get("serviceAccountName"),
        "status.podIP": pod_ip,
        "status.podIPs": pod_ip,
        "status.hostIP": host_ip,
        "status.hostIPs": host_ip,
    }
    if path in simple:
        return simple[path] or ""
    m = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
    if m:
        return (meta.get(m.group(1)) or {}).get(m.group(2), "")
    raise ConfigError(f"fieldRef {path} is not supported by the e2e node agent")


def api_server_env(host: str, port: int) -> dict[str, str]:
    """The variables the kubelet gives every container for the `kubernetes` Service (with
    or without `enableServiceLinks`), pointing at the API server itself: there is no
    Service IP here, and the pods share the host's network, so its loopback address
    reaches it. In-cluster clients (client-go, the Python client, the router) read
    `KUBERNETES_SERVICE_HOST`/`KUBERNETES_SERVICE_PORT`."""
    url = f"tcp://{host}:{port}"
    return {
        "KUBERNETES_SERVICE_HOST": host,
        "KUBERNETES_SERVICE_PORT": str(port),
        "KUBERNETES_SERVICE_PORT_HTTPS": str(port),
        "KUBERNETES_PORT": url,
        f"KUBERNETES_PORT_{port}_TCP": url,
        f"KUBERNETES_PORT_{port}_TCP_PROTO": "tcp",
        f"KUBERNETES_PORT_{port}_TCP_PORT": str(port),
        f"KUBERNETES_PORT_{port}_TCP_ADDR": host,
    }


def container_env(container: Mapping[str, Any], pod: Mapping[str, Any], image: Image,
                  lookup: Lookup, pod_ip: str, host_ip: str,
                  service_env: Mapping[str, str] | None = None) -> dict[str, str]:  # fmt: skip
    """The process environment: the image's, then what the kubelet adds (`HOSTNAME`, the
    API server's `service_env`), then envFrom, then env (later entries win, each `$(VAR)`
    resolved against what came before)."""
    ns = pod["metadata"]["namespace"]
    env: dict[str, str] = {**image.env, "HOSTNAME": pod["metadata"]["name"],
                           **(service_env or {})}  # fmt: skip
    for src in container.get("envFrom") or []:
        prefix = src.get("prefix", "")
        for kind, key in (("secret", "secretRef"), ("configmap", "configMapRef")):
            ref = src.get(key)
            if ref is None:
                continue
            data = lookup(kind, ns, ref["name"])
            if data is None:
                if ref.get("optional"):
                    continue
                raise ConfigError(f'envFrom: {kind} "{ref["name"]}" not found')
            for k, v in data.items():
                env[prefix + k] = v.decode()
    for var in container.get("env") or []:
        name, what = var["name"], f"env {var['name']}"
        if "valueFrom" not in var:
            env[name] = expand(var.get("value", ""), env)
            continue
        src = var["valueFrom"]
        if "secretKeyRef" in src:
            value = _key_of("secret", ns, src["secretKeyRef"], lookup, what)
        elif "configMapKeyRef" in src:
            value = _key_of("configmap", ns, src["configMapKeyRef"], lookup, what)
        elif "fieldRef" in src:
            value = field_value(src["fieldRef"]["fieldPath"], pod, pod_ip, host_ip)
        else:
            raise ConfigError(f"{what}: {sorted(src)} is not supported by the e2e node agent")
        if value is not None:
            env[name] = value
    return env


def container_argv(container: Mapping[str, Any], image: Image, env: Mapping[str, str],
                   pod_ip: str) -> list[str]:  # fmt: skip
    """The argv to exec inside the sandbox (see the module docstring)."""
    command = [expand(a, env) for a in container.get("command") or []]
    args = [expand(a, env) for a in container.get("args") or []]
    if not command:
        if not image.entrypoint:
            raise ConfigError(f'container {container["name"]}: no command and image '
                              f'{image.name} has no entrypoint')  # fmt: skip
        command = list(image.entrypoint)
    elif command[0] in image.executables:
        command = [*image.executables[command[0]], *command[1:]]
    elif not command[0].startswith("/") and not shutil.which(command[0], path=image.env["PATH"]):
        raise ConfigError(f'container {container["name"]}: executable "{command[0]}" not '
                          f"found in image {image.name}")  # fmt: skip
    argv = [_own_address(a, pod_ip) for a in command + args]
    return _own_kv_events(argv, pod_ip)


def _own_address(arg: str, pod_ip: str) -> str:
    if arg in WILDCARD_ADDRESSES:
        return pod_ip
    for w in WILDCARD_ADDRESSES:
        if arg.endswith("=" + w):
            return arg[: -len(w)] + pod_ip
    return arg


KV_EVENTS_FLAG = "--kv-events-config"
_ZMQ_WILDCARD = re.compile(r"tcp://(\*|\[::\]|::):(\d+)")


def zmq_own_endpoint(endpoint: str, pod_ip: str) -> str:
    """`tcp://*:PORT` (or `tcp://[::]:PORT`) -> `tcp://[::ffff:<pod IP>]:PORT`: the pod's
    own address, written so that vLLM still binds it (vLLM binds an endpoint holding `*`
    or `::` and connects to any other) and ZMQ binds the IPv4 address behind the mapped
    form without IPv6 switched on. Anything else is kept."""
    m = _ZMQ_WILDCARD.fullmatch(endpoint)
    return f"tcp://[::ffff:{pod_ip}]:{m.group(2)}" if m else endpoint


def _kv_events_config(value: str, pod_ip: str) -> str:
    try:
        config = json.loads(value)
    except ValueError:
        return value  # not ours to judge: vLLM refuses it
    if not isinstance(config, dict):
        return value
    for key in ("endpoint", "replay_endpoint"):
        if isinstance(config.get(key), str):
            config[key] = zmq_own_endpoint(config[key], pod_ip)
    return json.dumps(config, separators=(",", ":"))


def _own_kv_events(argv: list[str], pod_ip: str) -> list[str]:
    """vLLM's `--kv-events-config JSON` (or `=JSON`): its wildcard ZMQ endpoints (PUB and
    replay) become the pod's own address (`zmq_own_endpoint`). On a cluster each pod has
    its network namespace and `tcp://*:5557` is the pod's; here the pods share the host's,
    and two pods on the same fixed ports would collide."""
    out = list(argv)
    for i, arg in enumerate(out):
        if arg == KV_EVENTS_FLAG and i + 1 < len(out):
            out[i + 1] = _kv_events_config(out[i + 1], pod_ip)
        elif arg.startswith(KV_EVENTS_FLAG + "="):
            out[i] = f"{KV_EVENTS_FLAG}={_kv_events_config(arg.split('=', 1)[1], pod_ip)}"
    return out


def sandbox_problem() -> str | None:
    """Why pods cannot run under bubblewrap here (None: they can)."""
    import subprocess

    if shutil.which(BWRAP) is None or shutil.which("nsenter") is None:
        return "bubblewrap not installed (make tools, or apt-get install -y bubblewrap)"
    if os.geteuid() != 0:
        return "the node agent makes volume mount points on the host's root: run as root"
    probe = [BWRAP, "--ro-bind", "/", "/", "--unshare-user", "--unshare-pid", "--as-pid-1",
             "--", "/bin/true"]  # fmt: skip
    got = subprocess.run(probe, capture_output=True, text=True)
    if got.returncode != 0:
        return f"bubblewrap cannot make a sandbox here: {got.stderr.strip()}"
    return None


# --- security context -----------------------------------------------------------------
def run_as(container: Mapping[str, Any], pod: Mapping[str, Any], image: Image) -> tuple[int, int]:
    """(uid, gid) from the container's securityContext over the pod's over the image's."""
    pod_sc = pod["spec"].get("securityContext") or {}
    sc = container.get("securityContext") or {}
    uid = sc.get("runAsUser", pod_sc.get("runAsUser", image.user))
    gid = sc.get("runAsGroup", pod_sc.get("runAsGroup", uid))
    non_root = sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot", False))
    if non_root and uid == 0:
        raise ConfigError("container has runAsNonRoot and image will run as root")
    return int(uid), int(gid)


# --- quantities -----------------------------------------------------------------------
_UNITS = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
          "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}  # fmt: skip


def quantity_bytes(q: str | int) -> int:
    m = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(q))
    if m is None or m.group(2) not in _UNITS:
        raise ConfigError(f"cannot read quantity {q!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


# --- mounts ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Mount:
    """One bwrap mount: `source` None is a tmpfs (`size` bytes when set)."""

    target: str
    source: Path | None = None
    read_only: bool = False
    size: int | None = None

    def args(self) -> list[str]:
        if self.source is None:
            size = ["--size", str(self.size)] if self.size else []
            return [*size, "--tmpfs", self.target]
        return ["--ro-bind" if self.read_only else "--bind", str(self.source), self.target]


@dataclass
class Sandbox:
    argv: list[str]
    uid: int
    gid: int
    mounts: list[Mount] = field(default_factory=list)
    workdir: str = "/"
    read_only_root: bool = True
    drop_all_caps: bool = False
    image_paths: tuple[str, ...] = ()  # Image.paths

    def bwrap_argv(self) -> list[str]:
        # Not read-only: the host's root is still not the pod's to write; every writable
        # path a pod needs is a volume. (A container runtime gives it a throw-away layer.)
        out = [BWRAP, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc",
               "--die-with-parent", "--unshare-user", "--uid", str(self.uid), "--gid",
               str(self.gid), "--unshare-ipc", "--unshare-pid", "--as-pid-1"]  # fmt: skip
        if self.drop_all_caps:
            out += ["--cap-drop", "ALL"]
        for m in sorted(self.mounts, key=lambda m: m.target.count("/")):
            out += m.args()
        for path in self.image_paths:  # after the volumes: a tmpfs /tmp hides no image folder
            out += ["--ro-bind", path, path]
        return [*out, "--chdir", self.workdir, "--", *self.argv]

    def mount_points(self) -> list[str]:
        """Folders that must exist on the host's root (read-only inside), made before start;
        /dev is the sandbox's own, anything under it is made by bwrap; a file bound over a
        file (/etc/hosts) needs none."""
        return [m.target for m in self.mounts if not m.target.startswith("/dev/")
                and not (m.source is not None and m.source.is_file())]  # fmt: skip


# --- Secret / ConfigMap volumes --------------------------------------------------------
def object_data(kind: str, obj: Mapping[str, Any]) -> dict[str, bytes]:
    """A Secret's or ConfigMap's keys as bytes (Secret `data` is base64 in the API)."""
    if kind == "secret":
        out = {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}
        out |= {k: v.encode() for k, v in (obj.get("stringData") or {}).items()}
        return out
    out = {k: v.encode() for k, v in (obj.get("data") or {}).items()}
    out |= {k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()}
    return out


class AtomicDir:
    """A volume folder written the way the kubelet's atomic writer does (module docstring)."""

    DATA = "..data"

    def __init__(self, root: Path) -> None:
        self.root = root
        self.current: dict[str, bytes] | None = None
        self.updates = 0
        root.mkdir(parents=True, exist_ok=True)

    def publish(self, files: Mapping[str, tuple[bytes, int]]) -> bool:
        """Write `files` (path -> (content, mode)); False when nothing changed."""
        content = {path: body for path, (body, _) in files.items()}
        if content == self.current:
            return False
        stamp = time.strftime("..%Y_%m_%d_%H_%M_%S.", time.gmtime()) + f"{time.time_ns() % 10**9}"
        new = self.root / stamp
        new.mkdir()
        for path, (body, mode) in files.items():
            target = new / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(body)
            target.chmod(mode)
        new.chmod(0o755)
        tmp = self.root / "..data_tmp"
        if tmp.is_symlink():
            tmp.unlink()
        tmp.symlink_to(stamp)
        old = os.readlink(self.root / self.DATA) if (self.root / self.DATA).is_symlink() else None
        os.rename(tmp, self.root / self.DATA)  # the atomic step
        tops = {Path(p).parts[0] for p in files}
        for top in tops:
            link = self.root / top
            if not link.is_symlink():
                link.symlink_to(f"{self.DATA}/{top}")
        for entry in self.root.iterdir():
            if entry.is_symlink() and not entry.name.startswith("..") and entry.name not in tops:
                entry.unlink()
        if old:
            shutil.rmtree(self.root / old, ignore_errors=True)
        self.updates += self.current is not None
        self.current = content
        return True


def key_files(kind: str, name: str, items: list[dict] | None, default_mode: int,
              optional: bool, data: Mapping[str, bytes] | None
              ) -> dict[str, tuple[bytes, int]]:  # fmt: skip
    """The files of a Secret or ConfigMap volume (or projected source): every key, or the
    `items` (key -> path, mode); a missing object or key is a ConfigError unless optional."""
    if data is None:
        if optional:
            return {}
        raise ConfigError(f'{kind} "{name}" not found')
    if items is None:
        return {k: (v, default_mode) for k, v in data.items()}
    out = {}
    for item in items:
        if item["key"] not in data:
            if optional:
                continue
            raise ConfigError(f'key "{item["key"]}" not in {kind} "{name}"')
        out[item["path"]] = (data[item["key"]], item.get("mode", default_mode))
    return out


class Projection(AtomicDir):
    """One Secret/ConfigMap volume folder, kept in step with its object (module docstring)."""

    def __init__(self, root: Path, kind: str, name: str, items: list[dict] | None,
                 default_mode: int, optional: bool = False) -> None:  # fmt: skip
        super().__init__(root)
        self.kind, self.name = kind, name
        self.items, self.default_mode, self.optional = items, default_mode, optional

    def files(self, data: Mapping[str, bytes] | None) -> dict[str, tuple[bytes, int]]:
        return key_files(self.kind, self.name, self.items, self.default_mode, self.optional,
                         data)  # fmt: skip

    def write(self, data: Mapping[str, bytes] | None) -> bool:
        """Project `data`; False when nothing changed."""
        return self.publish(self.files(data))


# --- projected volumes: the ServiceAccount token, kube-root-ca.crt, the downward API ---
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
TOKEN_MAX_AGE = 24 * 3600.0  # the kubelet's token manager: refresh a day-old token anyway
TOKEN_REFRESH_LEFT = 0.2  # ... and one within the last 20% of its lifetime
# (audience or None for the API server's, expirationSeconds) -> (token, expiry, epoch s)
TokenSource = Callable[[str | None, int], tuple[str, float]]


def downward_file(path: str, pod: Mapping[str, Any], pod_ip: str, host_ip: str) -> str:
    """A downwardAPI volume item's content: `metadata.labels`/`annotations` whole as the
    kubelet formats them (`key="value"` lines, sorted), otherwise `field_value`."""
    if path in ("metadata.labels", "metadata.annotations"):
        pairs = sorted((pod["metadata"].get(path.split(".")[1]) or {}).items())
        return "\n".join(f"{k}={json.dumps(v)}" for k, v in pairs)
    return field_value(path, pod, pod_ip, host_ip)


class ProjectedVolume(AtomicDir):
    """A `projected` volume (the ServiceAccount admission's `kube-api-access-*` one, or a
    chart's own), also a plain `downwardAPI` volume (one source). Sources: `secret` and
    `configMap` (as their volumes: items, optional), `downwardAPI` (`fieldRef` items),
    `serviceAccountToken` (a token of the pod's ServiceAccount bound to the pod, from
    `token_source`, at `path`; minted again, as the kubelet's token manager does, once it
    is a day old or in the last 20% of its lifetime). `clusterTrustBundle`, `podCertificate`
    and `resourceFieldRef` are a ConfigError. `refresh()` re-reads every source (the agent
    calls it every `config_period`) and swaps `..data` only when a file changed."""

    def __init__(self, root: Path, sources: list[dict], default_mode: int,
                 pod: Mapping[str, Any], pod_ip: str, host_ip: str,
                 clock: Callable[[], float] = time.time) -> None:  # fmt: skip
        super().__init__(root)
        self.sources, self.default_mode = sources, default_mode
        self.pod, self.pod_ip, self.host_ip, self.clock = pod, pod_ip, host_ip, clock
        # (audience, expirationSeconds) -> (token, expires at): the kubelet's token cache
        self.tokens: dict[tuple[str | None, int], tuple[str, float]] = {}
        self.minted = 0

    def _token(self, audience: str | None, seconds: int, source: TokenSource) -> str:
        key = (audience, seconds)
        now = self.clock()
        if key in self.tokens:
            token, expires = self.tokens[key]
            issued = expires - seconds
            due = min(issued + TOKEN_MAX_AGE, expires - TOKEN_REFRESH_LEFT * seconds)
            if now < due:
                return token
        token, expires = source(audience, seconds)
        self.minted += 1
        self.tokens[key] = (token, expires)
        return token

    def files(self, lookup: Lookup, token_source: TokenSource) -> dict[str, tuple[bytes, int]]:
        ns = self.pod["metadata"]["namespace"]
        out: dict[str, tuple[bytes, int]] = {}
        for src in self.sources:
            if "secret" in src or "configMap" in src:
                kind = "secret" if "secret" in src else "configmap"
                ref = src["secret"] if "secret" in src else src["configMap"]
                data = lookup(kind, ns, ref["name"])
                out |= key_files(kind, ref["name"], ref.get("items"), self.default_mode,
                                 bool(ref.get("optional")), data)  # fmt: skip
            elif "downwardAPI" in src:
                for item in src["downwardAPI"].get("items") or []:
                    if "fieldRef" not in item:
                        raise ConfigError(f"downwardAPI {item['path']}: only fieldRef is "
                                          "supported by the e2e node agent")  # fmt: skip
                    text = downward_file(item["fieldRef"]["fieldPath"], self.pod, self.pod_ip,
                                         self.host_ip)  # fmt: skip
                    out[item["path"]] = (text.encode(), item.get("mode", self.default_mode))
            elif "serviceAccountToken" in src:
                sat = src["serviceAccountToken"]
                seconds = int(sat.get("expirationSeconds", 3600))
                token = self._token(sat.get("audience") or None, seconds, token_source)
                out[sat["path"]] = (token.encode(), self.default_mode)
            else:
                raise ConfigError(f"projected source {sorted(src)} is not supported by the "
                                  "e2e node agent")  # fmt: skip
        return out

    def refresh(self, lookup: Lookup, token_source: TokenSource) -> bool:
        """Project every source; False when no file changed."""
        return self.publish(self.files(lookup, token_source))
