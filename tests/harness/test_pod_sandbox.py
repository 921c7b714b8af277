"""The e2e node agent's pod sandbox without a cluster: the pure pieces (image mapping, env,
argv, the bwrap command line, the kubelet's `..data` projection), then real pods under
bubblewrap on a fake host (probes, restarts, preStop, SIGTERM to PID 1, SIGKILL at the
grace period). The live half needs `bwrap` and user namespaces; it is skipped without."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from e2e_harness import sandbox as sb
from e2e_harness.pod_runtime import PodRuntime
from testkit.wait import eventually


def _pod(containers: list[dict], volumes: list[dict] | None = None, **spec) -> dict:
    return {"metadata": {"name": "p", "namespace": "ns", "uid": "0123456789abcdef"},
            "spec": {"containers": containers, "volumes": volumes or [], **spec}}  # fmt: skip


SECRETS = {("secret", "ns", "keys"): {"token": b"s3cret", "other": b"x"},
           ("configmap", "ns", "cfg"): {"mode": b"fast"}}  # fmt: skip


def _lookup(kind, ns, name):
    return SECRETS.get((kind, ns, name))


# --- pure ------------------------------------------------------------------------------
def test_serving_image_maps_to_the_venv_and_unknown_images_fail_clearly():
    img = sb.resolve_image("ghcr.io/sluice-dev/sluice-server:0.1.0")
    assert img.executables["sluice-server"] == (sys.executable, "-m", "sluice_server")
    assert sb.resolve_image("localhost:5000/x/sluice-server@sha256:ab").name.endswith("ab")
    with pytest.raises(sb.ImageError, match='image "nginx:1.27" has no local mapping'):
        sb.resolve_image("nginx:1.27")
    assert sb.image_repository("localhost:5000/a/b:1") == "localhost:5000/a/b"


def test_env_resolves_refs_in_order_and_missing_keys_are_config_errors():
    c = {"name": "c", "env": [
        {"name": "A", "value": "1"},
        {"name": "B", "value": "$(A)-$(NOPE)-$$(A)"},
        {"name": "T", "valueFrom": {"secretKeyRef": {"name": "keys", "key": "token"}}},
        {"name": "M", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "mode"}}},
        {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "O", "valueFrom": {"secretKeyRef": {"name": "gone", "key": "k", "optional": True}}},
    ]}  # fmt: skip
    env = sb.container_env(c, _pod([c]), sb.resolve_image("e2e.local/host"), _lookup,
                           "127.1.0.9", "127.0.0.1")  # fmt: skip
    assert (env["B"], env["T"], env["M"], env["IP"]) == ("1-$(NOPE)-$(A)", "s3cret", "fast",
                                                         "127.1.0.9")  # fmt: skip
    assert "O" not in env and env["HOSTNAME"] == "p"
    bad = {"name": "c", "env": [{"name": "T", "valueFrom": {"secretKeyRef": {"name": "keys",
                                                                           "key": "nope"}}}]}  # fmt: skip
    with pytest.raises(sb.ConfigError, match='key "nope" not in secret "keys"'):
        sb.container_env(bad, _pod([bad]), sb.resolve_image("e2e.local/host"), _lookup, "", "")


def test_argv_maps_the_entrypoint_and_binds_the_pod_address():
    img = sb.resolve_image("ghcr.io/sluice-dev/sluice-server:0.1.0")
    c = {"name": "server", "command": ["sluice-server"],
         "args": ["--host", "0.0.0.0", "--port", "8000", "--bind=0.0.0.0", "--x", "$(V)"]}  # fmt: skip
    argv = sb.container_argv(c, img, {"V": "v"}, "127.1.0.7")
    assert argv == [sys.executable, "-m", "sluice_server", "--host", "127.1.0.7", "--port",
                    "8000", "--bind=127.1.0.7", "--x", "v"]  # fmt: skip
    with pytest.raises(sb.ConfigError, match="not found in image"):
        sb.container_argv({"name": "c", "command": ["no-such-binary-here"]},
                          sb.resolve_image("e2e.local/host"), {}, "127.1.0.7")  # fmt: skip


def test_bwrap_command_line_follows_the_pod_spec():
    box = sb.Sandbox(["/bin/true"], 65532, 65532, [
        sb.Mount("/etc/sluice/auth", Path("/v/keys"), read_only=True),
        sb.Mount("/dev/shm", None, size=64 * 2**20), sb.Mount("/cache", Path("/v/cache"))],
        drop_all_caps=True)  # fmt: skip
    argv = box.bwrap_argv()
    assert argv[:3] == ["bwrap", "--ro-bind", "/"]
    for flag in ("--unshare-pid", "--as-pid-1", "--unshare-user", "--die-with-parent"):
        assert flag in argv
    assert argv[argv.index("--uid") + 1] == "65532"
    joined = " ".join(argv)
    assert "--size 67108864 --tmpfs /dev/shm" in joined
    assert "--ro-bind /v/keys /etc/sluice/auth" in joined and "--bind /v/cache /cache" in joined
    assert argv[-2:] == ["--", "/bin/true"]
    assert box.mount_points() == ["/etc/sluice/auth", "/cache"]
    with pytest.raises(sb.ConfigError, match="runAsNonRoot"):
        sb.run_as({"name": "c"}, _pod([], securityContext={"runAsNonRoot": True}),
                  sb.resolve_image("e2e.local/host"))  # fmt: skip


def test_a_checkout_under_tmp_is_bound_back_over_the_pods_tmp(monkeypatch):
    # A clone under /tmp with its venv inside: the pod's /tmp volume (a tmpfs) would hide
    # both, so the image's folders are bound read-only after the volumes.
    monkeypatch.setattr(sb, "ROOT", Path("/tmp/clone"))
    monkeypatch.setattr(sys, "prefix", "/tmp/clone/.venv")
    image = sb.resolve_image("ghcr.io/sluice-dev/sluice-server:0.1.0")
    assert image.paths == ("/tmp/clone",)
    monkeypatch.setattr(sys, "prefix", "/opt/venv")
    image = sb.resolve_image("ghcr.io/sluice-dev/sluice-server:0.1.0")
    assert image.paths == ("/tmp/clone", "/opt/venv")
    box = sb.Sandbox([sys.executable, "-m", "sluice_server"], 65532, 65532,
                     [sb.Mount("/tmp", None, size=2**20), sb.Mount("/cache", Path("/v/cache"))],
                     image_paths=image.paths)  # fmt: skip
    argv = box.bwrap_argv()
    tmpfs = argv.index("/tmp", argv.index("--tmpfs"))
    clone = argv.index("/tmp/clone")
    assert argv[clone - 1 : clone + 2] == ["--ro-bind", "/tmp/clone", "/tmp/clone"]
    assert argv[clone + 2 : clone + 5] == ["--ro-bind", "/opt/venv", "/opt/venv"]
    assert tmpfs < clone < argv.index("--")
    assert box.mount_points() == ["/tmp", "/cache"]  # the image's folders exist already
    assert sb.outermost(["/a/b", "/a", "/a", "/c/", "/c/d"]) == ("/a", "/c/")


def test_projection_swaps_data_atomically_like_the_kubelet(tmp_path):
    p = sb.Projection(tmp_path / "vol", "secret", "keys", [{"key": "token", "path": "t"}], 0o440)
    assert p.write({"token": b"one"})
    first = os.readlink(tmp_path / "vol" / "..data")
    assert os.readlink(tmp_path / "vol" / "t") == "..data/t"
    assert (tmp_path / "vol" / "t").read_bytes() == b"one"
    assert not p.write({"token": b"one"})  # no change, no new folder
    assert p.write({"token": b"two"})
    assert os.readlink(tmp_path / "vol" / "..data") != first
    assert not (tmp_path / "vol" / first).exists()  # the old set is gone
    assert (tmp_path / "vol" / "t").read_bytes() == b"two" and p.updates == 1
    with pytest.raises(sb.ConfigError, match='key "token" not in secret'):
        p.write({"other": b"x"})


def test_kv_events_endpoints_bind_the_pod_address_and_stay_binds_for_vllm():
    img = sb.resolve_image("ghcr.io/sluice-dev/sluice-server:0.1.0")
    config = ('{"enable_kv_cache_events":true,"endpoint":"tcp://*:5557",'
              '"publisher":"zmq","replay_endpoint":"tcp://*:5558"}')  # fmt: skip
    c = {"name": "server", "command": ["sluice-server"],
         "args": ["--", "--enable-prefix-caching", "--kv-events-config", config]}  # fmt: skip
    argv = sb.container_argv(c, img, {}, "127.1.0.7")
    got = json.loads(argv[-1])
    assert got["endpoint"] == "tcp://[::ffff:127.1.0.7]:5557"
    assert got["replay_endpoint"] == "tcp://[::ffff:127.1.0.7]:5558"
    assert got["publisher"] == "zmq" and got["enable_kv_cache_events"] is True
    # vLLM binds an endpoint holding `*` or `::` and connects to any other: still a bind.
    assert "::" in got["endpoint"] and argv[-2] == "--kv-events-config"
    # The `=` form, `[::]`, and an endpoint that names a host (a connect: left alone).
    eq = '--kv-events-config={"endpoint":"tcp://[::]:6000","replay_endpoint":"tcp://10.0.0.1:1"}'
    (out,) = sb.container_argv({"name": "c", "command": ["/bin/echo"], "args": [eq]},
                               sb.resolve_image(HOST), {}, "127.1.0.8")[1:]  # fmt: skip
    assert json.loads(out.split("=", 1)[1]) == {"endpoint": "tcp://[::ffff:127.1.0.8]:6000",
                                                "replay_endpoint": "tcp://10.0.0.1:1"}  # fmt: skip
    assert sb.zmq_own_endpoint("tcp://*:5557", "127.1.0.9") == "tcp://[::ffff:127.1.0.9]:5557"
    assert sb.zmq_own_endpoint("ipc:///tmp/x", "127.1.0.9") == "ipc:///tmp/x"


def test_zmq_binds_the_mapped_pod_address_so_two_pods_share_a_port():
    zmq = pytest.importorskip("zmq")
    ctx = zmq.Context()
    socks = []
    try:
        for ip in ("127.1.251.1", "127.1.251.2"):  # two pods, one fixed port
            pub = ctx.socket(zmq.PUB)
            socks.append(pub)
            pub.bind(sb.zmq_own_endpoint("tcp://*:0", ip))
            assert pub.getsockopt_string(zmq.LAST_ENDPOINT).startswith(f"tcp://{ip}:")
        port = socks[0].getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1]
        other = ctx.socket(zmq.PUB)
        socks.append(other)
        other.bind(sb.zmq_own_endpoint(f"tcp://*:{port}", "127.1.251.3"))  # no collision
    finally:
        for sock in socks:
            sock.close(linger=0)
        ctx.term()


def test_every_container_gets_the_api_servers_address():
    c = {"name": "c", "env": [{"name": "URL",
                               "value": "https://$(KUBERNETES_SERVICE_HOST):$(KUBERNETES_SERVICE_PORT)"}]}  # fmt: skip
    env = sb.container_env(c, _pod([c]), sb.resolve_image(HOST), _lookup, "127.1.0.9",
                           "127.0.0.1", sb.api_server_env("127.0.0.1", 6443))  # fmt: skip
    assert env["KUBERNETES_SERVICE_HOST"] == "127.0.0.1"
    assert env["KUBERNETES_SERVICE_PORT"] == env["KUBERNETES_SERVICE_PORT_HTTPS"] == "6443"
    assert env["KUBERNETES_PORT_6443_TCP"] == "tcp://127.0.0.1:6443"
    assert env["URL"] == "https://127.0.0.1:6443"  # defined before the container's own env
    mine = {"name": "c", "env": [{"name": "KUBERNETES_SERVICE_HOST", "value": "elsewhere"}]}
    env = sb.container_env(mine, _pod([mine]), sb.resolve_image(HOST), _lookup, "", "",
                           sb.api_server_env("127.0.0.1", 6443))  # fmt: skip
    assert env["KUBERNETES_SERVICE_HOST"] == "elsewhere"  # the container's env wins


def test_downward_api_env_fields():
    c = {"name": "c", "env": [
        {"name": n, "valueFrom": {"fieldRef": {"fieldPath": f}}} for n, f in (
            ("IP", "status.podIP"), ("NAME", "metadata.name"), ("NS", "metadata.namespace"),
            ("SA", "spec.serviceAccountName"), ("NODE", "spec.nodeName"),
            ("APP", "metadata.labels['app']"), ("HOST_IP", "status.hostIP"))]}  # fmt: skip
    pod = _pod([c], serviceAccountName="router", nodeName="n1")
    pod["metadata"]["labels"] = {"app": "sluice"}
    env = sb.container_env(c, pod, sb.resolve_image(HOST), _lookup, "127.1.0.9", "127.0.0.1")
    assert [env[k] for k in ("IP", "NAME", "NS", "SA", "NODE", "APP", "HOST_IP")] == [
        "127.1.0.9", "p", "ns", "router", "n1", "sluice", "127.0.0.1"]  # fmt: skip


# The volume the ServiceAccount admission plugin adds to a pod (kube-apiserver 1.33).
KUBE_API_ACCESS = {"name": "kube-api-access-x7k2p", "projected": {"defaultMode": 420, "sources": [
    {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
    {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
    {"downwardAPI": {"items": [{"path": "namespace", "fieldRef": {
        "apiVersion": "v1", "fieldPath": "metadata.namespace"}}]}}]}}  # fmt: skip
SA_MOUNT = {"name": "kube-api-access-x7k2p", "readOnly": True,
            "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount"}  # fmt: skip
CA = b"-----BEGIN CERTIFICATE-----\ntest CA\n-----END CERTIFICATE-----\n"


class Tokens:
    """A TokenRequest stand-in: token n, valid `seconds` from the clock."""

    def __init__(self, clock) -> None:
        self.clock, self.asked = clock, []

    def __call__(self, audience, seconds):
        self.asked.append((audience, seconds))
        return f"token-{len(self.asked)}", self.clock() + seconds


def test_projected_service_account_volume_is_token_ca_and_namespace(tmp_path):
    now = [1000.0]
    tokens = Tokens(lambda: now[0])
    objects = {("configmap", "ns", "kube-root-ca.crt"): {"ca.crt": CA}}
    v = sb.ProjectedVolume(tmp_path / "sa", KUBE_API_ACCESS["projected"]["sources"], 420,
                           _pod([]), "127.1.0.9", "127.0.0.1", clock=lambda: now[0])  # fmt: skip
    lookup = lambda kind, ns, name: objects.get((kind, ns, name))  # noqa: E731
    assert v.refresh(lookup, tokens)
    root = tmp_path / "sa"
    assert (root / "token").read_text() == "token-1"
    assert (root / "ca.crt").read_bytes() == CA
    assert (root / "namespace").read_text() == "ns"
    assert os.readlink(root / "token") == "..data/token"
    assert oct((root / "token").stat().st_mode & 0o777) == oct(0o644)
    assert tokens.asked == [(None, 3607)]  # the API server's audience, the projection's TTL
    now[0] += 0.79 * 3607  # within 80% of its lifetime: the same token, no new folder
    assert not v.refresh(lookup, tokens) and len(tokens.asked) == 1
    now[0] += 0.02 * 3607  # past 80%: the kubelet's token manager mints a new one
    assert v.refresh(lookup, tokens) and (root / "token").read_text() == "token-2"
    # A day-long token is minted again after a day at most, not at 80% of a year.
    year = {"serviceAccountToken": {"expirationSeconds": 365 * 86400, "path": "t",
                                    "audience": "vault"}}  # fmt: skip
    y = sb.ProjectedVolume(tmp_path / "y", [year], 420, _pod([]), "", "", clock=lambda: now[0])
    y.refresh(lookup, tokens)
    now[0] += 86400 + 1
    y.refresh(lookup, tokens)
    assert tokens.asked[-2:] == [("vault", 365 * 86400)] * 2
    # kube-root-ca.crt not published yet: the volume cannot be made (the pod waits).
    with pytest.raises(sb.ConfigError, match='configmap "kube-root-ca.crt" not found'):
        sb.ProjectedVolume(tmp_path / "z", KUBE_API_ACCESS["projected"]["sources"], 420,
                           _pod([]), "", "").refresh(lambda *a: None, tokens)  # fmt: skip
    with pytest.raises(sb.ConfigError, match="not supported"):
        sb.ProjectedVolume(tmp_path / "w", [{"clusterTrustBundle": {"path": "b"}}], 420,
                           _pod([]), "", "").refresh(lookup, tokens)  # fmt: skip


# --- live, under bubblewrap ----------------------------------------------------------
live = pytest.mark.skipif(sb.sandbox_problem() is not None, reason=str(sb.sandbox_problem()))


class FakeHost:
    host_ip = "127.0.0.1"
    cpus = None
    api_server = ("127.0.0.1", 6443)

    def __init__(self, root: Path) -> None:
        self.log_dir = root / "logs"
        self.log_dir.mkdir(parents=True)
        self.root = root
        self.statuses: list[dict] = []
        self.exits: list[tuple[str, int, str]] = []
        self.objects = dict(SECRETS)
        self.tokens: list[tuple[str, str | None, int]] = []  # (pod uid, audience, seconds)

    def lookup(self, kind, ns, name):
        return self.objects.get((kind, ns, name))

    def pvc_dir(self, ns, claim):
        path = self.root / "claims" / claim
        path.mkdir(parents=True, exist_ok=True)
        return path

    def patch_status(self, pod, status):
        self.statuses.append(status["status"])

    def record_exit(self, pod, container, code, why):
        self.exits.append((container, code, why))

    def service_account_token(self, pod, audience, seconds):
        self.tokens.append((pod["metadata"]["uid"], audience, seconds))
        sa = pod["spec"].get("serviceAccountName", "default")
        return f"jwt-of-{sa}-{len(self.tokens)}", time.time() + seconds


# How long a pod under bubblewrap may take to do what a test waits for (generous: the
# machine may be busy; a wait that succeeds returns at once).
WAIT_S = 60.0


HOST = "e2e.local/host"
# PID 1 of its sandbox: says who it is, shows its mounts work, drains on SIGTERM. (`$$$$`:
# the kubelet expands `$$` to `$` in commands, so the shell sees `$$`.)
SCRIPT = r"""
echo "pid=$$$$ uid=$(id -u) token=$TOKEN"
touch /rootfs-write 2>/dev/null && echo "root writable" || echo "root read-only"
echo hello > /mnt/e2e/data/out && touch /mnt/e2e/work/ready
trap 'echo "TERM received"; sleep 0.3; echo drained; exit 0' TERM
while true; do sleep 0.1; done
"""


@live
def test_a_pod_runs_as_its_spec_says_and_drains_on_deletion(tmp_path):
    host = FakeHost(tmp_path)
    c = {"name": "app", "image": HOST, "command": ["/bin/sh", "-c", SCRIPT],
         "env": [{"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "keys", "key": "token"}}}],
         "securityContext": {"runAsUser": 65532, "readOnlyRootFilesystem": True},
         "volumeMounts": [{"name": "work", "mountPath": "/mnt/e2e/work"},
                          {"name": "claim", "mountPath": "/mnt/e2e/data"},
                          {"name": "keys", "mountPath": "/mnt/e2e/keys", "readOnly": True}],
         "readinessProbe": {"exec": {"command": ["test", "-f", "/mnt/e2e/work/ready"]},
                            "periodSeconds": 1},
         "lifecycle": {"preStop": {"sleep": {"seconds": 1}}}}  # fmt: skip
    volumes = [{"name": "work", "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}},
               {"name": "claim", "persistentVolumeClaim": {"claimName": "data"}},
               {"name": "keys", "secret": {"secretName": "keys"}}]  # fmt: skip
    pod = PodRuntime(_pod([c], volumes), "127.1.250.1", host, tmp_path / "pods").start()
    try:

        def reported_ready():
            last = host.statuses[-1] if host.statuses else {"conditions": []}
            conds = {c["type"]: c["status"] for c in last["conditions"]}
            return conds.get("Ready") == "True" and last

        status = eventually(reported_ready, timeout=WAIT_S, message="the pod reported Ready")
        assert status["phase"] == "Running" and status["podIP"] == "127.1.250.1"
        log = host.log_dir / "ns.p.app.log"
        assert "pid=1 uid=65532 token=s3cret" in log.read_text()
        assert "root read-only" in log.read_text()
        assert (host.pvc_dir("ns", "data") / "out").read_text() == "hello\n"
        # The Secret changes: the file inside changes, through the ..data swap.
        host.objects[("secret", "ns", "keys")] = {"token": b"rotated"}
        assert pod.refresh_projections() == 1
        box = pod.container("app")
        got = subprocess.run(["nsenter", "-t", str(box.pid1()), "-U", "-m",
                              "--preserve-credentials", "cat", "/mnt/e2e/keys/token"],
                             capture_output=True, text=True)  # fmt: skip
        assert got.stdout == "rotated"
        started = time.monotonic()
        pod.terminate(grace=10)
        assert time.monotonic() - started >= 1.0  # the preStop sleep came first
    finally:
        pod.kill_now()
    assert host.exits == [("app", 0, "Completed")]
    assert "TERM received" in log.read_text() and "drained" in log.read_text()
    final = host.statuses[-1]
    assert final["phase"] == "Succeeded"
    assert final["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 0


@live
def test_readiness_is_probed_the_moment_the_startup_probe_passes(tmp_path):
    """As the kubelet's prober manager does (a manual trigger of the readiness worker), not a
    readiness period later: with a 30 s readiness period, the first readiness probe runs
    within a few seconds of the startup probe's pass. Each probe records when it ran (its
    own clock, in the container), and the test reads those records."""
    host = FakeHost(tmp_path)
    probe = "date +%s.%N >> /mnt/e2e/work/{0}; test -f /mnt/e2e/work/up"
    c = {"name": "app", "image": HOST,
         "command": ["/bin/sh", "-c", "sleep 2; touch /mnt/e2e/work/up; while true; do sleep 0.1; done"],
         "volumeMounts": [{"name": "work", "mountPath": "/mnt/e2e/work"}],
         "startupProbe": {"exec": {"command": ["/bin/sh", "-c", probe.format("startup")]},
                          "periodSeconds": 1, "failureThreshold": 60},
         "readinessProbe": {"exec": {"command": ["/bin/sh", "-c", probe.format("readiness")]},
                            "periodSeconds": 30}}  # fmt: skip
    volumes = [{"name": "work", "persistentVolumeClaim": {"claimName": "probes"}}]
    pod = PodRuntime(_pod([c], volumes), "127.1.250.5", host, tmp_path / "pods").start()
    work = host.pvc_dir("ns", "probes")
    try:
        runs = {}

        def probed():
            for kind in ("startup", "readiness"):
                f = work / kind
                runs[kind] = [float(t) for t in f.read_text().split()] if f.exists() else []
            return runs["readiness"]

        eventually(probed, timeout=WAIT_S, message="a readiness probe ran")
        assert runs["readiness"][0] - runs["startup"][-1] < 10  # not the 30 s period
    finally:
        pod.kill_now()


@live
def test_sigterm_ignored_means_sigkill_at_the_grace_period(tmp_path):
    host = FakeHost(tmp_path)
    c = {"name": "stubborn", "image": HOST, "command": ["/bin/sh", "-c",
         "trap '' TERM; while true; do sleep 0.1; done"]}  # fmt: skip
    pod = PodRuntime(_pod([c]), "127.1.250.2", host, tmp_path / "pods").start()
    try:
        eventually(lambda: pod.container("stubborn").pid1(), timeout=WAIT_S,
                   message="the container's PID 1")  # fmt: skip
        started = time.monotonic()
        pod.terminate(grace=1.5)
        assert time.monotonic() - started >= 1.5
    finally:
        pod.kill_now()
    assert host.exits == [("stubborn", 137, "Error")]
    assert host.statuses[-1]["phase"] == "Failed"


@live
def test_liveness_failure_restarts_and_exits_restart_per_policy(tmp_path):
    host = FakeHost(tmp_path)
    # Alive while /mnt/e2e/work/wedged is absent (an emptyDir survives a container restart,
    # as in a pod): the container never touches that file, so the probe's verdict does not
    # depend on how fast the shell starts. Each start appends a line to `starts`: the record
    # the test waits on. The probe's timeout is generous: a slow nsenter under load is not a
    # failed probe in this test.
    live_c = {"name": "wedges", "image": HOST, "command": ["/bin/sh", "-c",
              "trap 'exit 0' TERM; echo started >> /mnt/e2e/work/starts;"
              " while true; do sleep 0.1; done"],
              "volumeMounts": [{"name": "work", "mountPath": "/mnt/e2e/work"}],
              "livenessProbe": {"exec": {"command": ["test", "!", "-f", "/mnt/e2e/work/wedged"]},
                                "periodSeconds": 1, "failureThreshold": 2,
                                "timeoutSeconds": 10}}  # fmt: skip
    crash = {"name": "crashes", "image": HOST, "command": ["/bin/sh", "-c", "exit 3"]}
    pod = PodRuntime(_pod([live_c, crash], [{"name": "work", "emptyDir": {}}]),
                     "127.1.250.3", host, tmp_path / "pods").start()  # fmt: skip
    work = pod.dir / "volumes" / "work"

    def starts() -> int:
        path = work / "starts"
        return len(path.read_text().splitlines()) if path.exists() else 0

    try:
        wedges = pod.container("wedges")
        eventually(lambda: starts() == 1, timeout=WAIT_S, message="the container ran")
        (work / "wedged").touch()  # the process wedges
        eventually(lambda: wedges.restart_count >= 1 and starts() >= 2, timeout=WAIT_S,
                   message="the wedged container restarted")  # fmt: skip
        # The crashing container: restarted at once, then held by the 10 s back-off.
        eventually(lambda: pod.container("crashes").state.get("waiting", {}).get("reason")
                   == "CrashLoopBackOff", timeout=WAIT_S, message="CrashLoopBackOff")  # fmt: skip
    finally:
        pod.kill_now()
    assert [e for e in host.exits if e[0] == "wedges"][0] == ("wedges", 0, "LivenessProbeFailed")
    assert [e for e in host.exits if e[0] == "crashes"][:2] == [("crashes", 3, "Error")] * 2


@live
def test_the_termination_message_is_what_the_container_wrote_there(tmp_path):
    """As the kubelet: the file at terminationMessagePath becomes `terminated.message` (a
    Job's result reaches its owner this way); with FallbackToLogsOnError a failure that
    wrote none gets the log's tail, and a success never does."""
    host = FakeHost(tmp_path)
    wrote = {"name": "wrote", "image": HOST, "command": ["/bin/sh",
             "-c", 'echo noise; printf \'{"outcome": "ready"}\' > /dev/termination-log']}  # fmt: skip
    custom = {"name": "custom", "image": HOST, "terminationMessagePath": "/dev/result",
              "command": ["/bin/sh", "-c", "printf done > /dev/result; exit 2"]}  # fmt: skip
    fallback = {"name": "fallback", "image": HOST, "terminationMessagePolicy":
                "FallbackToLogsOnError", "command": ["/bin/sh", "-c", "echo it broke; exit 1"]}  # fmt: skip
    quiet = {"name": "quiet", "image": HOST, "terminationMessagePolicy":
             "FallbackToLogsOnError", "command": ["/bin/sh", "-c", "echo fine"]}  # fmt: skip
    pod = PodRuntime(_pod([wrote, custom, fallback, quiet], restartPolicy="Never"),
                     "127.1.250.9", host, tmp_path / "pods").start()  # fmt: skip
    try:

        def ended():
            last = host.statuses[-1] if host.statuses else {}
            states = {c["name"]: c["state"] for c in last.get("containerStatuses") or []}
            return all("terminated" in st for st in states.values()) and len(states) == 4 and states

        states = eventually(ended, timeout=WAIT_S, message="the four containers ended")
    finally:
        pod.kill_now()
    msgs = {name: st["terminated"].get("message") for name, st in states.items()}
    assert json.loads(msgs["wrote"]) == {"outcome": "ready"}
    assert msgs["custom"] == "done" and states["custom"]["terminated"]["exitCode"] == 2
    assert msgs["fallback"] == "it broke"
    assert msgs["quiet"] is None


@live
def test_the_images_folders_show_through_a_tmpfs_tmp(tmp_path, monkeypatch):
    # tmp_path is under /tmp: an "image" holding a folder there, a pod with a tmpfs /tmp.
    held = tmp_path / "image"
    held.mkdir()
    (held / "code.txt").write_text("the code under test")
    image = sb.Image(HOST, {}, {"PATH": "/usr/bin:/bin"}, paths=(str(held),))
    monkeypatch.setattr(sb, "resolve_image", lambda name: image)
    host = FakeHost(tmp_path / "host")
    c = {"name": "reads", "image": HOST, "command": ["/bin/sh", "-c",
         f"cat {held}/code.txt; touch /tmp/scratch && echo tmp-writable"],
         "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}]}  # fmt: skip
    pod = PodRuntime(_pod([c], [{"name": "tmp", "emptyDir": {"medium": "Memory"}}],
                          restartPolicy="Never"),
                     "127.1.250.5", host, tmp_path / "pods").start()  # fmt: skip
    try:
        eventually(lambda: host.exits, timeout=WAIT_S, message="the container exited")
    finally:
        pod.kill_now()
    log = (host.log_dir / "ns.p.reads.log").read_text()
    assert host.exits == [("reads", 0, "Completed")], log
    assert "the code under test" in log and "tmp-writable" in log


@live
def test_unknown_image_and_missing_secret_are_reported_not_crashed(tmp_path):
    host = FakeHost(tmp_path)
    pod = PodRuntime(_pod([{"name": "a", "image": "nginx:1.27"},
                           {"name": "b", "image": HOST, "command": ["/bin/true"],
                            "env": [{"name": "X", "valueFrom": {"secretKeyRef": {
                                "name": "absent", "key": "k"}}}]}]),
                     "127.1.250.4", host, tmp_path / "pods").start()  # fmt: skip
    try:
        eventually(lambda: host.statuses, timeout=WAIT_S, message="a status patch")
    finally:
        done = threading.Thread(target=pod.terminate, args=(1,))
        done.start()
        done.join(10)
    states = {c["name"]: c["state"] for c in host.statuses[0]["containerStatuses"]}
    assert states["a"]["waiting"]["reason"] == "ErrImagePull"
    assert "has no local mapping" in states["a"]["waiting"]["message"]
    assert states["b"]["waiting"]["reason"] == "CreateContainerConfigError"
    assert 'secret "absent" not found' in states["b"]["waiting"]["message"]


@live
def test_a_pod_reads_its_service_account_volume_and_finds_the_api_server(tmp_path):
    """What the router pod needs: the admission plugin's projected volume at its path
    (through the host's /var/run -> /run symlink), read-only, and the API server's address."""
    host = FakeHost(tmp_path)
    host.objects[("configmap", "ns", "kube-root-ca.crt")] = {"ca.crt": CA}
    sa = "/var/run/secrets/kubernetes.io/serviceaccount"
    c = {"name": "reads", "image": HOST, "command": ["/bin/sh", "-c",
         f"echo token=$(cat {sa}/token) ns=$(cat {sa}/namespace);"
         f" grep -c 'test CA' {sa}/ca.crt; echo api=$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT;"
         f" touch {sa}/x 2>/dev/null && echo writable || echo read-only"],
         "volumeMounts": [SA_MOUNT]}  # fmt: skip
    pod = PodRuntime(_pod([c], [KUBE_API_ACCESS], restartPolicy="Never",
                          serviceAccountName="router"),
                     "127.1.250.6", host, tmp_path / "pods").start()  # fmt: skip
    try:
        eventually(lambda: host.exits, timeout=WAIT_S, message="the container exited")
    finally:
        pod.kill_now()
    log = (host.log_dir / "ns.p.reads.log").read_text()
    assert host.exits == [("reads", 0, "Completed")], log
    assert "token=jwt-of-router-1 ns=ns" in log and "\n1\n" in log, log
    assert "api=127.0.0.1:6443" in log and "read-only" in log, log
    assert host.tokens == [("0123456789abcdef", None, 3607)]
    argv = pod.container("reads").sandbox.bwrap_argv()
    target = os.path.realpath(sa)  # /run/... where /var/run is a link to /run
    i = argv.index(target)
    assert argv[i - 2] == "--ro-bind" and argv[i - 1] == str(pod.dir / "volumes" /
                                                             KUBE_API_ACCESS["name"])  # fmt: skip


def test_a_condition_the_api_server_set_keeps_its_time_while_its_status_stays(tmp_path):
    # The binding set PodScheduled; the node's first status must not restamp it (the
    # cold-start table reads "scheduled" from it, and a later stamp put it after the
    # container's start).
    bound = "2026-12-05T12:00:00Z"
    pod = _pod([{"name": "c", "image": "e2e.local/host"}])
    pod["status"] = {"conditions": [{"type": "PodScheduled", "status": "True",
                                     "lastTransitionTime": bound}]}  # fmt: skip
    runtime = PodRuntime(pod, "127.1.250.9", FakeHost(tmp_path), tmp_path / "pods")
    status = {"conditions": {"PodScheduled": "True", "Ready": "False"}}
    times = {c["type"]: c["lastTransitionTime"] for c in runtime._stamped(status)["conditions"]}
    assert times["PodScheduled"] == bound and times["Ready"] != bound
    # A status that changes gets the node's time, as the kubelet gives it.
    status = {"conditions": {"PodScheduled": "False", "Ready": "False"}}
    times = {c["type"]: c["lastTransitionTime"] for c in runtime._stamped(status)["conditions"]}
    assert times["PodScheduled"] != bound
