"""An envtest-style harness: a real control plane on loopback, fake GPU nodes, the operator.

Reusable pieces, each in its own module:
- `control_plane.ControlPlane`: etcd + kube-apiserver + controller-manager + scheduler;
- `node_agent.NodeAgent`: a Node with GPU capacity and a kubelet behind it, status-only or
  running each pod under bubblewrap (`pod_runtime`, `sandbox`); `endpoints`: a Service's
  Ready pods; `ingress.IngressController`: nginx configured from Ingress objects;
- `operator_process.OperatorProcess`: the operator under the Helm chart's identity;
- `kube`: small waiting and reading helpers for tests;
- `traffic`: streams in flight through the ingress, from a client process of its own;
- `autoscaling`: the pieces the autoscaling scenario composes (Prometheus, the custom
  metrics adapter, load, a timeline).

Generic helpers (processes, ports, HTTP readiness, the repository root) are in testkit.
Its own tests: tests/harness (no cluster), tests/e2e (with one).
"""
