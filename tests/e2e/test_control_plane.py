"""The harness itself: control plane up, RBAC enforced, fake GPU node scheduling and running pods."""

from __future__ import annotations

import json
import sys

from e2e_harness.kube import eventually
from e2e_harness.node_agent import NodeAgent
from kubernetes import client


def _pod(name: str, gpus: int) -> client.V1Pod:
    return client.V1Pod(
        metadata=client.V1ObjectMeta(name=name),
        spec=client.V1PodSpec(
            containers=[
                client.V1Container(
                    name="c",
                    image="example.invalid/none:0",
                    resources=client.V1ResourceRequirements(limits={"nvidia.com/gpu": str(gpus)}),
                )
            ]
        ),
    )


def test_control_plane_is_ready_and_fast(control_plane, admin):
    assert control_plane.startup_seconds < 30, control_plane.startup_seconds
    version = client.VersionApi(admin).get_code()
    assert version.major == "1"
    for proc in control_plane.processes:
        assert proc.alive(), proc.name


def test_rbac_is_enforced(control_plane, admin):
    """Negative control: an identity with no bindings is forbidden, so RBAC really decides."""
    core = client.CoreV1Api(admin)
    core.create_namespaced_service_account(
        "default", client.V1ServiceAccount(metadata=client.V1ObjectMeta(name="nobody"))
    )
    token = core.create_namespaced_service_account_token(
        "nobody",
        "default",
        client.AuthenticationV1TokenRequest(spec=client.V1TokenRequestSpec(audiences=[])),
    ).status.token
    from kubernetes import config

    path = control_plane.token_kubeconfig("nobody", "nobody", token)
    nobody = client.CoreV1Api(config.new_client_from_config(config_file=str(path)))
    try:
        nobody.list_namespaced_pod("default")
    except client.ApiException as e:
        assert e.status == 403
    else:
        raise AssertionError("an unbound ServiceAccount could list pods")


def test_fake_node_runs_and_removes_pods(admin, gpu_node):
    core = client.CoreV1Api(admin)
    node = core.read_node(gpu_node.name)
    assert node.status.allocatable["nvidia.com/gpu"] == "8"
    ready = next(c for c in node.status.conditions if c.type == "Ready")
    assert ready.status == "True"
    lease = client.CoordinationV1Api(admin).read_namespaced_lease(gpu_node.name, "kube-node-lease")
    assert lease.spec.holder_identity == gpu_node.name

    core.create_namespaced_pod("default", _pod("fits", 2))
    pod = eventually(
        lambda: (p := core.read_namespaced_pod("fits", "default")).status.pod_ip and p,
        timeout=20,
        message="the pod to be scheduled and running",
    )
    assert pod.spec.node_name == gpu_node.name
    assert pod.status.phase == "Running"
    assert any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions)

    core.delete_namespaced_pod("fits", "default")
    eventually(
        lambda: not core.list_namespaced_pod("default", field_selector="metadata.name=fits").items,
        timeout=20,
        message="the deleted pod to be removed by the fake kubelet",
    )


def test_pod_needing_more_gpus_than_any_node_stays_pending(admin, gpu_node):
    core = client.CoreV1Api(admin)
    core.create_namespaced_pod("default", _pod("too-big", 9))
    try:

        def unschedulable():
            pod = core.read_namespaced_pod("too-big", "default")
            cond = next((c for c in pod.status.conditions or [] if c.type == "PodScheduled"), None)
            return cond and cond.reason == "Unschedulable" and cond

        cond = eventually(unschedulable, timeout=20, message="the scheduler to give up on the pod")
        assert "nvidia.com/gpu" in cond.message
    finally:
        core.delete_namespaced_pod("too-big", "default", grace_period_seconds=0)


def test_more_nodes_on_demand(admin, gpu_node):
    extra = NodeAgent(admin, "gpu-node-extra", gpus=4).start()
    try:
        core = client.CoreV1Api(admin)
        eventually(
            lambda: core.read_node(extra.name).status.allocatable["nvidia.com/gpu"] == "4",
            message="the extra node",
        )
    finally:
        extra.stop()


# Run in a live pod: what an in-cluster client does with the kubelet's ServiceAccount volume
# and the KUBERNETES_SERVICE_* variables (the router's Pod watch does the same with httpx).
IN_CLUSTER = r"""
import json, os, ssl, urllib.error, urllib.request
sa = "/var/run/secrets/kubernetes.io/serviceaccount"
base = "https://%s:%s" % (os.environ["KUBERNETES_SERVICE_HOST"],
                          os.environ["KUBERNETES_SERVICE_PORT"])
ctx = ssl.create_default_context(cafile=sa + "/ca.crt")
ns, token = open(sa + "/namespace").read(), open(sa + "/token").read()

def call(path, token=None, body=None):
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = "Bearer " + token
    data = json.dumps(body).encode() if body else None
    req = urllib.request.Request(base + path, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, context=ctx, timeout=20) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")

pods = "/api/v1/namespaces/%s/pods" % ns
review = {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}
print("RESULT " + json.dumps({
    "namespace": ns, "without": call(pods), "with": call(pods, token),
    "whoami": call("/apis/authentication.k8s.io/v1/selfsubjectreviews", token, review)}))
"""


def test_a_live_pod_calls_the_api_server_with_its_projected_service_account_token(
    admin, namespace, live_nodes
):
    """The kubelet's side of in-cluster config on the live node agent: the ServiceAccount
    admission plugin adds the `kube-api-access-*` projected volume, the agent mints a token
    bound to the pod (TokenRequest), writes it with kube-root-ca.crt's CA and the namespace
    at /var/run/secrets/kubernetes.io/serviceaccount, and points KUBERNETES_SERVICE_HOST/
    PORT at the API server. With RBAC allowing it the pod lists pods (200), without it the
    API server names the pod's ServiceAccount in its 403, and without the token it is not
    that ServiceAccount at all."""
    core, rbac = client.CoreV1Api(admin), client.RbacAuthorizationV1Api(admin)
    (node,), placement = live_nodes(1)
    core.create_namespaced_service_account(
        namespace, client.V1ServiceAccount(metadata=client.V1ObjectMeta(name="reader"))
    )
    rbac.create_namespaced_role(namespace, {
        "metadata": {"name": "pod-reader"},
        "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}]})  # fmt: skip
    rbac.create_namespaced_role_binding(namespace, {
        "metadata": {"name": "pod-reader"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "pod-reader"},
        "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": namespace}]})  # fmt: skip
    for name, sa in (("reader", "reader"), ("plain", "default")):
        core.create_namespaced_pod(namespace, {
            "metadata": {"name": name},
            "spec": {**placement, "serviceAccountName": sa, "restartPolicy": "Never",
                     "containers": [{"name": "c", "image": "e2e.local/host",
                                     "command": [sys.executable, "-c", IN_CLUSTER],
                                     "securityContext": {"runAsUser": 65532}}]}})  # fmt: skip

    def result(name: str) -> dict:
        pod = core.read_namespaced_pod(name, namespace)
        if pod.status.phase not in ("Succeeded", "Failed"):
            return {}
        log = (node.log_dir / f"{namespace}.{name}.c.log").read_text()
        assert pod.status.phase == "Succeeded", log
        (line,) = [x for x in log.splitlines() if x.startswith("RESULT ")]
        return {"pod": pod, **json.loads(line.removeprefix("RESULT "))}

    got = {n: eventually(lambda n=n: result(n), timeout=90, message=f"pod {n} to finish")
           for n in ("reader", "plain")}  # fmt: skip
    for name, sa in (("reader", "reader"), ("plain", "default")):
        r, pod = got[name], got[name]["pod"]
        # What the admission plugin added and the agent mounted.
        (vol,) = [v for v in pod.spec.volumes if v.name.startswith("kube-api-access-")]
        assert vol.projected.sources[0].service_account_token.path == "token"
        assert r["namespace"] == namespace
        user = f"system:serviceaccount:{namespace}:{sa}"
        status, review = r["whoami"]
        assert status == 201, review
        info = review["status"]["userInfo"]
        assert info["username"] == user
        # Bound to this pod (the kubelet's TokenRequest: boundObjectRef kind Pod, name, uid).
        assert info["extra"]["authentication.kubernetes.io/pod-name"] == [name]
        assert info["extra"]["authentication.kubernetes.io/pod-uid"] == [pod.metadata.uid]
        # Without the token: anonymous (401, or 403 to system:anonymous), never the SA.
        status, body = r["without"]
        assert status in (401, 403) and user not in body.get("message", ""), body
    status, listing = got["reader"]["with"]
    assert status == 200 and {"reader", "plain"} <= {
        p["metadata"]["name"] for p in listing["items"]}, listing  # fmt: skip
    status, denied = got["plain"]["with"]
    assert status == 403 and f'User "system:serviceaccount:{namespace}:default"' in (
        denied["message"]), denied  # fmt: skip
