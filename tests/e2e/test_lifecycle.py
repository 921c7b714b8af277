"""The operator over time, on a control plane of its own: upgrades, two replicas, failures.

One scenario, in order (each test starts from where the previous one left the cluster):

1. The chart of the pinned earlier commit (`harness.pinned.PINNED`: one replica, `Recreate`,
   no leader election) is installed with `helm install`, its CRD with it; its operator runs
   as a real process for its pod (`harness.operator_pods`). Ten models and every sample of
   that commit are created under that CRD and reconciled by that operator.
2. The current CRD is applied over it: every stored object reads back unchanged, passes the
   new schema and CEL rules on an unchanged update and a dry-run create.
3. `helm upgrade` to the current chart and operator: the old, non-electing pod is gone before
   the first electing one starts (the chart chose `Recreate` and kept one replica for this
   upgrade), a second `helm upgrade` rolls to two electing replicas, and exactly one of them
   writes; no Deployment gets a new pod template (fleet models: generation unchanged) and
   every model is reconciled under the new operator (observedGeneration).
4. `helm upgrade` to a release whose operator renders a new pod template (a readiness probe
   change made to a copy of the current operator): models roll at most
   `operator.maxConcurrentModelRollouts` (2) at a time, none ever without a Ready replica
   (sampled every 100 ms), the others wait with `TemplateCurrent=False` and an Event.
5. SIGKILL of the leader: the standby takes over and reconciles a new model within the
   lease duration + 5 s.
6. The leader cut off from the API server (its own TCP proxy stops answering) but alive: it
   stops writing at its renew deadline, before the standby takes over, and after the
   connection comes back it writes nothing.

Which pod wrote what comes from the audit log: each pod's token is bound to the pod, so
every audited call names it (`user.extra`), the pinned release's calls included.
"""

from __future__ import annotations

import copy
import datetime as dt
import json
import os
import shutil
import threading
import time
from pathlib import Path

import pytest
import yaml
from e2e_harness import pinned
from e2e_harness.control_plane import ControlPlane, is_write
from e2e_harness.kube import GROUP, PLURAL, VERSION, Models, eventually, model_body
from e2e_harness.node_agent import NodeAgent
from e2e_harness.operator_pods import OperatorPods, writer_of
from e2e_harness.operator_process import find_helm
from kubernetes import client, config
from testkit.repo import ROOT

from .conftest import TIMINGS

NS = "sluice-system"
RELEASE = "sluice"
LEASE = "sluice-sluice-operator"
MODELS_NS = "fleet"
SAMPLES_NS = "samples"
ROLE = "sluice.dev/e2e-role"
SA_USER = f"system:serviceaccount:{NS}:{LEASE}"
N_MODELS = 10
MAX_ROLLOUTS = 2
LEASE_SECONDS = 15  # the chart's defaults: lease 15 s, renew deadline 10 s, retry 2 s
RENEW_DEADLINE = 10
LOAD_SECONDS = 2.0  # a new model pod turns Ready this long after it starts
# The "next release": the current operator with one change to what every model's pods get.
NEXT_CHANGE = (
    '"readinessProbe": _probe("/ready", 5, 2)',
    '"readinessProbe": _probe("/ready", 5, 3)',
)


def _ts(text: str) -> float:
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


class Plane:
    """The scenario's cluster: control plane, nodes, the operator pods' runtime, helm."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.cp = ControlPlane(
            workdir / "cp", Path(os.environ["K8S_ASSETS"]), audited_namespace=NS
        ).start()
        self.api = config.new_client_from_config(config_file=str(self.cp.kubeconfigs["admin"]))
        self.core = client.CoreV1Api(self.api)
        self.apps = client.AppsV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)
        self.ext = client.ApiextensionsV1Api(self.api)
        self.coordination = client.CoordinationV1Api(self.api)
        self.models = Models(self.api)
        self.old = pinned.checkout(workdir / "pinned")
        self.next = workdir / "next"
        shutil.copytree(ROOT / "operator", self.next / "operator",
                        ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))  # fmt: skip
        builder = self.next / "operator/sluice_operator/builders/deployment.py"
        text = builder.read_text()
        assert NEXT_CHANGE[0] in text, "the next release's change no longer applies"
        builder.write_text(text.replace(*NEXT_CHANGE))
        code = {"pinned": self.old, "current": ROOT, "next": self.next}
        self.pods = OperatorPods(self.cp, self.api, code, self.cp.logs)
        self.nodes = [
            NodeAgent(self.api, "operator-node", gpus=0, labels={ROLE: "operator"},
                        taint={"key": ROLE, "value": "operator", "effect": "NoSchedule"},
                        runtime=self.pods),
            NodeAgent(self.api, "gpu-a", gpus=32, ready_after=LOAD_SECONDS),
            NodeAgent(self.api, "gpu-b", gpus=32, ready_after=LOAD_SECONDS),
        ]  # fmt: skip
        for node in self.nodes:
            node.start()
        self.values = workdir / "operator-placement.yaml"
        self.values.write_text(
            yaml.safe_dump(
                {
                    "nodeSelector": {ROLE: "operator"},
                    "tolerations": [
                        {
                            "key": ROLE,
                            "operator": "Equal",
                            "value": "operator",
                            "effect": "NoSchedule",
                        }
                    ],  # fmt: skip
                }
            )
        )
        eventually(
            lambda: client.CoreV1Api(self.api).read_namespaced_service_account(
                "default", "default"
            ),
            timeout=30,
            message="the default ServiceAccount",
        )
        for ns in (MODELS_NS, SAMPLES_NS):
            self.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=ns)))

    def close(self) -> None:
        self.pods.close()
        for node in self.nodes:
            node.stop(delete=False)
        self.cp.stop()

    def helm(self, *args: str) -> str:
        import subprocess

        helm = find_helm()
        assert helm, "helm not found (make tools)"
        argv = [helm, *args, "--kubeconfig", str(self.cp.kubeconfigs["admin"])]
        done = subprocess.run(argv, capture_output=True, text=True)
        assert done.returncode == 0, f"helm {args[0]} failed: {done.stderr[-3000:]}"
        return done.stdout

    # --- reading -------------------------------------------------------------------------
    def lease_holder(self) -> str | None:
        try:
            lease = self.coordination.read_namespaced_lease(LEASE, NS)
        except client.ApiException as e:
            if e.status == 404:
                return None
            raise
        holder = lease.spec.holder_identity
        return holder.rsplit("_", 1)[0] if holder else None  # the pod name, without the suffix

    def deployments(self, namespace: str) -> dict[str, client.V1Deployment]:
        return {d.metadata.name: d for d in self.apps.list_namespaced_deployment(namespace).items}

    def stored(self, namespace: str) -> dict[str, dict]:
        items = self.custom.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL)
        return {o["metadata"]["name"]: o for o in items["items"]}

    def writes(self, since: int = 0) -> list[dict]:
        """The operator's writes (any of its pods), in the order the API server got them."""
        events = [e for e in self.cp.audit_events(SA_USER, since=since) if is_write(e)]
        return sorted(events, key=lambda e: e["requestReceivedTimestamp"])


@pytest.fixture(scope="module")
def plane(tmp_path_factory):
    if reason := pinned.missing():
        pytest.skip(reason)
    if not find_helm():
        pytest.skip("helm not found (make tools installs it into .tools/bin)")
    p = Plane(tmp_path_factory.mktemp("lifecycle"))
    TIMINGS["lifecycle logs"] = str(p.cp.logs)
    try:
        yield p
    finally:
        p.close()


@pytest.fixture(scope="module")
def state() -> dict:
    """What one step leaves for the next."""
    return {}


def _ready(plane: Plane, namespace: str, names: list[str]):
    def check():
        stored = plane.stored(namespace)
        return all(
            (stored.get(n, {}).get("status") or {}).get("phase") == "Ready"
            and stored[n]["status"].get("observedGeneration") == stored[n]["metadata"]["generation"]
            for n in names
        )

    return check


def _templates(root: Path, bodies: list[dict]) -> dict[str, dict]:
    """Model name -> the pod template the operator of source tree `root` renders for it."""
    import subprocess
    import sys

    text = "".join("---\n" + yaml.safe_dump(b) for b in bodies)
    out = subprocess.run(
        [sys.executable, "-m", "sluice_operator", "render", "-f", "-"],
        input=text, capture_output=True, text=True, check=True,
        env={**os.environ, "PYTHONPATH": str(root / "operator")},
    ).stdout  # fmt: skip
    return {
        d["metadata"]["name"]: d["spec"]["template"]
        for d in yaml.safe_load_all(out)
        if d and d["kind"] == "Deployment"
    }


def _fleet_model(name: str) -> dict:
    body = model_body(name, MODELS_NS)
    body["spec"]["resources"] = {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {}}
    return body


# ---- 1. the pinned release ---------------------------------------------------------------


def test_1_pinned_release_installs_and_reconciles_models(plane, state):
    chart = plane.old / "charts/sluice-operator"
    plane.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=NS)))
    out = plane.helm("install", RELEASE, str(chart), "-n", NS,
                     "-f", str(plane.values), "--set", "image.tag=pinned",
                     "--wait", "--timeout", "120s")  # fmt: skip
    assert "STATUS: deployed" in out
    (container,) = plane.pods.running()
    assert container.tag == "pinned"
    deploy = plane.apps.read_namespaced_deployment(LEASE, NS)
    assert deploy.spec.strategy.type == "Recreate" and deploy.spec.replicas == 1
    names = [f"m{i}" for i in range(N_MODELS)]
    for name in names:
        plane.models.create(_fleet_model(name))
    samples = []
    for path in sorted((plane.old / "samples").glob("*.yaml")):
        for body in yaml.safe_load_all(path.read_text()):
            if body and body.get("kind") == "StreamingModel":
                body["metadata"]["namespace"] = SAMPLES_NS
                plane.models.create(body)
                # (a weights-cache model gets its Deployment once its download Job succeeds)
                if not body["spec"]["model"].get("cache", {}).get("weights"):
                    samples.append(body["metadata"]["name"])
    began = time.monotonic()
    eventually(
        _ready(plane, MODELS_NS, names), timeout=120, message="10 models Ready (pinned operator)"
    )
    TIMINGS["pinned release: 10 models Ready (s)"] = round(time.monotonic() - began, 1)
    eventually(lambda: set(samples) <= set(plane.deployments(SAMPLES_NS)), timeout=60,
               message="every pinned sample's Deployment")  # fmt: skip
    stored = {ns: plane.stored(ns) for ns in (MODELS_NS, SAMPLES_NS)}
    state.update(names=names, samples=samples, sent={
        ns: {n: copy.deepcopy(o["spec"]) for n, o in objects.items()}
        for ns, objects in stored.items()
    })  # fmt: skip
    # Which models a move to the current release must restart: those whose pod template
    # the current operator renders differently from the pinned one (none, unless a release
    # changed what pods get on purpose; tests/operator/golden shows it).
    bodies = [o for objects in stored.values() for o in objects.values()]
    for b in bodies:
        b.pop("status", None)
    state["must_change"] = {
        n for n, t in _templates(ROOT, bodies).items() if _templates(plane.old, bodies).get(n) != t
    }


# ---- 2. the current CRD over objects the pinned one stored ---------------------------------


def _added(sent, stored, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """The paths `stored` has beyond `sent`; AssertionError where a sent value changed."""
    if not (isinstance(sent, dict) and isinstance(stored, dict)):
        assert stored == sent, f"{'.'.join(path)} reads back changed under the new CRD"
        return []
    missing = sent.keys() - stored.keys()
    assert not missing, f"{'.'.join(path) or 'spec'} lost {sorted(missing)} under the new CRD"
    added = [(*path, key) for key in stored.keys() - sent.keys()]
    for key in sent:
        added += _added(sent[key], stored[key], (*path, key))
    return added


def _has_default(schema: dict, path: tuple[str, ...]) -> bool:
    """Whether the CRD's schema gives `path` (under spec) a default, itself or in a parent
    object that was absent and defaulted whole."""
    node = schema["properties"]["spec"]
    for key in path:
        node = node.get("properties", {}).get(key, {})
    return "default" in node


def test_2_objects_stored_by_the_pinned_crd_validate_under_the_current_one(plane, state):
    current = yaml.safe_load((ROOT / "crds/streamingmodels.serving.sluice.dev.yaml").read_text())
    schema = current["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    live = plane.ext.read_custom_resource_definition(current["metadata"]["name"])
    old = yaml.safe_load((plane.old / "crds/streamingmodels.serving.sluice.dev.yaml").read_text())
    assert [v["name"] for v in old["spec"]["versions"]] == ["v1alpha1"]
    current["metadata"]["resourceVersion"] = live.metadata.resource_version
    replaced = plane.ext.replace_custom_resource_definition(current["metadata"]["name"], current)
    assert replaced.metadata.generation > live.metadata.generation
    assert replaced.status.stored_versions == ["v1alpha1"]
    checked = 0
    for ns, sent in state["sent"].items():
        stored = plane.stored(ns)
        for name, spec in sent.items():
            obj = stored[name]
            # Read back under the new CRD: what was sent is unchanged, and the only additions
            # are the new fields' schema defaults (the API server applies them on read).
            added = _added(spec, obj["spec"])
            assert all(_has_default(schema, path) for path in added), (ns, name, added)
            # An update that changes nothing passes the new schema and CEL rules ...
            updated = plane.custom.replace_namespaced_custom_object(
                GROUP, VERSION, ns, PLURAL, name, obj
            )
            assert updated["metadata"]["generation"] == obj["metadata"]["generation"]
            # ... and so does creating the same spec anew (create-time rules included).
            fresh = {"apiVersion": obj["apiVersion"], "kind": obj["kind"],
                     "metadata": {"name": f"{name}-again"[:63], "namespace": ns},
                     "spec": obj["spec"]}  # fmt: skip
            plane.custom.create_namespaced_custom_object(
                GROUP, VERSION, ns, PLURAL, fresh, dry_run="All"
            )
            checked += 1
    assert checked == N_MODELS + len(state["samples"])
    TIMINGS["pinned objects re-validated under the current CRD"] = checked


# ---- 3. upgrade to the current chart and operator ------------------------------------------


def test_3_upgrade_never_runs_the_pinned_operator_beside_an_electing_one(plane, state):
    before = {ns: plane.deployments(ns) for ns in (MODELS_NS, SAMPLES_NS)}
    must_change = state["must_change"]
    mark = plane.cp.audit_mark()
    began = time.time()
    upgrade = ("upgrade", RELEASE, str(ROOT / "charts/sluice-operator"), "-n", NS,
               "-f", str(plane.values), "--set", "image.tag=current",
               "--set", f"operator.maxConcurrentModelRollouts={MAX_ROLLOUTS}",
               "--wait", "--timeout", "180s")  # fmt: skip
    notes = plane.helm(*upgrade)
    # The chart saw a pod that does not elect: Recreate, and the replica count it had (the
    # controller scales before it rolls: two would first start a second old pod).
    deploy = plane.apps.read_namespaced_deployment(LEASE, NS)
    assert deploy.spec.strategy.type == "Recreate" and deploy.spec.replicas == 1
    assert "Run the same helm upgrade" in notes
    old = [c for c in plane.pods.history if c.tag == "pinned"]
    new = [c for c in plane.pods.history if c.tag == "current"]
    assert len(old) == 1 and len(new) == 1 and old[0].stopped is not None
    assert old[0].stopped <= new[0].started, "the pinned operator ran beside a new one"
    # Once more: electing pods now, so a rolling update to two replicas.
    plane.helm(*upgrade)
    deploy = plane.apps.read_namespaced_deployment(LEASE, NS)
    assert deploy.spec.strategy.type == "RollingUpdate" and deploy.spec.replicas == 2
    new = [c for c in plane.pods.history if c.tag == "current"]
    assert len(new) == 2 and len(plane.pods.running()) == 2
    assert len([c for c in plane.pods.history if c.tag == "pinned"]) == 1
    leader = eventually(plane.lease_holder, timeout=60, message="a leader")
    # Every model reconciled under the new operator, and no other pod template changed. The
    # models whose template the release changes roll MAX_ROLLOUTS at a time (paced, as in
    # test 4), so converging them all takes as long as a paced rollout of the fleet.
    eventually(
        lambda: all(
            "serving.sluice.dev/template-hash" in (d.metadata.labels or {})
            for ns in (MODELS_NS, SAMPLES_NS)
            for d in plane.deployments(ns).values()
        ),
        timeout=240 if must_change else 60,
        message="the new operator to converge every Deployment",
    )
    serialize = plane.api.sanitize_for_serialization
    for ns, deployments in before.items():
        after = plane.deployments(ns)
        for name, dep in deployments.items():
            if name in must_change:
                continue
            # Samples may be autoscaled (the HPA moves spec.replicas): compare the template.
            assert serialize(after[name].spec.template) == serialize(dep.spec.template), (
                f"{ns}/{name}: the upgrade changed its pod template"
            )
            if ns == MODELS_NS:
                assert after[name].metadata.generation == dep.metadata.generation
    eventually(_ready(plane, MODELS_NS, state["names"]), timeout=60, message="models Ready")
    writes = plane.writes(since=mark)
    writers = [writer_of(e) for e in writes]
    old_writes = [e for e, w in zip(writes, writers, strict=True) if w == old[0].pod]
    new_writes = [e for e, w in zip(writes, writers, strict=True) if w != old[0].pod]
    assert {writer_of(e) for e in new_writes} == {leader}, "a standby wrote"
    if old_writes and new_writes:
        assert old_writes[-1]["stageTimestamp"] < new_writes[0]["requestReceivedTimestamp"]
    TIMINGS["upgrade from the pinned chart: helm upgrade --wait (s)"] = round(
        time.time() - began, 1
    )
    TIMINGS["upgrade from the pinned chart: Deployments with a new pod template"] = (
        f"{len(must_change)} (the ones the current release renders differently)"
    )
    state["leader"] = leader


# ---- 4. a release that changes pod templates -------------------------------------------------


class Sampler(threading.Thread):
    """Every 100 ms: per fleet model, is its template the new one, its rollout settled, its
    ready replicas; and which models wait for a slot (status)."""

    def __init__(self, plane: Plane) -> None:
        super().__init__(daemon=True)
        self.plane, self.samples, self.waiting = plane, [], set()
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            at = time.time()
            row = {}
            for name, d in self.plane.deployments(MODELS_NS).items():
                (c,) = d.spec.template.spec.containers
                new = c.readiness_probe.failure_threshold == 3
                st = d.status
                settled = (
                    (st.observed_generation or 0) >= d.metadata.generation
                    and (st.updated_replicas or 0) >= d.spec.replicas
                    and (st.ready_replicas or 0) >= d.spec.replicas
                    and (st.replicas or 0) <= d.spec.replicas
                )
                row[name] = (new, settled, st.ready_replicas or 0)
            for name, obj in self.plane.stored(MODELS_NS).items():
                for cond in (obj.get("status") or {}).get("conditions") or []:
                    if cond["type"] == "TemplateCurrent" and cond["status"] == "False":
                        self.waiting.add(name)
            self.samples.append((at, row))
            self.done.wait(0.1)


def test_4_a_release_that_changes_pod_templates_rolls_two_models_at_a_time(plane, state):
    sampler = Sampler(plane)
    sampler.start()
    began = time.time()
    try:
        plane.helm("upgrade", RELEASE, str(ROOT / "charts/sluice-operator"), "-n", NS,
                   "-f", str(plane.values), "--set", "image.tag=next",
                   "--set", f"operator.maxConcurrentModelRollouts={MAX_ROLLOUTS}",
                   "--wait", "--timeout", "180s")  # fmt: skip
        assert plane.apps.read_namespaced_deployment(LEASE, NS).spec.strategy.type == (
            "RollingUpdate"
        )

        def all_rolled():
            if not sampler.samples:
                return False
            _, row = sampler.samples[-1]
            return len(row) == N_MODELS and all(new and settled for new, settled, _ in row.values())

        eventually(all_rolled, timeout=240, interval=0.5, message="every model on the new template")
    finally:
        sampler.done.set()
        sampler.join(5)
    # Any model not settled is rolling (to the new template, or anywhere): nothing else
    # changes these models during the upgrade.
    rolling = [
        sum(1 for _, settled, _ in row.values() if not settled) for _, row in sampler.samples
    ]
    assert max(rolling) <= MAX_ROLLOUTS, f"{max(rolling)} models rolled at once"
    assert max(rolling) >= 1
    zero = [(at, n) for at, row in sampler.samples for n, (_, _, ready) in row.items() if ready < 1]
    assert not zero, f"models without a Ready replica: {zero[:5]}"
    assert len(sampler.waiting) >= N_MODELS // 2, sampler.waiting
    reasons = {e.reason for e in plane.core.list_namespaced_event(MODELS_NS).items}
    assert "RolloutWaiting" in reasons
    # The timeline: when each model got its new template and when its new pod was Ready.
    start, end = {}, {}
    for at, row in sampler.samples:
        for name, (new, settled, _) in row.items():
            if new:
                start.setdefault(name, at)
            if new and settled:
                end.setdefault(name, at)
    timeline = sorted((start[n] - began, end[n] - began, n) for n in start)
    TIMINGS["paced rollout: samples, most models rolling at once"] = (
        f"{len(sampler.samples)}, {max(rolling)} (limit {MAX_ROLLOUTS})"
    )
    TIMINGS["paced rollout timeline (s after helm upgrade: new template -> Ready)"] = ", ".join(
        f"{n} {s:.1f}->{e:.1f}" for s, e, n in timeline
    )
    TIMINGS["paced rollout: all 10 models rolled (s)"] = round(max(end.values()) - began, 1)
    state["leader"] = eventually(plane.lease_holder, timeout=30, message="a leader")


# ---- 5. the leader killed -----------------------------------------------------------------


def test_5_sigkill_of_the_leader_the_standby_takes_over_within_lease_plus_5s(plane, state):
    leader = eventually(plane.lease_holder, timeout=30, message="a leader")
    (standby,) = [c.pod for c in plane.pods.running() if c.pod != leader]
    mark = plane.cp.audit_mark()
    killed_at = plane.pods.kill(leader)
    plane.models.create(_fleet_model("after-kill"))
    eventually(lambda: "after-kill" in plane.deployments(MODELS_NS), timeout=LEASE_SECONDS + 15,
               interval=0.2, message="the standby to reconcile the new model")  # fmt: skip
    # Bytes a killed process had already sent may arrive a moment later; nothing after that.
    writes = [e for e in plane.writes(since=mark) if _ts(e["requestReceivedTimestamp"]) > killed_at]
    late = [
        e
        for e in writes
        if writer_of(e) == leader and _ts(e["requestReceivedTimestamp"]) > killed_at + 1
    ]
    assert not late, "the killed leader wrote after SIGKILL"
    writes = [e for e in writes if writer_of(e) == standby]
    first = _ts(writes[0]["requestReceivedTimestamp"])
    deployment = next(
        e for e in writes
        if e["objectRef"].get("resource") == "deployments" and e["objectRef"].get("name") == "after-kill"
    )  # fmt: skip
    reconciled = _ts(deployment["requestReceivedTimestamp"])
    TIMINGS["takeover after SIGKILL: standby's first write / new model's Deployment (s)"] = (
        f"{first - killed_at:.1f} / {reconciled - killed_at:.1f} (limit {LEASE_SECONDS + 5})"
    )
    assert reconciled - killed_at <= LEASE_SECONDS + 5
    assert plane.lease_holder() == standby
    # The killed pod is deleted (a kubelet would restart it); the Deployment replaces it.
    plane.core.delete_namespaced_pod(leader, NS)
    eventually(lambda: len(plane.pods.running()) == 2, timeout=90, message="a replacement pod")
    eventually(_ready(plane, MODELS_NS, ["after-kill"]), timeout=60, message="after-kill Ready")


# ---- 6. the leader cut off from the API server, alive ----------------------------------------


def _stopped_writing_at(log: str) -> float | None:
    for line in log.splitlines():
        if "stopped writing: could not renew" in line:
            try:
                return _ts(json.loads(line)["timestamp"])
            except (ValueError, KeyError):
                return None
    return None


def test_6_a_cut_off_leader_stops_writing_before_the_standby_starts(plane, state):
    leader = eventually(plane.lease_holder, timeout=30, message="a leader")
    (standby,) = [c.pod for c in plane.pods.running() if c.pod != leader]
    cut_pod = plane.pods.by_pod(leader)
    mark = plane.cp.audit_mark()
    cut_pod.proxy.cut()
    cut_at = cut_pod.proxy.cut_at
    stopped = eventually(lambda: _stopped_writing_at(cut_pod.log_text()), timeout=RENEW_DEADLINE + 10,
                         message="the cut-off leader to log that it stopped writing")  # fmt: skip
    eventually(lambda: plane.lease_holder() == standby, timeout=LEASE_SECONDS + 10,
               message="the standby to take the Lease")  # fmt: skip
    plane.models.create(_fleet_model("after-cut"))
    eventually(_ready(plane, MODELS_NS, ["after-cut"]), timeout=60, message="after-cut Ready")
    # The old leader's network comes back: it sees the new holder and writes nothing.
    cut_pod.proxy.restore()
    eventually(lambda: f"the leader is {plane.lease_holder()}" in cut_pod.log_text().split(
        "stopped writing")[-1], timeout=30, message="the old leader to see the new one")  # fmt: skip
    plane.models.create(_fleet_model("after-restore"))
    eventually(
        _ready(plane, MODELS_NS, ["after-restore"]), timeout=60, message="after-restore Ready"
    )
    writes = plane.writes(since=mark)
    by_old = [e for e in writes if writer_of(e) == leader]
    by_new = [e for e in writes if writer_of(e) == standby]
    assert by_new, "the standby never wrote"
    standby_first = _ts(by_new[0]["requestReceivedTimestamp"])
    old_last = max((_ts(e["stageTimestamp"]) for e in by_old), default=cut_at)
    assert old_last <= standby_first, "writes of the two replicas interleave"
    renewals = [e for e in by_old if e["objectRef"].get("resource") == "leases"]
    assert all(_ts(e["requestReceivedTimestamp"]) <= cut_at for e in renewals)
    assert stopped < standby_first, "the old leader still could write when the standby started"
    TIMINGS["cut-off leader: cut -> stopped writing -> standby's first write (s)"] = (
        f"0 -> {stopped - cut_at:.1f} -> {standby_first - cut_at:.1f} "
        f"(margin {standby_first - stopped:.1f}, designed >= {LEASE_SECONDS - RENEW_DEADLINE})"
    )
