"""The harness itself: control plane up, RBAC enforced, fake GPU node scheduling and running pods."""

from __future__ import annotations

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
