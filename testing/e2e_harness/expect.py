"""What the operator must have made for a spec (docs/design.md), as reusable assertions."""

from __future__ import annotations

from kubernetes import client

LABELS = {
    "app.kubernetes.io/name": "sluice-server",
    "app.kubernetes.io/managed-by": "sluice-operator",
    "app.kubernetes.io/component": "model-server",
}
TTFT_METRIC = "sluice_ttft_p{nn}_seconds"
ITL_METRIC = "sluice_itl_p{nn}_seconds"


def expected_kinds(spec: dict) -> set[str]:
    # Several nodes per replica: a LeaderWorkerSet instead (test_leaderworkerset.py).
    multi_node = (spec.get("parallelism") or {}).get("nodes", 1) > 1
    kinds = {"Service"} if multi_node else {"Deployment", "Service"}
    # The weights cache: no Deployment (nor its HPA) before the download Job reported a
    # commit.
    awaiting_weights = bool(((spec.get("model") or {}).get("cache") or {}).get("weights"))
    if awaiting_weights:
        kinds.discard("Deployment")
    autoscaling = spec.get("autoscaling")
    # The autoscaling block when scaling is on, else None.
    scaling = autoscaling if autoscaling is not None and autoscaling.get("enabled", True) else None
    if (spec.get("ingress") or {}).get("enabled"):
        kinds.add("Ingress")
    pools = spec.get("disaggregation")
    if pools is not None:  # two Deployments, an HPA per pool that scales, one budget
        kinds.discard("Deployment")
        for role in ("prefill", "decode"):
            kinds.add(f"{role.capitalize()}Deployment")
            if (pools.get(role) or {}).get("autoscaling"):
                kinds.add(f"{role.capitalize()}HorizontalPodAutoscaler")
        return kinds | {"PodDisruptionBudget"}  # both pools: at least two pods
    if scaling is not None and scaling.get("backend", "hpa") == "hpa" and not awaiting_weights:
        kinds.add("HorizontalPodAutoscaler")
    most = scaling.get("maxReplicas", 4) if scaling is not None else spec.get("replicas", 1)
    if most > 1:
        kinds.add("PodDisruptionBudget")
    return kinds


def children_present(children: dict[str, object], spec: dict) -> bool:
    want = expected_kinds(spec)
    return all(children[k] is not None for k in want) and all(
        children[k] is None for k in children if k not in want
    )


def owned_by(obj, model: dict) -> None:
    refs = obj.metadata.owner_references or []
    assert [(r.kind, r.name, r.uid, r.controller) for r in refs] == [
        ("StreamingModel", model["metadata"]["name"], model["metadata"]["uid"], True)
    ], refs
    labels = obj.metadata.labels or {}
    assert {k: labels.get(k) for k in LABELS} == LABELS
    assert labels.get("app.kubernetes.io/instance") == model["metadata"]["name"]


def check_deployment(dep: client.V1Deployment, model: dict) -> None:
    spec = model["spec"]
    owned_by(dep, model)
    pod = dep.spec.template
    assert pod.metadata.annotations.get("prometheus.io/scrape") == "true"
    (server,) = [
        c for c in pod.spec.containers if c.ports and any(p.container_port == 8000 for p in c.ports)
    ]
    resources = spec.get("resources", {})
    gpu_name = resources.get("gpuResourceName", "nvidia.com/gpu")
    simulator = spec.get("engine", {}).get("backend") == "simulator"
    limits = server.resources.limits or {}
    if simulator:
        assert gpu_name not in limits
    else:
        assert limits.get(gpu_name) == str(resources.get("gpus", 1))
    args = " ".join((server.command or []) + (server.args or []))
    if not simulator:  # the simulator takes no vLLM flags
        tensor = spec.get("parallelism", {}).get("tensor", 1)
        assert (
            f"--tensor-parallel-size={tensor}" in args or f"--tensor-parallel-size {tensor}" in args
        ), args
    assert server.readiness_probe.http_get.path == "/ready"
    assert server.liveness_probe.http_get.path == "/health"
    assert server.security_context.allow_privilege_escalation is False
    timeout = spec.get("streaming", {}).get("streamTimeoutSeconds", 600)
    assert pod.spec.termination_grace_period_seconds >= timeout


def pool_checks(role: str):
    """A disaggregated model's pool: its Deployment as a model of the pool's GPUs and tensor
    parallelism, labelled with its role and started with it; its HPA on the pool's metric."""
    metric = {"prefill": TTFT_METRIC, "decode": ITL_METRIC}[role]

    def name_of(model: dict) -> str:
        return f"{model['metadata']['name']}-{role}"

    def as_pool(model: dict) -> tuple[dict, dict]:
        spec = model["spec"]
        pool = spec["disaggregation"].get(role) or {}
        resources = {
            **spec.get("resources", {}),
            **({"gpus": pool["gpus"]} if "gpus" in pool else {}),
        }
        parallelism = {**spec.get("parallelism", {}),
                       **({"tensor": pool["tensor"]} if "tensor" in pool else {})}  # fmt: skip
        return {**model, "spec": {**spec, "resources": resources, "parallelism": parallelism}}, pool

    def check_pool_deployment(dep: client.V1Deployment, model: dict) -> None:
        pooled, _ = as_pool(model)
        check_deployment(dep, pooled)
        assert dep.metadata.name == name_of(model)
        assert dep.spec.selector.match_labels["serving.sluice.dev/role"] == role
        (server,) = [c for c in dep.spec.template.spec.containers if c.name == "server"]
        args = (server.command or []) + (server.args or [])
        assert args[args.index("--disaggregation-role") + 1] == role, args
        assert "--kv-transfer-config" in args, args

    def check_pool_hpa(hpa: client.V2HorizontalPodAutoscaler, model: dict) -> None:
        owned_by(hpa, model)
        _, pool = as_pool(model)
        scaling = pool["autoscaling"]
        assert (hpa.spec.min_replicas, hpa.spec.max_replicas) == (
            scaling.get("minReplicas", 1), scaling.get("maxReplicas", 4))  # fmt: skip
        assert (hpa.spec.scale_target_ref.kind, hpa.spec.scale_target_ref.name) == (
            "Deployment", name_of(model))  # fmt: skip
        (m,) = hpa.spec.metrics
        nn = round(float(scaling.get("percentile", 0.9)) * 100)
        assert (m.type, m.pods.metric.name) == ("Pods", metric.format(nn=nn))
        assert m.pods.target.average_value == f"{scaling.get('targetMilliseconds', 500)}m"

    return check_pool_deployment, check_pool_hpa


def check_service(svc: client.V1Service, model: dict) -> None:
    owned_by(svc, model)
    assert [(p.name, p.port) for p in svc.spec.ports][0] == ("http", 8000)
    assert svc.spec.selector["app.kubernetes.io/instance"] == model["metadata"]["name"]


def check_ingress(ing: client.V1Ingress, model: dict) -> None:
    owned_by(ing, model)
    spec = model["spec"]["ingress"]
    cls = spec.get("className", "nginx")
    assert ing.spec.ingress_class_name == cls
    notes = ing.metadata.annotations or {}
    if cls == "nginx":
        assert notes["nginx.ingress.kubernetes.io/proxy-buffering"] == "off"
        assert notes["nginx.ingress.kubernetes.io/proxy-request-buffering"] == "off"
    else:
        assert any(k.startswith("nginx.org/") for k in notes), notes
    for k, v in spec.get("annotations", {}).items():
        assert notes[k] == v
    backend = ing.spec.rules[0].http.paths[0].backend.service
    name = model["metadata"]["name"]
    allowed = [(name, 8000), (name, "http")]
    routed = ((model["spec"].get("routing") or {}).get("router") or {}).get("enabled")
    if routed or (model["spec"].get("autoscaling") or {}).get("minReplicas") == 0:
        # the router's Service: a router model always, scale to zero while no replica is Ready
        allowed.append((f"{name}-activator", 8000))
    assert (backend.name, backend.port.number or backend.port.name) in allowed


def check_hpa(hpa: client.V2HorizontalPodAutoscaler, model: dict) -> None:
    owned_by(hpa, model)
    scaling = model["spec"]["autoscaling"]
    assert (hpa.spec.min_replicas, hpa.spec.max_replicas) == (
        max(1, scaling.get("minReplicas", 1)),  # minReplicas 0: the operator owns 0 <-> 1
        scaling.get("maxReplicas", 4),
    )
    multi_node = (model["spec"].get("parallelism") or {}).get("nodes", 1) > 1
    assert hpa.spec.scale_target_ref.kind == ("LeaderWorkerSet" if multi_node else "Deployment")
    assert hpa.spec.scale_target_ref.name == model["metadata"]["name"]
    (metric,) = hpa.spec.metrics
    nn = round(float(scaling.get("ttftPercentile", 0.9)) * 100)
    assert metric.type == "Pods"
    assert metric.pods.metric.name == TTFT_METRIC.format(nn=nn)
    assert metric.pods.target.type == "AverageValue"
    assert metric.pods.target.average_value == f"{scaling.get('targetTTFTMilliseconds', 500)}m"


def check_pdb(pdb: client.V1PodDisruptionBudget, model: dict) -> None:
    owned_by(pdb, model)
    assert pdb.spec.selector.match_labels["app.kubernetes.io/instance"] == model["metadata"]["name"]


CHECKS = {
    **{
        f"{role.capitalize()}{kind}": check
        for role in ("prefill", "decode")
        for kind, check in zip(
            ("Deployment", "HorizontalPodAutoscaler"), pool_checks(role), strict=True
        )
    },
    "Deployment": check_deployment,
    "Service": check_service,
    "Ingress": check_ingress,
    "HorizontalPodAutoscaler": check_hpa,
    "PodDisruptionBudget": check_pdb,
}
