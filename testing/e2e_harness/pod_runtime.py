"""One pod on the node agent: its containers as bubblewrap sandboxes, run as a kubelet would.

`PodRuntime(pod, host)` owns one pod's life on the node (node_agent.py calls it):
- volumes: emptyDir (`medium: Memory` a tmpfs of `sizeLimit`, otherwise a folder of the
  pod's), Secret and ConfigMap volumes projected (sandbox.Projection), `projected` and
  `downwardAPI` volumes (sandbox.ProjectedVolume: the ServiceAccount token from
  `host.service_account_token`, bound to the pod), all refreshed by
  `refresh_projections()`, PVCs bound from one host folder per claim (`host.pvc_dir`); a
  volume that cannot be made yet is tried again every second;
- env: sandbox.container_env plus the API server's `KUBERNETES_SERVICE_*` (`host.api_server`);
- the termination message: a fresh host file per start bound at the container's
  `terminationMessagePath` (default /dev/termination-log; only paths under /dev, which is
  the sandbox's own), read into `terminated.message` when it exits (at most 4096 bytes, as
  the kubelet), or with `FallbackToLogsOnError` and a failure and no message, the log's
  last 80 lines (at most 2048 bytes);
- each container: sandbox.py's argv, env and mounts, started under bwrap with its output in
  `<log_dir>/<namespace>.<pod>.<container>.log` (appended across restarts, as `kubectl logs
  --previous` would need);
- probes, one worker thread per probe as in the kubelet's prober: `initialDelaySeconds`,
  `periodSeconds`, `timeoutSeconds`, `successThreshold`, `failureThreshold`; httpGet (to the
  pod IP, port by number or name), tcpSocket, exec (nsenter into the sandbox). The startup
  probe holds the others, and readiness is probed the moment it passes, as the kubelet
  does; readiness sets the container's `ready`; a failed liveness or startup probe restarts
  the container;
- restarts per `restartPolicy` with the kubelet's back-off (none for the first restart, then
  10 s doubling to 300 s, reset after 10 minutes of running); the status says
  `CrashLoopBackOff` while waiting;
- deletion: `terminate(grace)`: each container's preStop (sleep, exec, httpGet) within the
  grace period, then SIGTERM to the sandbox's PID 1 (the bwrap child, not bwrap itself,
  which would die and take the server with it), then SIGKILL when the grace period ends; the
  exit codes go to the pod's status and to `host.record_exit`.
The status (phase, conditions, containerStatuses) is recomputed every tick and patched
only when it changed.
"""

from __future__ import annotations

import atexit
import datetime as dt
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from . import sandbox as sb

TICK = 0.2
BACKOFF_FIRST, BACKOFF_MAX, BACKOFF_RESET = 10.0, 300.0, 600.0
MIN_GRACE_AFTER_PRESTOP = 2.0  # the kubelet's minimum between preStop and SIGKILL
# bwrap's --die-with-parent is PR_SET_PDEATHSIG, which fires when the *thread* that forked
# it ends: sandboxes are spawned from this one long-lived thread, never from a pod's own.
_SPAWNER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sandbox-spawner")


def rfc3339(t: float | None = None) -> str:
    return dt.datetime.fromtimestamp(t or time.time(), dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class Host(Protocol):
    """What the node agent gives a pod."""

    host_ip: str
    log_dir: Path
    cpus: set[int] | None
    api_server: tuple[str, int] | None  # the API server's (host, port) for in-cluster clients

    def lookup(self, kind: str, namespace: str, name: str) -> dict[str, bytes] | None: ...
    def service_account_token(self, pod: dict, audience: str | None,
                              seconds: int) -> tuple[str, float]: ...  # fmt: skip
    def pvc_dir(self, namespace: str, claim: str) -> Path: ...
    def patch_status(self, pod: dict, status: dict) -> None: ...
    def record_exit(self, pod: dict, container: str, code: int, why: str) -> None: ...


@dataclass
class ContainerState:
    spec: dict
    restart_count: int = 0
    state: dict = field(default_factory=lambda: {"waiting": {"reason": "ContainerCreating"}})
    last_state: dict = field(default_factory=dict)
    started: bool = False
    ready: bool = False
    proc: subprocess.Popen | None = None
    generation: int = 0  # bumped per start; probe workers of an older start stop
    started_at: float = 0.0
    restart_at: float | None = None  # back-off: when to start again
    kill_reason: str | None = None  # set by a failed liveness/startup probe
    stopping: bool = False
    sandbox: sb.Sandbox | None = None
    env: dict[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.spec["name"]

    def pid1(self) -> int | None:
        """The host pid of the sandbox's PID 1 (bwrap's only child)."""
        if self.proc is None or self.proc.poll() is not None:
            return None
        try:
            kids = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text()
        except OSError:
            return None
        return int(kids.split()[0]) if kids.split() else None


class PodRuntime:
    def __init__(self, pod: dict, pod_ip: str, host: Host, workdir: Path) -> None:
        self.pod, self.ip, self.host = pod, pod_ip, host
        meta = pod["metadata"]
        self.namespace, self.name, self.uid = meta["namespace"], meta["name"], meta["uid"]
        self.dir = workdir / f"{self.namespace}.{self.name}.{self.uid[:8]}"
        self.containers = [ContainerState(c) for c in pod["spec"]["containers"]]
        self.policy = pod["spec"].get("restartPolicy", "Always")
        self.projections: list[sb.Projection] = []
        self.projected: list[sb.ProjectedVolume] = []
        self.mounts: dict[str, sb.Mount] = {}  # volume name -> how it mounts (minus target)
        self.error: tuple[str, str] | None = None  # (reason, message) for every container
        self.start_time = time.time()
        self.terminating = threading.Event()
        self.done = threading.Event()
        self._lock = threading.Lock()
        self._last_status: dict | None = None
        # A condition's last transition, kept while its status stays: the kubelet's status
        # manager keeps what the API server already has (PodScheduled, set at binding).
        self._transitions: dict[str, tuple[str, str]] = {
            c["type"]: (c["status"], c["lastTransitionTime"])
            for c in (pod.get("status") or {}).get("conditions") or []
            if c.get("lastTransitionTime")
        }
        self._thread = threading.Thread(target=self._run, name=f"pod-{self.name}", daemon=True)

    # --- public ----------------------------------------------------------------------
    def start(self) -> PodRuntime:
        self._thread.start()
        return self

    def terminate(self, grace: float) -> None:
        """Stop every container (preStop, SIGTERM, SIGKILL at `grace`), report, return."""
        if self.terminating.is_set():
            self.done.wait()
            return
        self.terminating.set()
        deadline = time.monotonic() + grace
        threads = [threading.Thread(target=self._stop_container, args=(c, deadline, True),
                                    daemon=True) for c in self.containers]  # fmt: skip
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self._thread.join(timeout=5)
        self._report(force=True)
        self.done.set()

    def kill_now(self) -> None:
        """The node died: SIGKILL every sandbox, report nothing."""
        self.terminating.set()
        for c in self.containers:
            if c.proc is not None and c.proc.poll() is None:
                c.proc.kill()
                c.proc.wait()
        self.done.set()

    def refresh_projections(self) -> int:
        """Re-read every Secret/ConfigMap volume's object and every projected volume's
        sources (a token near its end is minted again); how many volumes changed."""
        changed = 0
        for p in self.projections:
            try:
                changed += p.write(self.host.lookup(p.kind, self.namespace, p.name))
            except sb.ConfigError:
                pass  # the kubelet keeps the last content when the object goes away
        for v in self.projected:
            try:
                changed += v.refresh(self.host.lookup, self._token)
            except sb.ConfigError:
                pass
        return changed

    def _token(self, audience: str | None, seconds: int) -> tuple[str, float]:
        return self.host.service_account_token(self.pod, audience, seconds)

    def ready(self) -> bool:
        return not self.terminating.is_set() and all(c.ready for c in self.containers)

    def pids(self) -> list[int]:
        return [c.proc.pid for c in self.containers if c.proc is not None and c.proc.poll() is None]

    def container(self, name: str) -> ContainerState:
        return next(c for c in self.containers if c.name == name)

    # --- the pod's loop --------------------------------------------------------------
    def _run(self) -> None:
        # Volumes first; a source that is not there yet (a ConfigMap the controller manager
        # publishes a moment after the namespace exists) is tried again, as the kubelet does.
        while True:
            try:
                self._prepare_volumes()
                self.error = None
                break
            except sb.ConfigError as e:
                self.error = ("CreateContainerConfigError", str(e))
                self._report()
                if self.terminating.wait(1.0):
                    break
        for c in self.containers:
            if self.error is None:
                self._start_container(c)
        while not self.terminating.wait(TICK):
            now = time.monotonic()
            for c in self.containers:
                self._watch_container(c, now)
            self._report()
            if self.policy != "Always" and all("terminated" in c.state for c in self.containers):
                if all(c.restart_at is None for c in self.containers):
                    break
        self._report()

    def _watch_container(self, c: ContainerState, now: float) -> None:
        with self._lock:
            if c.stopping:
                return
            self._check_container(c, now)

    def _check_container(self, c: ContainerState, now: float) -> None:
        if c.kill_reason and c.proc is not None and c.proc.poll() is None:
            reason = c.kill_reason
            grace = float(self.pod["spec"].get("terminationGracePeriodSeconds", 30))
            threading.Thread(target=self._stop_container,
                             args=(c, time.monotonic() + grace, True, reason),
                             daemon=True).start()  # fmt: skip
            return
        if c.proc is not None and c.proc.poll() is not None:
            self._exited(c)
        if c.restart_at is not None and now >= c.restart_at and not self.terminating.is_set():
            c.restart_at = None
            c.restart_count += 1
            self._start_container(c)

    def _exited(self, c: ContainerState, why: str | None = None) -> None:
        code = c.proc.returncode if c.proc is not None else -1
        if code < 0:  # Popen: killed by a signal; bwrap itself reports 128+n
            code = 128 - code
        c.proc = None
        c.ready = c.started = False
        finished = time.time()
        reason = "Completed" if code == 0 else "Error"
        c.state = {"terminated": {"exitCode": code, "reason": reason,
                                  "startedAt": rfc3339(c.started_at),
                                  "finishedAt": rfc3339(finished)}}  # fmt: skip
        message = self._termination_message(c, code)
        if why:  # the kubelet says this in an Event; here it is in the status too
            c.state["terminated"]["message"] = f"killed: {why}"
        elif message:
            c.state["terminated"]["message"] = message
        self.host.record_exit(self.pod, c.name, code, why or reason)
        restart = self.policy == "Always" or (self.policy == "OnFailure" and code != 0)
        if restart and not self.terminating.is_set():
            ran = finished - c.started_at
            if c.restart_count == 0 or ran > BACKOFF_RESET:
                delay = 0.0
            else:
                delay = min(BACKOFF_MAX, BACKOFF_FIRST * 2 ** (c.restart_count - 1))
            c.restart_at = time.monotonic() + delay
            c.last_state = c.state
            c.state = {"waiting": {"reason": "CrashLoopBackOff" if delay else "ContainerCreating",
                                   "message": f"back-off {delay:.0f}s restarting failed "
                                              f"container={c.name} pod={self.name}"}}  # fmt: skip

    # --- the termination message -------------------------------------------------------
    def _termination_file(self, c: ContainerState) -> Path:
        return self.dir / "termination" / c.name

    def _termination_mount(self, c: ContainerState) -> list[sb.Mount]:
        """A fresh file at the container's terminationMessagePath (under /dev only)."""
        target = c.spec.get("terminationMessagePath") or "/dev/termination-log"
        if not target.startswith("/dev/"):
            return []
        path = self._termination_file(c)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"")
        path.chmod(0o666)
        return [sb.Mount(target, path)]

    def _termination_message(self, c: ContainerState, code: int) -> str:
        path = self._termination_file(c)
        text = path.read_bytes()[:4096].decode("utf-8", "replace") if path.exists() else ""
        policy = c.spec.get("terminationMessagePolicy") or "File"
        if not text and code != 0 and policy == "FallbackToLogsOnError":
            log = self.host.log_dir / f"{self.namespace}.{self.name}.{c.name}.log"
            if log.exists():
                tail = log.read_bytes()[-2048:].decode("utf-8", "replace")
                text = "\n".join(tail.splitlines()[-80:])
        return text

    # --- volumes ---------------------------------------------------------------------
    def _prepare_volumes(self) -> None:
        self.projections, self.projected, self.mounts = [], [], {}
        for vol in self.pod["spec"].get("volumes") or []:
            name = vol["name"]
            if "emptyDir" in vol:
                ed = vol["emptyDir"] or {}
                if ed.get("medium") == "Memory":
                    size = sb.quantity_bytes(ed["sizeLimit"]) if ed.get("sizeLimit") else None
                    self.mounts[name] = sb.Mount("", None, size=size)
                else:
                    path = self.dir / "volumes" / name
                    path.mkdir(parents=True, exist_ok=True)
                    self.mounts[name] = sb.Mount("", path)
            elif "secret" in vol or "configMap" in vol:
                kind = "secret" if "secret" in vol else "configmap"
                src = vol["secret"] if "secret" in vol else vol["configMap"]
                obj = src.get("secretName") or src.get("name")
                p = sb.Projection(self.dir / "volumes" / name, kind, obj, src.get("items"),
                                  src.get("defaultMode", 0o644), bool(src.get("optional")))  # fmt: skip
                p.write(self.host.lookup(kind, self.namespace, obj))
                self.projections.append(p)
                self.mounts[name] = sb.Mount("", p.root, read_only=True)
            elif "projected" in vol or "downwardAPI" in vol:
                if "projected" in vol:
                    src, sources = vol["projected"], vol["projected"].get("sources") or []
                else:
                    src, sources = vol["downwardAPI"], [{"downwardAPI": vol["downwardAPI"]}]
                v = sb.ProjectedVolume(self.dir / "volumes" / name, sources,
                                       src.get("defaultMode", 0o644), self.pod, self.ip,
                                       self.host.host_ip)  # fmt: skip
                v.refresh(self.host.lookup, self._token)
                self.projected.append(v)
                self.mounts[name] = sb.Mount("", v.root, read_only=True)
            elif "persistentVolumeClaim" in vol:
                pvc = vol["persistentVolumeClaim"]
                path = self.host.pvc_dir(self.namespace, pvc["claimName"])
                self.mounts[name] = sb.Mount("", path, read_only=bool(pvc.get("readOnly")))
            else:
                kinds = sorted(set(vol) - {"name"})
                raise sb.ConfigError(f"volume {name}: {kinds} not supported by the e2e node agent")

    def _container_mounts(self, c: ContainerState) -> list[sb.Mount]:
        out = []
        for m in c.spec.get("volumeMounts") or []:
            base = self.mounts.get(m["name"])
            if base is None:
                raise sb.ConfigError(f"volumeMount {m['name']}: no such volume")
            source = base.source
            if m.get("subPath") and source is not None:
                source = source / m["subPath"]
            read_only = base.read_only or bool(m.get("readOnly"))
            out.append(sb.Mount(_host_target(m["mountPath"]), source, read_only, base.size))
        return out

    def _hosts_file(self) -> list[sb.Mount]:
        """`spec.hostAliases` the kubelet's way: its own /etc/hosts for the pod (localhost,
        the pod's address and name, then the aliases), bound read-only over the host's."""
        aliases = self.pod["spec"].get("hostAliases") or []
        if not aliases:
            return []
        lines = ["127.0.0.1\tlocalhost", f"{self.ip}\t{self.name}",
                 "# Entries added by HostAliases."]  # fmt: skip
        lines += [f"{a['ip']}\t{chr(9).join(a.get('hostnames') or [])}" for a in aliases]
        path = self.dir / "etc-hosts"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(lines) + "\n")
        return [sb.Mount("/etc/hosts", path, read_only=True)]

    # --- containers ------------------------------------------------------------------
    def _start_container(self, c: ContainerState) -> None:
        try:
            image = sb.resolve_image(c.spec["image"])
        except sb.ImageError as e:
            c.state = {"waiting": {"reason": "ErrImagePull", "message": str(e)}}
            return
        try:
            api = self.host.api_server
            c.env = sb.container_env(c.spec, self.pod, image, self.host.lookup, self.ip,
                                     self.host.host_ip,
                                     sb.api_server_env(*api) if api else None)  # fmt: skip
            argv = sb.container_argv(c.spec, image, c.env, self.ip)
            uid, gid = sb.run_as(c.spec, self.pod, image)
            mounts = self._container_mounts(c) + self._hosts_file() + self._termination_mount(c)
        except sb.ConfigError as e:
            c.state = {"waiting": {"reason": "CreateContainerConfigError", "message": str(e)}}
            return
        sc = c.spec.get("securityContext") or {}
        drop = [x.upper() for x in (sc.get("capabilities") or {}).get("drop") or []]
        c.sandbox = sandbox = sb.Sandbox(argv, uid, gid, mounts, c.spec.get("workingDir") or "/",
                               read_only_root=bool(sc.get("readOnlyRootFilesystem")),
                               drop_all_caps="ALL" in drop, image_paths=image.paths)  # fmt: skip
        for point in sandbox.mount_points():
            Path(point).mkdir(parents=True, exist_ok=True)  # on the host: see sandbox.py
        log = self.host.log_dir / f"{self.namespace}.{self.name}.{c.name}.log"
        cpus = self.host.cpus

        def setup() -> None:
            if cpus:
                os.sched_setaffinity(0, cpus)

        def spawn() -> subprocess.Popen:
            with log.open("ab") as out:
                return subprocess.Popen(sandbox.bwrap_argv(), stdin=subprocess.DEVNULL,
                                        stdout=out, stderr=subprocess.STDOUT, env=c.env,
                                        start_new_session=True, preexec_fn=setup)  # fmt: skip

        c.proc = _SPAWNER.submit(spawn).result()
        atexit.register(_kill, c.proc)
        c.generation += 1
        c.started_at = time.time()
        c.kill_reason = None
        c.state = {"running": {"startedAt": rfc3339(c.started_at)}}
        probes = {k: c.spec.get(k) for k in ("startupProbe", "readinessProbe", "livenessProbe")}
        c.started = probes["startupProbe"] is None
        c.ready = c.started and probes["readinessProbe"] is None
        for kind, probe in probes.items():
            if probe is not None:
                threading.Thread(target=self._probe_worker, args=(c, c.generation, kind, probe),
                                 name=f"{self.name}-{c.name}-{kind}", daemon=True).start()  # fmt: skip

    def _stop_container(self, c: ContainerState, deadline: float, pre_stop: bool,
                        why: str | None = None) -> None:  # fmt: skip
        with self._lock:
            if c.stopping:
                return
            c.stopping = True
        try:
            c.restart_at = None if self.terminating.is_set() else c.restart_at
            if c.proc is None or c.proc.poll() is not None:
                if c.proc is not None:
                    self._exited(c, why)
                return
            c.ready = False
            hook = ((c.spec.get("lifecycle") or {}).get("preStop")) if pre_stop else None
            if hook:
                self._run_hook(c, hook, deadline)
                deadline = max(deadline, time.monotonic() + MIN_GRACE_AFTER_PRESTOP)
            pid = c.pid1()
            if pid is not None:
                try:
                    os.kill(pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
            try:
                c.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                c.proc.kill()  # bwrap dies, --die-with-parent takes PID 1, the namespace goes
                c.proc.wait()
            self._exited(c, why)
        finally:
            c.stopping = False

    def _run_hook(self, c: ContainerState, hook: dict, deadline: float) -> None:
        budget = max(0.0, deadline - time.monotonic())
        if "sleep" in hook:
            time.sleep(min(budget, float(hook["sleep"]["seconds"])))
        elif "exec" in hook:
            _exec_in(c, hook["exec"]["command"], budget)
        elif "httpGet" in hook:
            _http_ok(self._url(c, hook["httpGet"]), budget)

    # --- probes ----------------------------------------------------------------------
    def _probe_worker(self, c: ContainerState, gen: int, kind: str, probe: dict) -> None:
        period = float(probe.get("periodSeconds", 10))
        timeout = float(probe.get("timeoutSeconds", 1))
        need_ok = int(probe.get("successThreshold", 1))
        need_fail = int(probe.get("failureThreshold", 3))
        ok = fail = 0

        def current() -> bool:
            return c.generation == gen and not self.terminating.is_set() and c.proc is not None

        if self.terminating.wait(float(probe.get("initialDelaySeconds", 0))):
            return
        while current():
            if kind == "readinessProbe" and not c.started:
                # The kubelet probes readiness at once when the startup probe passes (its
                # prober manager's manual trigger), not a period later.
                self.terminating.wait(0.05)
                continue
            if kind == "startupProbe" or c.started:
                passed = self._probe_once(c, probe, timeout)
                ok, fail = (ok + 1, 0) if passed else (0, fail + 1)
                if kind == "startupProbe":
                    if passed:
                        c.started = True
                        if c.spec.get("readinessProbe") is None:
                            c.ready = True
                        return
                    if fail >= need_fail:
                        c.kill_reason = "StartupProbeFailed"
                        return
                elif kind == "readinessProbe":
                    if ok >= need_ok:
                        c.ready = True
                    elif fail >= need_fail:
                        c.ready = False
                elif fail >= need_fail:  # liveness
                    c.kill_reason = "LivenessProbeFailed"
                    return
            self.terminating.wait(period)

    def _probe_once(self, c: ContainerState, probe: dict, timeout: float) -> bool:
        if "httpGet" in probe:
            return _http_ok(self._url(c, probe["httpGet"]), timeout)
        if "tcpSocket" in probe:
            try:
                port = self._port(c, probe["tcpSocket"]["port"])
                with socket.create_connection((self.ip, port), timeout=timeout):
                    return True
            except OSError:
                return False
        if "exec" in probe:
            return _exec_in(c, probe["exec"]["command"], timeout) == 0
        return True  # grpc: not emulated, counted as passing

    def _port(self, c: ContainerState, port: int | str) -> int:
        if isinstance(port, int) or str(port).isdigit():
            return int(port)
        for p in c.spec.get("ports") or []:
            if p.get("name") == port:
                return int(p["containerPort"])
        raise ValueError(f"no container port named {port}")

    def _url(self, c: ContainerState, get: dict) -> str:
        return f"http://{self.ip}:{self._port(c, get['port'])}{get.get('path', '/')}"

    # --- status ----------------------------------------------------------------------
    def _report(self, force: bool = False) -> None:
        status = self.status()
        if not force and status == self._last_status:
            return
        self._last_status = status
        self.host.patch_status(self.pod, {"status": self._stamped(status)})

    def status(self) -> dict:
        """The pod's status without transition times (compared between ticks)."""
        containers = []
        for c in self.containers:
            state = c.state
            if self.error is not None and "running" not in state and "terminated" not in state:
                state = {"waiting": {"reason": self.error[0], "message": self.error[1]}}
            entry = {"name": c.name, "image": c.spec["image"],
                     "imageID": f"local://{c.spec['image']}", "ready": c.ready,
                     "started": c.started, "restartCount": c.restart_count, "state": state}  # fmt: skip
            if c.proc is not None:
                entry["containerID"] = f"bwrap://{c.proc.pid}"
            if c.last_state:
                entry["lastState"] = c.last_state
            containers.append(entry)
        ended = [t for c in self.containers if (t := c.state.get("terminated"))]
        if len(ended) == len(self.containers) and (
            self.terminating.is_set() or self.policy != "Always"
        ):
            phase = "Succeeded" if all(t["exitCode"] == 0 for t in ended) else "Failed"
        elif any("running" in c.state or c.restart_count for c in self.containers):
            phase = "Running"
        else:
            phase = "Pending"
        ready = "True" if self.ready() else "False"
        conditions = {"PodReadyToStartContainers": "True", "Initialized": "True",
                      "ContainersReady": ready, "Ready": ready, "PodScheduled": "True"}  # fmt: skip
        return {"phase": phase, "conditions": conditions, "containerStatuses": containers,
                "podIP": self.ip}  # fmt: skip

    def _stamped(self, status: dict) -> dict:
        now = rfc3339()
        conds = []
        for t, s in status["conditions"].items():
            prev = self._transitions.get(t)
            if prev is None or prev[0] != s:
                self._transitions[t] = (s, now)
            conds.append({"type": t, "status": s, "lastTransitionTime": self._transitions[t][1]})
        return {**status, "conditions": conds, "podIPs": [{"ip": self.ip}],
                "hostIP": self.host.host_ip, "hostIPs": [{"ip": self.host.host_ip}],
                "startTime": rfc3339(self.start_time)}  # fmt: skip


def _host_target(path: str) -> str:
    """A mount target with the host's symlinks resolved (`/var/run` -> `/run`): the pod's
    root is the host's, and bwrap cannot make a mount point through an absolute symlink
    (as runc resolves a target inside the container's root). /dev is the sandbox's own."""
    if path == "/dev" or path.startswith("/dev/"):
        return path
    return os.path.realpath(path)


def _http_ok(url: str, timeout: float) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=max(timeout, 0.1)) as r:
            return 200 <= r.status < 400
    except (OSError, urllib.error.URLError, ValueError):
        return False


def _exec_in(c: ContainerState, command: list[str], timeout: float) -> int:
    """Run `command` inside the container's namespaces (as `kubectl exec` would)."""
    pid = c.pid1()
    if pid is None:
        return -1
    argv = ["nsenter", "-t", str(pid), "-U", "-m", "-p", "-i", "--preserve-credentials",
            "--", *command]  # fmt: skip
    try:
        return subprocess.run(argv, env=c.env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, timeout=max(timeout, 0.1)).returncode  # fmt: skip
    except subprocess.TimeoutExpired:
        return -1


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
