"""etcd + kube-apiserver + kube-controller-manager + kube-scheduler on 127.0.0.1.

The envtest idea (controller-runtime takes binaries from KUBEBUILDER_ASSETS) plus the two
components envtest leaves out, because the things users hit live there: the scheduler
(pods that do not fit) and the controller manager (Deployments -> ReplicaSets -> Pods,
garbage collection through owner references, namespace deletion, service accounts).

Security is the real thing, scaled down: TLS everywhere, client certificates per
component, RBAC authorization (so a missing verb in the operator's ClusterRole fails),
a service-account signing key, and an audit log to count who wrote what.

Suites that need more say so through public options, never by overriding methods:
`extra_args` appends flags to a component's command line, and `front_proxy_user` turns on
the API aggregation layer's request-header authentication (a front-proxy CA and a client
certificate kube-apiserver presents to extension API servers, as kubeadm sets it up).
"""

from __future__ import annotations

import json
import os
import shutil
import ssl
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from testkit.net import free_port, wait_http
from testkit.process import ManagedProcess

from .kubeconfig import write_kubeconfig
from .pki import CertificateAuthority, service_account_keys

BINARIES = ("kube-apiserver", "kube-controller-manager", "kube-scheduler")
COMPONENTS = ("etcd", *BINARIES)
ASSETS_HELP = (
    "set K8S_ASSETS to a folder with kube-apiserver, kube-controller-manager, "
    "kube-scheduler; see docs/e2e.md"
)
WRITE_VERBS = frozenset({"create", "update", "patch", "delete", "deletecollection"})

# Metadata-level audit of every write, plus every call (reads and watches too) of the
# ServiceAccounts in `watched_namespace` (the operator's), nothing else: enough to count the
# operator's calls per object without making the log large.
_AUDIT_POLICY = """\
apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: ["RequestReceived"]
rules:
  - level: Metadata
    userGroups: ["system:serviceaccounts:{watched_namespace}"]
  - level: Metadata
    verbs: ["create", "update", "patch", "delete", "deletecollection"]
  - level: None
"""


def missing_prerequisites(assets: str | None = None) -> str | None:
    """Why the control plane cannot start here, or None when it can."""
    assets = assets if assets is not None else os.environ.get("K8S_ASSETS", "")
    if not assets or not all(os.access(Path(assets, b), os.X_OK) for b in BINARIES):
        return ASSETS_HELP
    if not shutil.which("etcd"):
        return "etcd not found on PATH (Debian: apt-get install etcd-server); see docs/e2e.md"
    return None


@dataclass
class ControlPlane:
    """A whole control plane in `workdir`; `start()` returns once every part is healthy."""

    workdir: Path
    assets: Path
    service_cidr: str = "10.0.0.0/24"
    # Every call of the ServiceAccounts in this namespace is audited (the operator's).
    audited_namespace: str = "sluice-system"
    # Flags appended to a component's command line, by component name (COMPONENTS).
    extra_args: Mapping[str, Sequence[str]] = field(default_factory=dict)
    # When set, kube-apiserver authenticates to extension API servers (APIService) with a
    # client certificate for this user, signed by a front-proxy CA of its own
    # (`front_proxy_ca`, `proxy_client`); extension servers trust that CA for the
    # X-Remote-User/X-Remote-Group headers.
    front_proxy_user: str | None = None
    processes: list[ManagedProcess] = field(default_factory=list)
    startup_seconds: float | None = None

    def __post_init__(self) -> None:
        if unknown := set(self.extra_args) - set(COMPONENTS):
            raise ValueError(
                f"extra_args for unknown components {sorted(unknown)}; known: {COMPONENTS}"
            )
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.pki_dir = self.workdir / "pki"
        self.logs = self.workdir / "logs"
        self.logs.mkdir(exist_ok=True)
        self.audit_log = self.logs / "audit.jsonl"
        self.port = free_port()
        self.url = f"https://127.0.0.1:{self.port}"

    # --- identities -------------------------------------------------------------------
    def _make_pki(self) -> None:
        self.ca = CertificateAuthority(self.pki_dir)
        self.serving = self.ca.serving(
            "apiserver",
            dns=[
                "localhost",
                "kubernetes",
                "kubernetes.default",
                "kubernetes.default.svc",
                "kubernetes.default.svc.cluster.local",
            ],
            ips=["127.0.0.1", "10.0.0.1"],
        )
        self.sa_keys = service_account_keys(self.pki_dir)
        self.kubeconfigs: dict[str, Path] = {}
        for name, user, groups in (
            ("admin", "e2e-admin", ("system:masters",)),
            ("controller-manager", "system:kube-controller-manager", ()),
            ("scheduler", "system:kube-scheduler", ()),
        ):
            files = self.ca.client(name, user, groups)
            self.kubeconfigs[name] = write_kubeconfig(
                self.workdir / f"{name}.kubeconfig",
                self.url,
                self.ca.cert_path,
                user,
                cert=files.cert,
                key=files.key,
            )
        self.admin_cert = self.ca.client("admin-probe", "e2e-admin", ("system:masters",))
        if self.front_proxy_user:
            self.front_proxy_ca = CertificateAuthority(
                self.pki_dir / "front-proxy", name="front-proxy-ca"
            )
            self.proxy_client = self.front_proxy_ca.client(
                "front-proxy-client", self.front_proxy_user
            )

    def _front_proxy_args(self) -> list[str]:
        if not self.front_proxy_user:
            return []
        return [
            "--requestheader-client-ca-file", str(self.front_proxy_ca.cert_path),
            "--requestheader-allowed-names", self.front_proxy_user,
            "--requestheader-username-headers", "X-Remote-User",
            "--requestheader-group-headers", "X-Remote-Group",
            "--requestheader-extra-headers-prefix", "X-Remote-Extra-",
            "--proxy-client-cert-file", str(self.proxy_client.cert),
            "--proxy-client-key-file", str(self.proxy_client.key),
        ]  # fmt: skip

    def token_kubeconfig(self, name: str, user: str, token: str) -> Path:
        """A kubeconfig for a bearer token (e.g. a ServiceAccount's)."""
        return write_kubeconfig(
            self.workdir / f"{name}.kubeconfig", self.url, self.ca.cert_path, user, token=token
        )

    def client_kubeconfig(self, name: str, user: str) -> Path:
        """A kubeconfig for a client certificate of `user` (RBAC decides what it may do)."""
        files = self.ca.client(name, user)
        return write_kubeconfig(
            self.workdir / f"{name}.kubeconfig",
            self.url,
            self.ca.cert_path,
            user,
            cert=files.cert,
            key=files.key,
        )

    # --- processes --------------------------------------------------------------------
    def _spawn(self, name: str, argv: list[str]) -> ManagedProcess:
        argv = [*argv, *self.extra_args.get(name, ())]
        proc = ManagedProcess(name, argv, self.logs).start()
        self.processes.append(proc)
        return proc

    def start(self, timeout: float = 60.0) -> ControlPlane:
        began = time.monotonic()
        try:
            self._make_pki()
            self._start_etcd()
            self._start_apiserver()
            self._wait_healthy(
                self.url + "/readyz", self.processes[-1], began + timeout, client=True
            )
            self._start_controller_manager()
            self._start_scheduler()
            for proc, port in (
                (self.processes[-2], self.kcm_port),
                (self.processes[-1], self.scheduler_port),
            ):
                self._wait_healthy(f"https://127.0.0.1:{port}/healthz", proc, began + timeout)
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - began
        return self

    def _start_etcd(self) -> None:
        client, peer = free_port(), free_port()
        self.etcd_url = f"http://127.0.0.1:{client}"
        self._spawn(
            "etcd",
            [
                shutil.which("etcd") or "etcd",
                "--data-dir",
                str(self.workdir / "etcd"),
                "--listen-client-urls",
                self.etcd_url,
                "--advertise-client-urls",
                self.etcd_url,
                "--listen-peer-urls",
                f"http://127.0.0.1:{peer}",
                "--initial-advertise-peer-urls",
                f"http://127.0.0.1:{peer}",
                "--initial-cluster",
                f"default=http://127.0.0.1:{peer}",
                "--unsafe-no-fsync",  # throw-away data: fsync only slows tests down
                "--logger",
                "zap",
                "--log-level",
                "warn",
            ],
        )

    def _start_apiserver(self) -> None:
        policy = self.workdir / "audit-policy.yaml"
        policy.write_text(_AUDIT_POLICY.format(watched_namespace=self.audited_namespace))
        self._spawn(
            "kube-apiserver",
            [
                str(self.assets / "kube-apiserver"),
                "--etcd-servers",
                self.etcd_url,
                "--bind-address",
                "127.0.0.1",
                "--advertise-address",
                "127.0.0.1",
                "--secure-port",
                str(self.port),
                "--tls-cert-file",
                str(self.serving.cert),
                "--tls-private-key-file",
                str(self.serving.key),
                "--client-ca-file",
                str(self.ca.cert_path),
                "--authorization-mode",
                "RBAC",
                "--service-account-issuer",
                "https://kubernetes.default.svc.cluster.local",
                "--service-account-key-file",
                str(self.sa_keys.cert),
                "--service-account-signing-key-file",
                str(self.sa_keys.key),
                "--service-cluster-ip-range",
                self.service_cidr,
                "--allow-privileged=true",
                # No kubelets answer on 10250 and the `kubernetes` Service may not point at loopback.
                "--endpoint-reconciler-type",
                "none",
                "--audit-policy-file",
                str(policy),
                "--audit-log-path",
                str(self.audit_log),
                "--audit-log-format",
                "json",
                "--audit-log-mode",
                "blocking",  # an event is in the file when the call returns
                "--profiling=false",
                *self._front_proxy_args(),
            ],
        )

    def _start_controller_manager(self) -> None:
        kubeconfig = str(self.kubeconfigs["controller-manager"])
        self.kcm_port = free_port()
        self._spawn(
            "kube-controller-manager",
            [
                str(self.assets / "kube-controller-manager"),
                "--kubeconfig",
                kubeconfig,
                "--authentication-kubeconfig",
                kubeconfig,
                "--authorization-kubeconfig",
                kubeconfig,
                "--bind-address",
                "127.0.0.1",
                "--secure-port",
                str(self.kcm_port),
                "--leader-elect=false",
                # Each controller acts as its own ServiceAccount, as in a real cluster.
                "--use-service-account-credentials=true",
                "--service-account-private-key-file",
                str(self.sa_keys.key),
                "--root-ca-file",
                str(self.ca.cert_path),
                "--service-cluster-ip-range",
                self.service_cidr,
                "--profiling=false",
            ],
        )

    def _start_scheduler(self) -> None:
        kubeconfig = str(self.kubeconfigs["scheduler"])
        self.scheduler_port = free_port()
        self._spawn(
            "kube-scheduler",
            [
                str(self.assets / "kube-scheduler"),
                "--kubeconfig",
                kubeconfig,
                "--authentication-kubeconfig",
                kubeconfig,
                "--authorization-kubeconfig",
                kubeconfig,
                "--bind-address",
                "127.0.0.1",
                "--secure-port",
                str(self.scheduler_port),
                "--leader-elect=false",
                "--profiling=false",
            ],
        )

    def _wait_healthy(
        self, url: str, proc: ManagedProcess, deadline: float, client: bool = False
    ) -> None:
        ctx = ssl.create_default_context(cafile=None if not client else str(self.ca.cert_path))
        if client:
            ctx.load_cert_chain(self.admin_cert.cert, self.admin_cert.key)
        else:  # kcm/scheduler serve a self-signed certificate; only health is asked here
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        # 500 while post-start hooks run counts as "not yet".
        wait_http(url, timeout=max(0.0, deadline - time.monotonic()), process=proc,
                  interval=0.1, context=ctx, what=f"{proc.name} health")  # fmt: skip

    def stop(self) -> None:
        for proc in reversed(self.processes):
            proc.stop()

    def pids(self) -> list[int]:
        return [p.pid for p in self.processes if p.pid]

    # --- audit ------------------------------------------------------------------------
    def audit_events(self, user: str | None = None, since: int = 0) -> list[dict]:
        """Audited calls (one per request, however many stages) from line `since` on."""
        events: dict[str, dict] = {}
        with self.audit_log.open() as f:
            for n, line in enumerate(f):
                if n < since:
                    continue
                event = json.loads(line)
                if user is None or event.get("user", {}).get("username") == user:
                    events[event["auditID"]] = event
        return list(events.values())

    def audit_mark(self) -> int:
        """A position in the audit log; pass it as `since` to see only later calls."""
        with self.audit_log.open() as f:
            return sum(1 for _ in f)


def is_write(event: dict) -> bool:
    return event["verb"] in WRITE_VERBS
