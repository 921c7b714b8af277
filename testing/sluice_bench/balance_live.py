"""The balancing benchmark's replicas as live pods: one StreamingModel with three simulator
replicas, deployed by the operator on a real control plane and reached through the e2e
ingress (testing/e2e_harness).

`LiveReplicas(workdir, sim).start()` brings up what tests/e2e's session fixtures do, in one
process tree: kube-apiserver, kube-controller-manager and kube-scheduler (K8S_ASSETS, etcd),
the CRD, the operator under the chart's RBAC, one live node agent (each pod's server runs
under bubblewrap on its own loopback address, as its rendered spec says) and the ingress
(nginx configured from the operator's Ingress and the Ready pods, applying the
`nginx.org/lb-method` directive the annotation asks for). The model is an F5-controller
Ingress (`spec.ingress.controller: f5-nginx`), so `spec.routing.balance` becomes that
annotation. `set_balance(b)` patches the model and returns once nginx runs the new method:
the operator rewrote the Ingress, the ingress re-rendered the upstream with the directive,
and the nginx worker that took that configuration is the only one left (SIGHUP starts new
workers; the old one exits once its connections are done). `servers` are the pods' own
addresses, for reading each one's /metrics directly.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import psutil
import yaml
from e2e_harness.control_plane import ControlPlane, missing_prerequisites
from e2e_harness.endpoints import Endpoint, ready_endpoints
from e2e_harness.ingress import IngressController
from e2e_harness.kube import CRD_FILE, Models, eventually, load_sample
from e2e_harness.node_agent import NodeAgent
from e2e_harness.operator_process import OperatorProcess, RenderedChart, install_operator_identity
from e2e_harness.sandbox import sandbox_problem
from kubernetes import client, config, utils
from sluice_operator.builders.ingress import LB_METHODS
from testkit.nginx import LB_DIRECTIVES, find_nginx

OPERATOR_NAMESPACE = "sluice-system"
NAMESPACE, NAME, PATH = "bench", "balance", "/balance"


def live_problem() -> str | None:
    """Why live pods cannot run here (None: they can)."""
    if reason := missing_prerequisites():
        return reason
    if find_nginx() is None:
        return "nginx not installed (apt-get install -y nginx)"
    return sandbox_problem()


def model_body(sim: dict, replicas: int, balance: str) -> dict:
    body = load_sample("simulator.yaml", NAMESPACE, new_name=NAME)
    s = body["spec"]
    s.pop("autoscaling", None)
    s["replicas"] = replicas
    s["engine"]["simulator"] = dict(sim)
    s["streaming"] = {"maxConcurrentStreams": 1000, "streamTimeoutSeconds": 600}
    s["ingress"] = {"enabled": True, "path": PATH, "controller": "f5-nginx"}
    s["routing"] = {"balance": balance}
    return body


class LiveReplicas:
    def __init__(self, workdir: Path, sim: dict, replicas: int = 3) -> None:
        self.workdir = Path(workdir)
        self.sim = sim
        self.replicas = replicas
        self._stack = contextlib.ExitStack()
        self.servers: list[str] = []

    def __enter__(self) -> LiveReplicas:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    @property
    def url(self) -> str:
        return self.ingress.url + PATH

    def start(self) -> LiveReplicas:
        try:
            self._start()
        except BaseException:
            self._stack.close()
            raise
        return self

    def _start(self) -> None:
        s = self._stack
        cp = ControlPlane(self.workdir / "cluster", Path(os.environ["K8S_ASSETS"]),
                          audited_namespace=OPERATOR_NAMESPACE).start()  # fmt: skip
        s.callback(cp.stop)
        api = config.new_client_from_config(config_file=str(cp.kubeconfigs["admin"]))
        core = client.CoreV1Api(api)
        eventually(lambda: core.read_namespaced_service_account("default", "default"),
                   timeout=60, message="the default ServiceAccount")  # fmt: skip
        crd = yaml.safe_load(CRD_FILE.read_text())
        utils.create_from_dict(api, crd)
        ext = client.ApiextensionsV1Api(api)
        eventually(lambda: any(c.type == "Established" and c.status == "True" for c in
                               ext.read_custom_resource_definition(crd["metadata"]["name"])
                               .status.conditions or []), timeout=30, message="the CRD")  # fmt: skip
        node = NodeAgent(api, "bench-node-0", gpus=8, cpu="16", run_pods=True,
                         workdir=cp.logs / "node").start()  # fmt: skip
        s.callback(node.stop)
        eventually(lambda: not any(t.effect == "NoSchedule" for t in
                                   core.read_node(node.name).spec.taints or []),
                   timeout=60, message="the node to lose its not-ready taint")  # fmt: skip
        chart = RenderedChart.render(OPERATOR_NAMESPACE)
        op = OperatorProcess(chart, install_operator_identity(api, cp, chart), cp.logs).start()
        s.callback(op.stop)
        self.ingress = IngressController(api, self.workdir / "ingress").start()
        s.callback(self.ingress.stop)
        self.core, self.models = core, Models(api)
        core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=NAMESPACE)))
        eventually(lambda: core.read_namespaced_service_account("default", NAMESPACE),
                   timeout=60, message="the default ServiceAccount")  # fmt: skip
        self.models.create(model_body(self.sim, self.replicas, "round-robin"))

        def all_ready() -> list[Endpoint]:
            eps = ready_endpoints(core, NAMESPACE, NAME)
            return eps if len(eps) == self.replicas else []

        eps = eventually(all_ready, timeout=180, interval=0.5, message="the replicas Ready")
        self.servers = [f"http://{e.address}" for e in eps]
        self.set_balance("round-robin")

    def _upstream_method(self) -> tuple[tuple[str, ...], str] | None:
        """(endpoints, directive) of the model's upstream in the ingress's last reload."""
        if not self.ingress.reloads:
            return None
        last = self.ingress.reloads[-1]
        mine = [k for k in last.endpoints if k.startswith(f"{NAMESPACE}_{NAME}_")]
        return (last.endpoints[mine[0]], last.methods[mine[0]]) if mine else None

    def _workers(self) -> set[int]:
        assert self.ingress.process is not None and self.ingress.process.pid is not None
        return {c.pid for c in psutil.Process(self.ingress.process.pid).children()}

    def set_balance(self, balance: str) -> str:
        """Patch `spec.routing.balance`; once nginx balances with it, the annotation's
        value (the F5 method)."""
        reloads, workers = len(self.ingress.reloads), self._workers()
        self.models.patch(NAMESPACE, NAME, {"spec": {"routing": {"balance": balance}}})

        def annotated():
            ing = self.models.networking.read_namespaced_ingress(NAME, NAMESPACE)
            return (ing.metadata.annotations or {}).get("nginx.org/lb-method")

        method = LB_METHODS["f5-nginx"][balance]
        eventually(lambda: annotated() == method, timeout=60, message=f"lb-method {method}")
        addresses = tuple(sorted(u.removeprefix("http://") for u in self.servers))
        want = (addresses, LB_DIRECTIVES[method])
        eventually(lambda: (got := self._upstream_method()) is not None
                   and (tuple(sorted(got[0])), got[1]) == want,
                   timeout=30, interval=0.2, message=f"the ingress to apply {method}")  # fmt: skip
        if len(self.ingress.reloads) == reloads:  # nginx already ran this configuration
            workers = set()
        # A worker started after the reload is the only one left: the method is in force.
        eventually(lambda: len(w := self._workers()) == 1 and not w & workers,
                   timeout=30, interval=0.2, message="nginx's new worker alone")  # fmt: skip
        return method
