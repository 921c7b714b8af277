"""Every builder over the spec variants the issue names: TP 1/2/4/8, SSE/WebSocket/both,
autoscaling on/off, ingress on/off, auth on/off, simulator; plus the manifests' contracts."""

from __future__ import annotations

import itertools

import kubernetes_validate
import pytest
from operator_helpers import minimal
from sluice_operator.builders.args import server_args
from sluice_operator.builders.deployment import desired_deployment
from sluice_operator.builders.hpa import desired_hpa, ttft_metric_name
from sluice_operator.builders.ingress import desired_ingress
from sluice_operator.builders.networkpolicy import desired_network_policy
from sluice_operator.builders.pdb import desired_pdb
from sluice_operator.builders.service import desired_service
from sluice_operator.kinds import desired_children
from sluice_operator.models.resource import StreamingModel
from sluice_operator.validation import SpecError, load_model

DESIGN_LABELS = {
    "app.kubernetes.io/name": "sluice-server",
    "app.kubernetes.io/instance": "m",
    "app.kubernetes.io/managed-by": "sluice-operator",
    "app.kubernetes.io/component": "model-server",
}


def model(**spec) -> StreamingModel:
    return load_model(minimal(**spec))


def container(dep):
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    return c


def flag(args, name):
    return args[args.index(name) + 1] if name in args else None


TP = [1, 2, 4, 8]
PROTOCOLS = [["sse"], ["websocket"], ["sse", "websocket"]]
VARIANTS = list(itertools.product(TP, PROTOCOLS, [False, True], [False, True], [False, True]))


@pytest.mark.parametrize(
    "tp,protocols,autoscaling,ingress,auth",
    VARIANTS,
    ids=[f"tp{t}-{'+'.join(p)}-hpa{int(a)}-ing{int(i)}-auth{int(u)}" for t, p, a, i, u in VARIANTS],
)
def test_variant(tp, protocols, autoscaling, ingress, auth):
    spec = {
        "resources": {"gpus": tp},
        "parallelism": {"tensor": tp},
        "streaming": {"protocols": protocols},
        "ingress": {"enabled": ingress, "host": "m.example.com"},
    }
    if autoscaling:
        spec["autoscaling"] = {"minReplicas": 1, "maxReplicas": 4, "targetTTFTMilliseconds": 750}
    if auth:
        spec["auth"] = {"apiKeySecretRef": {"name": "keys"}, "rateLimit": {"requestsPerMinute": 60}}
    m = model(**spec)
    children = desired_children(m)

    dep = children["Deployment"]
    c = container(dep)
    args = c["args"]
    assert flag(args, "--tensor-parallel-size") == str(tp)
    assert (
        c["resources"]["limits"]["nvidia.com/gpu"]
        == str(tp)
        == c["resources"]["requests"]["nvidia.com/gpu"]
    )
    assert flag(args, "--protocols") == ",".join(sorted(protocols))
    assert ("replicas" in dep["spec"]) is (not autoscaling)
    assert (children["HorizontalPodAutoscaler"] is not None) is autoscaling
    assert (children["PodDisruptionBudget"] is not None) is autoscaling  # replicas: 1 otherwise
    assert (children["Ingress"] is not None) is ingress
    assert (flag(args, "--api-key-file") is not None) is auth
    assert (flag(args, "--rate-limit-rpm") == "60") is auth
    mounts = {v["mountPath"] for v in c["volumeMounts"]}
    assert ("/etc/sluice/auth" in mounts) is auth
    if ingress:
        ann = children["Ingress"]["metadata"]["annotations"]
        assert ann["nginx.ingress.kubernetes.io/proxy-buffering"] == "off"
    for child in filter(None, children.values()):
        assert DESIGN_LABELS.items() <= child["metadata"]["labels"].items()
        assert child["metadata"]["name"] == "m" and child["metadata"]["namespace"] == "default"
        assert "ownerReferences" not in child["metadata"]  # kopf.adopt in the handler


def test_server_args_follow_design_table():
    m = model(
        resources={"gpus": 4},
        parallelism={"tensor": 2, "pipeline": 2},
        engine={
            "maxModelLen": 4096,
            "maxNumSeqs": 64,
            "maxNumBatchedTokens": 8192,
            "gpuMemoryUtilization": 0.9,
            "swapSpaceGiB": 4,
            "dtype": "bfloat16",
            "quantization": "awq",
            "extraArgs": ["--enable-prefix-caching", "--kv-cache-dtype=fp8"],
        },
        streaming={"heartbeatSeconds": 10, "maxConcurrentStreams": 32, "streamTimeoutSeconds": 120},
        auth={"rateLimit": {"tokensPerMinute": 1000}},
    )
    args = server_args(m)
    assert args[:2] == ["--model", "org/model"]
    expected = {
        "--served-model-name": "org/model",
        "--host": "0.0.0.0",
        "--port": "8000",
        "--engine": "vllm",
        "--tensor-parallel-size": "2",
        "--pipeline-parallel-size": "2",
        "--gpu-memory-utilization": "0.9",
        "--max-model-len": "4096",
        "--max-num-seqs": "64",
        "--max-num-batched-tokens": "8192",
        "--swap-space": "4",
        "--dtype": "bfloat16",
        "--quantization": "awq",
        "--heartbeat-seconds": "10",
        "--max-concurrent-streams": "32",
        "--stream-timeout-seconds": "120",
        "--drain-timeout-seconds": "120",
        "--rate-limit-tpm": "1000",
    }
    for name, value in expected.items():
        assert flag(args, name) == value, name
    assert (
        "--rate-limit-rpm" not in args and "--api-key-file" not in args and "--revision" not in args
    )
    assert args[args.index("--") :] == ["--", "--enable-prefix-caching", "--kv-cache-dtype=fp8"]


@pytest.mark.parametrize("resources, server, workers", [
    ({}, {}, 3),  # the default request: 4 CPUs, one for the engine core
    ({"requests": {"cpu": "2"}}, {}, 1),
    ({"requests": {"cpu": "2500m"}}, {}, 1),
    ({"requests": {"cpu": 6}}, {}, 5),
    ({"requests": {"cpu": "64"}}, {}, 8),  # capped: past it the engine limits
    ({"requests": {"cpu": "500m"}}, {}, 1),
    ({"requests": {"memory": "8Gi"}}, {}, 1),  # no CPU request
    ({"requests": {"cpu": "2"}}, {"apiWorkers": 4}, 4),  # given wins
    ({}, {"apiWorkers": 1}, 1),
])  # fmt: skip
def test_api_workers_from_the_cpu_request(resources, server, workers):
    args = server_args(model(resources=resources, server=server))
    if workers == 1:
        assert "--api-workers" not in args  # one process, as without the flag
    else:
        assert flag(args, "--api-workers") == str(workers)


def test_resumable_streams_keep_one_worker():
    # a resumed stream lives in one process: unset apiWorkers derives 1, a given 2 is refused
    args = server_args(
        model(resources={"requests": {"cpu": 6}}, streaming={"resume": {"graceSeconds": 30}})
    )
    assert "--api-workers" not in args
    with pytest.raises(SpecError, match="resume"):
        model(server={"apiWorkers": 2}, streaming={"resume": {"graceSeconds": 30}})


def test_api_workers_bounds_are_refused():
    with pytest.raises(SpecError, match="apiWorkers"):
        model(server={"apiWorkers": 0})


def test_queue_priorities_and_weights_reach_the_server():
    assert "--queue-size" not in server_args(model())  # no queue: a full pod answers 429
    args = server_args(model(server={"queue": {
        "size": 128, "timeoutSeconds": 20, "priorities": ["interactive", "batch"],
        "defaultPriority": "interactive", "tenantWeights": {"globex": 1, "acme": 3},
        "slotSharing": False}}))  # fmt: skip
    assert (flag(args, "--queue-size"), flag(args, "--queue-timeout-seconds")) == ("128", "20")
    assert flag(args, "--priority-classes") == "interactive,batch"
    assert flag(args, "--default-priority") == "interactive"
    assert flag(args, "--tenant-weights") == "acme=3,globex=1"
    assert flag(args, "--queue-slot-sharing") == "false"
    assert flag(args, "--fair-share-window-seconds") == "30"


def test_the_jwt_priority_claim_reaches_the_server_with_classes_only():
    jwt = {**JWT, "jwks": {"secretRef": {"name": "jwks"}}, "priorityClaim": "tier"}
    classes = {"queue": {"size": 8, "priorities": ["interactive", "batch"]}}
    assert (
        flag(server_args(model(auth={"jwt": jwt}, server=classes)), "--jwt-priority-claim")
        == "tier"
    )
    # without classes the server never reads the claim: the pod template stays as it was
    assert "--jwt-priority-claim" not in server_args(model(auth={"jwt": jwt}))
    assert "--jwt-priority-claim" not in server_args(
        model(auth={"jwt": jwt}, server={"queue": {"size": 8}})
    )


@pytest.mark.parametrize("queue, says", [
    ({"timeoutSeconds": 30}, "server.queue needs size: a queue is always bounded"),
    ({"size": 0}, "greater than or equal to 1"),
    ({"size": 8, "priorities": ["a"], "defaultPriority": "b"}, "must be one of server.queue.priorities"),
    ({"size": 8, "defaultPriority": "b"}, "must be one of server.queue.priorities"),
    ({"size": 8, "priorities": ["a", "a"]}, "must not repeat"),
    ({"size": 8, "priorities": ["Urgent"]}, "should match pattern"),
    ({"size": 8, "tenantWeights": {"acme": -1}}, "every weight is a whole number from 1 to 1000"),
    ({"size": 8, "tenantWeights": {"a": 2, "acme": 1001}}, "weighs 1) (acme: 1001)"),
    ({"size": 8, "tenantWeights": {"a/b": 2}}, "not a plain name: a/b"),
])  # fmt: skip
def test_bad_queues_are_refused(queue, says):
    with pytest.raises(SpecError) as e:
        model(server={"queue": queue})
    assert says in str(e.value)


def test_unset_engine_values_are_left_to_vllm():
    args = server_args(model())
    for name in (
        "--max-model-len",
        "--max-num-seqs",
        "--max-num-batched-tokens",
        "--swap-space",
        "--quantization",
    ):
        assert name not in args
    assert "--" not in args


@pytest.mark.parametrize(
    "uri,model_arg,revision,claim",
    [
        ("hf://org/name@abc123", "org/name", "abc123", None),
        ("hf://org/name", "org/name", None, None),
        ("pvc://store/llama/70b", "/mnt/model/llama/70b", None, "store"),
        ("pvc://store", "/mnt/model", None, "store"),
        ("/models/baked", "/models/baked", None, None),
    ],
)
def test_model_sources(uri, model_arg, revision, claim):
    m = model(model={"uri": uri})
    dep = desired_deployment(m)
    args = container(dep)["args"]
    assert flag(args, "--model") == model_arg and flag(args, "--revision") == revision
    volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    if claim:
        assert volumes["model"]["persistentVolumeClaim"] == {"claimName": claim, "readOnly": True}
        mount = next(x for x in container(dep)["volumeMounts"] if x["name"] == "model")
        assert mount["readOnly"] is True
    else:
        assert "model" not in volumes
    # Default served name: the repo id for hf://, else the resource name.
    assert flag(args, "--served-model-name") == (model_arg if uri.startswith("hf://") else "m")


def test_cache_pvc_or_emptydir_and_shm():
    vols = {
        v["name"]: v for v in desired_deployment(model())["spec"]["template"]["spec"]["volumes"]
    }
    assert vols["cache"] == {"name": "cache", "emptyDir": {"sizeLimit": "100Gi"}}
    assert vols["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
    m = model(
        model={"uri": "hf://a/b", "cache": {"pvcName": "weights"}},
        resources={"sharedMemorySize": "16Gi"},
    )
    vols = {v["name"]: v for v in desired_deployment(m)["spec"]["template"]["spec"]["volumes"]}
    assert vols["cache"]["persistentVolumeClaim"] == {"claimName": "weights"}
    assert vols["dshm"]["emptyDir"]["sizeLimit"] == "16Gi"


def test_api_keys_mounted_as_file():
    m = model(auth={"apiKeySecretRef": {"name": "keys", "key": "list"}})
    dep = desired_deployment(m)
    vols = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    assert vols["api-keys"]["secret"]["items"] == [{"key": "list", "path": "api-keys"}]
    assert flag(container(dep)["args"], "--api-key-file") == "/etc/sluice/auth/api-keys"


JWT = {"issuer": "https://login.example.com", "audience": "chat"}


@pytest.mark.parametrize("source, kind", [("secretRef", "secret"), ("configMapRef", "configMap")])
def test_jwt_jwks_mounted_whole_and_flags_rendered(source, kind):
    m = model(auth={"jwt": {**JWT, "jwks": {source: {"name": "jwks"}}, "tenantClaim": "org"}})
    dep = desired_deployment(m)
    pod = dep["spec"]["template"]["spec"]
    vol = {v["name"]: v for v in pod["volumes"]}["jwks"]
    assert vol[kind]["items"] == [{"key": "jwks.json", "path": "jwks.json"}]
    assert vol[kind].get("secretName", vol[kind].get("name")) == "jwks"
    mount = {v["name"]: v for v in container(dep)["volumeMounts"]}["jwks"]
    assert mount == {"name": "jwks", "mountPath": "/etc/sluice/jwks", "readOnly": True}
    assert "subPath" not in mount  # a subPath mount would never see the Secret change
    args = container(dep)["args"]
    assert flag(args, "--jwt-jwks-file") == "/etc/sluice/jwks/jwks.json"
    assert flag(args, "--jwt-issuer") == JWT["issuer"] and flag(args, "--jwt-audience") == "chat"
    assert flag(args, "--jwt-tenant-claim") == "org"
    assert flag(args, "--api-key-file") is None


def test_auth_defaults_render_nothing_new():
    """Defaults unchanged: no JWT, memory buckets, no Redis anywhere."""
    c = container(desired_deployment(model(auth={"rateLimit": {"requestsPerMinute": 5}})))
    assert not [a for a in c["args"] if a.startswith(("--jwt", "--rate-limit-backend",
                                                       "--rate-limit-failure", "--redis"))]  # fmt: skip
    assert "SLUICE_REDIS_URL" not in {e["name"] for e in c["env"]}
    assert "jwks" not in {v["name"] for v in c["volumeMounts"]}


def test_tenants_share_the_prefix_cache_only_when_the_model_says_so():
    """Off (the default) renders nothing: the server salts the cache by tenant."""
    keys = {"apiKeySecretRef": {"name": "keys"}}
    assert "--share-prefix-cache-across-tenants" not in server_args(model(auth=keys))
    off = {**keys, "sharePrefixCacheAcrossTenants": False}
    assert "--share-prefix-cache-across-tenants" not in server_args(model(auth=off))
    on = server_args(model(auth={**keys, "sharePrefixCacheAcrossTenants": True}))
    assert flag(on, "--share-prefix-cache-across-tenants") == "true"


@pytest.mark.parametrize("auth, says", [
    ({"rateLimit": {"backend": "redis"}}, "needs rateLimit.redisUrlSecretRef"),
    ({"jwt": {**JWT, "jwks": {}}}, "exactly one of secretRef or configMapRef"),
    ({"jwt": {**JWT, "jwks": {"secretRef": {"name": "a"}, "configMapRef": {"name": "b"}}}},
     "exactly one of secretRef or configMapRef"),
    ({"jwt": {"issuer": "x", "jwks": {"secretRef": {"name": "a"}}}}, "audience"),
])  # fmt: skip
def test_incomplete_auth_is_a_spec_error(auth, says):
    from sluice_operator.validation import SpecError

    with pytest.raises(SpecError, match=says):
        model(auth=auth)


def test_probes_drain_rollout_and_security():
    m = model(streaming={"streamTimeoutSeconds": 900})
    dep = desired_deployment(m)
    pod = dep["spec"]["template"]["spec"]
    c = container(dep)
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] == 30 * 60  # the default
    assert dep["spec"]["progressDeadlineSeconds"] > 30 * 60
    assert c["lifecycle"]["preStop"] == {"sleep": {"seconds": 5}}
    assert pod["terminationGracePeriodSeconds"] >= 900 + 5
    assert flag(c["args"], "--drain-timeout-seconds") == "900"
    # Default: surge one pod, none unavailable (the old pods serve while the new one loads).
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    sc = c["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]}
    assert (
        sc["seccompProfile"] == {"type": "RuntimeDefault"} and sc["readOnlyRootFilesystem"] is True
    )
    assert (
        pod["securityContext"]["runAsNonRoot"] is True
        and pod["automountServiceAccountToken"] is False
    )
    ann = dep["spec"]["template"]["metadata"]["annotations"]
    assert ann == {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": "8000",
        "prometheus.io/path": "/metrics",
    }


def test_pod_labels_annotations_and_placement():
    m = model(
        podLabels={"team": "a", "app.kubernetes.io/instance": "hijack"},
        podAnnotations={"x": "y", "prometheus.io/port": "1"},
        resources={
            "gpus": 1,
            "nodeSelector": {"gpu": "h100"},
            "tolerations": [
                {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
            ],
            "affinity": {"nodeAffinity": {}},
            "priorityClassName": "high",
        },
        imagePullSecrets=[{"name": "regcred"}],
        serviceAccountName="model-sa",
        image="example/img:1",
        imagePullPolicy="Always",
    )
    dep = desired_deployment(m)
    tpl = dep["spec"]["template"]
    assert tpl["metadata"]["labels"]["team"] == "a"
    assert tpl["metadata"]["labels"]["app.kubernetes.io/instance"] == "m"  # ours win
    assert (
        tpl["metadata"]["annotations"]["x"] == "y"
        and tpl["metadata"]["annotations"]["prometheus.io/port"] == "8000"
    )
    pod = tpl["spec"]
    assert pod["nodeSelector"] == {"gpu": "h100"} and pod["priorityClassName"] == "high"
    assert pod["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    ]
    assert pod["affinity"] == {"nodeAffinity": {}} and pod["imagePullSecrets"] == [
        {"name": "regcred"}
    ]
    assert pod["serviceAccountName"] == "model-sa"
    assert (
        container(dep)["image"] == "example/img:1" and container(dep)["imagePullPolicy"] == "Always"
    )
    assert dep["spec"]["selector"]["matchLabels"] == {
        "app.kubernetes.io/name": "sluice-server",
        "app.kubernetes.io/instance": "m",
    }


def test_simulator_requests_no_gpu_and_passes_sim_flags():
    m = model(
        engine={"backend": "simulator", "simulator": {"ttftMs": 80, "itlMs": 15, "jitter": 0.1}},
        resources={"gpus": 2},
        parallelism={"tensor": 2},
    )
    c = container(desired_deployment(m))
    assert not any("gpu" in k for k in c["resources"].get("limits", {}))
    assert not any("gpu" in k for k in c["resources"].get("requests", {}))
    args = c["args"]
    assert flag(args, "--engine") == "simulator"
    assert (
        flag(args, "--sim-ttft-ms"),
        flag(args, "--sim-itl-ms"),
        flag(args, "--sim-jitter"),
    ) == ("80", "15", "0.1")
    assert flag(args, "--sim-ttft-per-stream-ms") == "0"
    assert "--tensor-parallel-size" not in args
    # Defaults when the simulator block is absent.
    args = server_args(model(engine={"backend": "simulator"}))
    assert flag(args, "--sim-ttft-ms") == "50" and flag(args, "--sim-itl-ms") == "20"


def test_gpu_resource_name():
    c = container(
        desired_deployment(model(resources={"gpus": 1, "gpuResourceName": "amd.com/gpu"}))
    )
    assert c["resources"]["limits"]["amd.com/gpu"] == "1"


def test_service():
    svc = desired_service(model())
    assert svc["spec"]["type"] == "ClusterIP"
    assert svc["spec"]["ports"] == [
        {
            "name": "http",
            "port": 8000,
            "targetPort": "http",
            "protocol": "TCP",
            "appProtocol": "http",
        }
    ]
    assert svc["spec"]["selector"] == {
        "app.kubernetes.io/name": "sluice-server",
        "app.kubernetes.io/instance": "m",
    }


def test_ingress_community_annotations_timeouts_and_user_override():
    m = model(
        streaming={"streamTimeoutSeconds": 900},
        ingress={
            "enabled": True,
            "host": "m.example.com",
            "path": "/llm",
            "tlsSecretName": "tls",
            "annotations": {"nginx.ingress.kubernetes.io/proxy-body-size": "32m", "extra": "1"},
        },
    )
    ing = desired_ingress(m)
    ann = ing["metadata"]["annotations"]
    p = "nginx.ingress.kubernetes.io/"
    assert ann[p + "proxy-buffering"] == "off" and ann[p + "proxy-request-buffering"] == "off"
    assert ann[p + "proxy-http-version"] == "1.1"
    assert int(ann[p + "proxy-read-timeout"]) >= 900 and int(ann[p + "proxy-send-timeout"]) >= 900
    assert ann[p + "proxy-body-size"] == "32m" and ann["extra"] == "1"  # user wins
    assert not any(k.startswith("nginx.org/") for k in ann)
    assert ing["spec"]["ingressClassName"] == "nginx"
    assert ing["spec"]["tls"] == [{"hosts": ["m.example.com"], "secretName": "tls"}]
    (rule,) = ing["spec"]["rules"]
    assert rule["host"] == "m.example.com"
    (path,) = rule["http"]["paths"]
    assert path == {
        "path": "/llm",
        "pathType": "Prefix",
        "backend": {"service": {"name": "m", "port": {"name": "http"}}},
    }


@pytest.mark.parametrize(
    "ingress,f5",
    [
        ({"className": "nginx"}, False),
        ({"className": "nginx-org"}, True),
        ({"className": "nginx-plus"}, True),
        ({"className": "nginx", "controller": "f5-nginx"}, True),
        ({"className": "nginx-org", "controller": "ingress-nginx"}, False),
    ],
)
def test_ingress_f5_annotations(ingress, f5):
    m = model(
        streaming={"protocols": ["sse", "websocket"], "streamTimeoutSeconds": 300},
        ingress={"enabled": True, **ingress},
    )
    ann = desired_ingress(m)["metadata"]["annotations"]
    if f5:
        assert ann["nginx.org/proxy-buffering"] == "false"
        assert ann["nginx.org/proxy-read-timeout"] == ann["nginx.org/proxy-send-timeout"] == "330s"
        assert ann["nginx.org/client-max-body-size"] == str(16 * 2**20)
        assert ann["nginx.org/websocket-services"] == "m"
        assert not any(k.startswith("nginx.ingress.kubernetes.io/") for k in ann)
    else:
        assert not any(k.startswith("nginx.org/") for k in ann)


def test_ingress_without_host_matches_all_hosts():
    (rule,) = desired_ingress(model(ingress={"enabled": True}))["spec"]["rules"]
    assert "host" not in rule


@pytest.mark.parametrize(
    "percentile,name", [(0.5, "p50"), (0.75, "p75"), (0.9, "p90"), (0.95, "p95"), (0.99, "p99")]
)
def test_hpa_metric_and_behavior(percentile, name):
    m = model(
        autoscaling={
            "minReplicas": 2,
            "maxReplicas": 8,
            "targetTTFTMilliseconds": 1500,
            "ttftPercentile": percentile,
            "scaleUpStabilizationSeconds": 15,
            "scaleDownStabilizationSeconds": 600,
        }
    )
    hpa = desired_hpa(m)
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "m",
    }
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 8)
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    assert (
        metric["pods"]["metric"]["name"]
        == f"sluice_ttft_{name}_seconds"
        == ttft_metric_name(percentile)
    )
    assert metric["pods"]["target"] == {"type": "AverageValue", "averageValue": "1500m"}
    assert hpa["spec"]["behavior"]["scaleUp"]["stabilizationWindowSeconds"] == 15
    assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 600


def test_autoscaling_disabled_flag_keeps_replicas():
    m = model(replicas=3, autoscaling={"enabled": False, "maxReplicas": 5})
    assert desired_hpa(m) is None
    assert desired_deployment(m)["spec"]["replicas"] == 3
    assert desired_pdb(m) is not None


@pytest.mark.parametrize(
    "rollout, strategy, pdb_unavailable",
    [
        ({}, {"maxSurge": 1, "maxUnavailable": 0}, 1),  # a PDB of 0 would block drains forever
        ({"maxSurge": 0, "maxUnavailable": 1}, {"maxSurge": 0, "maxUnavailable": 1}, 1),
        ({"maxSurge": 2, "maxUnavailable": 2}, {"maxSurge": 2, "maxUnavailable": 2}, 2),
    ],
)
def test_rollout_sets_the_strategy_and_the_pdb(rollout, strategy, pdb_unavailable):
    m = model(replicas=3, rollout=rollout)
    assert desired_deployment(m)["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": strategy,
    }
    assert desired_pdb(m)["spec"]["maxUnavailable"] == pdb_unavailable
    assert desired_pdb(m)["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"


def test_rollout_needs_surge_or_unavailable():
    with pytest.raises(SpecError, match="cannot both be 0"):
        load_model(minimal(rollout={"maxSurge": 0, "maxUnavailable": 0}))


@pytest.mark.parametrize("replicas,pdb", [(0, False), (1, False), (2, True)])
def test_pdb_only_when_more_than_one_replica(replicas, pdb):
    got = desired_pdb(model(replicas=replicas))
    assert (got is not None) is pdb
    if got:
        assert got["spec"]["maxUnavailable"] == 1
        assert got["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"


@pytest.mark.parametrize("timeout", [60, 1800, 3605, 7200])
def test_startup_budget_sets_the_probe_and_the_progress_deadline(timeout):
    """The startup probe runs every second (Ready within a second of serving) for the whole
    budget; the progress deadline is 10 minutes longer."""
    dep = desired_deployment(model(startup={"timeoutSeconds": timeout}))
    startup = container(dep)["startupProbe"]
    assert startup["periodSeconds"] == 1 and startup["failureThreshold"] == timeout
    assert dep["spec"]["progressDeadlineSeconds"] == timeout + 600


@pytest.mark.parametrize(
    "spec, want",
    [
        ({}, 16 * 2**20),
        ({"limits": {"maxRequestBytes": 4_000_000}}, 4_000_000),
        ({"ingress": {"maxBodySize": "8m"}}, 8 * 2**20),  # deprecated field still honoured
        ({"ingress": {"maxBodySize": "512k"}, "limits": {"maxRequestBytes": 2048}}, 2048),
    ],
)
@pytest.mark.parametrize("ingress_class", ["nginx", "nginx-org"])
def test_one_request_body_limit_for_server_and_ingress(spec, want, ingress_class):
    ingress = {**spec.get("ingress", {}), "enabled": True, "className": ingress_class}
    m = model(**{**spec, "ingress": ingress})
    assert flag(container(desired_deployment(m))["args"], "--max-body-bytes") == str(want)
    ann = desired_ingress(m)["metadata"]["annotations"]
    key = (
        "nginx.org/client-max-body-size"
        if ingress_class == "nginx-org"
        else "nginx.ingress.kubernetes.io/proxy-body-size"
    )
    assert ann[key] == str(want)


def test_no_network_policy_by_default():
    assert desired_network_policy(model()) is None


@pytest.mark.parametrize(
    "policy, namespaces",
    [
        ({"enabled": True}, [["ingress-nginx"], ["monitoring"]]),
        (
            {
                "enabled": True,
                "proxyNamespaces": ["envoy-gateway-system", "nginx-gateway"],
                "monitoringNamespaces": ["prom"],
            },
            [["envoy-gateway-system", "nginx-gateway"], ["prom"]],
        ),
        ({"enabled": True, "proxyNamespaces": [], "monitoringNamespaces": []}, []),
    ],
)
def test_network_policy_admits_only_the_proxy_monitoring_and_own_namespace(policy, namespaces):
    np = desired_network_policy(model(networkPolicy=policy))
    for version in ("1.33", "1.35"):
        kubernetes_validate.validate(np, version, strict=True)
    spec = np["spec"]
    assert spec["podSelector"] == {
        "matchLabels": desired_pdb(model(replicas=2))["spec"]["selector"]["matchLabels"]
    }
    assert spec["policyTypes"] == ["Ingress"]  # egress (model downloads) stays open
    (rule,) = spec["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 8000}]
    assert rule["from"][0] == {"podSelector": {}}  # the model's own namespace
    got = [p["namespaceSelector"]["matchExpressions"][0]["values"] for p in rule["from"][1:]]
    assert got == namespaces
    for p in rule["from"][1:]:
        assert p["namespaceSelector"]["matchExpressions"][0]["key"] == "kubernetes.io/metadata.name"


def test_cors_flags_only_when_origins_are_listed():
    assert "--cors-allowed-origins" not in server_args(model())
    args = server_args(model(streaming={"cors": {
        "allowedOrigins": ["https://app.example.com", "http://localhost:3000"],
        "maxAgeSeconds": 60}}))  # fmt: skip
    assert flag(args, "--cors-allowed-origins") == "https://app.example.com,http://localhost:3000"
    assert flag(args, "--cors-max-age-seconds") == "60"
    assert "--cors-allowed-headers" not in args  # the server's default list
    args = server_args(model(streaming={"cors": {"allowedOrigins": ["*"],
                                                 "allowedHeaders": ["Authorization"]}}))  # fmt: skip
    assert flag(args, "--cors-allowed-headers") == "Authorization"


@pytest.mark.parametrize(
    "origin", ["app.example.com", "https://a.example.com/path", "ftp://x", "a,b"]
)
def test_cors_origin_must_be_an_origin(origin):
    with pytest.raises(Exception, match="allowed_origins|allowedOrigins"):
        model(streaming={"cors": {"allowedOrigins": [origin]}})


@pytest.mark.parametrize("ctrl", ["ingress-nginx", "f5-nginx"])
def test_resume_adds_flag_and_cookie_affinity(ctrl):
    from sluice_operator.builders.ingress import desired_ingress

    ing = {"enabled": True, "controller": ctrl}
    plain = model(ingress=ing)
    assert "--resume-grace-seconds" not in server_args(plain)
    ann = desired_ingress(plain)["metadata"]["annotations"]
    assert not [k for k in ann if "affinity" in k or "sticky" in k]
    m = model(ingress=ing, streaming={"resume": {"graceSeconds": 30}})
    assert flag(server_args(m), "--resume-grace-seconds") == "30"
    ann = desired_ingress(m)["metadata"]["annotations"]
    if ctrl == "ingress-nginx":
        p = "nginx.ingress.kubernetes.io"
        assert ann[f"{p}/affinity"] == "cookie" and ann[f"{p}/affinity-mode"] == "persistent"
        assert ann[f"{p}/session-cookie-name"] == "sluice-affinity"
    else:
        assert ann["nginx.org/sticky-cookie-services"] == "serviceName=m sluice-affinity path=/"


@pytest.mark.parametrize("path,root", [("/", None), ("/mistral", "/mistral"),
                                       ("/team/chat/", "/team/chat")])  # fmt: skip
def test_ingress_path_prefix_becomes_the_server_root_path(path, root):
    from sluice_operator.builders.ingress import desired_ingress

    m = model(ingress={"enabled": True, "path": path})
    assert flag(server_args(m), "--root-path") == root
    (p,) = desired_ingress(m)["spec"]["rules"][0]["http"]["paths"]
    assert p["path"] == path and p["pathType"] == "Prefix"
    ann = desired_ingress(m)["metadata"]["annotations"]
    assert not [k for k in ann if "rewrite" in k]  # the server knows its prefix instead
    assert "--root-path" not in server_args(model(ingress={"path": "/x"}))  # no Ingress


@pytest.mark.parametrize(
    "path,root", [("/", None), ("/llm", "/llm"), ("/team/chat/", "/team/chat")]
)
def test_httproute_path_prefix_becomes_the_server_root_path(path, root):
    """The HTTPRoute passes its PathPrefix on unchanged, as the Ingress does: without
    --root-path the pods would answer /llm/v1/... with 404 (the negative control is "/")."""
    from sluice_operator.builders.gateway import desired_httproute

    gateway = {"parentRefs": [{"name": "public"}], "path": path}
    m = model(gateway=gateway)
    assert flag(server_args(m), "--root-path") == root
    (rule,) = desired_httproute(m)["spec"]["rules"]
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": path}}]
    assert "filters" not in rule  # no URLRewrite of the path: the server knows its prefix


@pytest.mark.parametrize("path", ["mistral", "/a b", "/x?y", "//x"])
def test_ingress_path_must_be_a_plain_prefix(path):
    with pytest.raises(Exception, match="path"):
        model(ingress={"enabled": True, "path": path})


def test_playground_on_by_default_and_switchable():
    assert "--playground" not in server_args(model())
    assert flag(server_args(model(streaming={"playground": False})), "--playground") == "false"
