"""An ingress that follows the cluster: Debian's nginx configured from Ingress objects.

Test harness, not product. `IngressController(api, workdir).start()` runs one nginx on
127.0.0.1 (`url`) and, every `period` seconds, renders its configuration from the
Ingresses of its class (`ingressClassName`, default `nginx`) and the Ready pods behind their
backend Services (endpoints.py, as the controller reads EndpointSlices); when the text
changes it checks it (`nginx -t`) and reloads nginx (SIGHUP: new workers take new
connections, old workers finish the requests they hold, streams included).

It follows ingress-nginx (the community controller, `nginx.ingress.kubernetes.io/*`), the
controller the operator's default annotations are written for (builders/ingress.py):
- one `server` per host (rules without a host go to the default server), paths `Prefix`
  (`/p` matches `/p` and `/p/...`, never `/px`), `Exact`, and `ImplementationSpecific` as
  a prefix; the request URI goes upstream unchanged (no rewrite annotations);
- annotations with ingress-nginx's defaults when absent: `proxy-buffering` (off),
  `proxy-request-buffering` (on), `proxy-http-version` (1.1), `proxy-read-timeout` and
  `proxy-send-timeout` (60 s), `proxy-connect-timeout` (5 s), `proxy-body-size` (1m);
  `affinity: cookie` with `session-cookie-name` (INGRESSCOOKIE) and `session-cookie-path`;
- WebSocket upgrade only when the client asks; `proxy_next_upstream error timeout`, 3 tries
  (its defaults), so a pod that went away between two reloads costs a retry, not an error;
- a backend with no Ready endpoint answers 503, as ingress-nginx does;
- the balancing method the operator's `spec.routing.balance` annotations ask for: F5's
  `nginx.org/lb-method: least_conn` becomes nginx's `least_conn` upstream directive (what
  that controller writes); `round_robin` (either controller's) is nginx's default;
- `upstream-vhost`: the Host header sent upstream (else the client's); an `ExternalName`
  backend naming a Service of the cluster is that Service's endpoints (endpoints.py);
- harness only: every proxied response carries `X-E2E-Upstream: <pod ip:port>`.
What it leaves out: TLS, the other `nginx.org/*` (F5) annotations, ingress-nginx's `ewma`
(round robin here), regex paths and rewrites, auth
and rate-limit annotations, upstream keep-alive, canary and every other annotation; the
affinity cookie holds the endpoint's address (ingress-nginx stores a hash of it) and always
behaves as `affinity-mode: persistent`; reloads happen on every endpoint change (the
controller changes endpoints through Lua without a reload); HTTPRoute is not followed.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from kubernetes import client
from testkit.nginx import LB_DIRECTIVES, find_nginx, main_config, start_nginx
from testkit.process import ManagedProcess

from .endpoints import ready_endpoints

ANN = "nginx.ingress.kubernetes.io/"
F5_LB_METHOD = "nginx.org/lb-method"
DEFAULTS = {
    "proxy-buffering": "off",
    "proxy-request-buffering": "on",
    "proxy-http-version": "1.1",
    "proxy-read-timeout": "60",
    "proxy-send-timeout": "60",
    "proxy-connect-timeout": "5",
    "proxy-body-size": "1m",
    "session-cookie-name": "INGRESSCOOKIE",
}
# The access log: which pod answered, how, and how long it took (a stream's whole life).
LOG_FORMAT = (
    "$msec $status $upstream_addr $upstream_status $request_time $bytes_sent "
    '"$request_method $uri" "$http_x_e2e_id"'
)


@dataclass(frozen=True)
class Route:
    """One Ingress path, resolved: what the config renders."""

    namespace: str
    ingress: str
    host: str  # "" = any host
    path: str
    path_type: str
    service: str
    port: int | str
    annotations: dict[str, str]
    endpoints: tuple[str, ...]  # ip:port of Ready pods

    def ann(self, key: str) -> str | None:
        return self.annotations.get(ANN + key, DEFAULTS.get(key))

    def setting(self, key: str) -> str:
        """An annotation that has a default (`DEFAULTS`)."""
        return self.annotations.get(ANN + key, DEFAULTS[key])

    @property
    def lb_directive(self) -> str:
        return LB_DIRECTIVES.get(self.annotations.get(F5_LB_METHOD, "round_robin"), "")

    @property
    def upstream(self) -> str:
        return re.sub(r"[^A-Za-z0-9_]", "_", f"{self.namespace}_{self.service}_{self.port}")

    @property
    def pin(self) -> str:
        """The affinity map's variable: short, whatever the names (nginx hashes variable
        names in buckets of 64 bytes by default)."""
        return "$pin_" + hashlib.sha1(self.upstream.encode()).hexdigest()[:12]


def _seconds(value: str) -> str:
    return value if value.endswith(("s", "m", "h")) else f"{value}s"


def _locations(route: Route) -> list[str]:
    path = route.path or "/"
    if route.path_type == "Exact":
        return [f"= {path}"]
    base = path.rstrip("/")
    return [f"= {base}", f"{base}/"] if base else ["/"]


def _location_body(route: Route) -> str:
    lines = []
    if not route.endpoints:
        return "            return 503;\n"
    target = route.upstream
    if route.ann("affinity") == "cookie":
        name = route.setting("session-cookie-name")
        path = route.annotations.get(ANN + "session-cookie-path") or route.path or "/"
        target = route.pin
        lines.append(
            f'add_header Set-Cookie "{name}=$upstream_addr; Path={path}; HttpOnly" always;'
        )
    on_off = {"on": "on", "off": "off", "true": "on", "false": "off"}
    lines += [
        # Harness only: which pod answered, for clients that must know (the autoscaling load).
        "add_header X-E2E-Upstream $upstream_addr always;",
        f"proxy_pass http://{target};",
        f"proxy_http_version {route.setting('proxy-http-version')};",
        f"proxy_set_header Host {route.annotations.get(ANN + 'upstream-vhost') or '$host'};",
        "proxy_set_header X-Forwarded-For $remote_addr;",
        "proxy_set_header X-Real-IP $remote_addr;",
        "proxy_set_header Upgrade $http_upgrade;",
        "proxy_set_header Connection $connection_upgrade;",
        f"proxy_buffering {on_off[route.setting('proxy-buffering').lower()]};",
        f"proxy_request_buffering {on_off[route.setting('proxy-request-buffering').lower()]};",
        f"proxy_connect_timeout {_seconds(route.setting('proxy-connect-timeout'))};",
        f"proxy_read_timeout {_seconds(route.setting('proxy-read-timeout'))};",
        f"proxy_send_timeout {_seconds(route.setting('proxy-send-timeout'))};",
        f"client_max_body_size {route.setting('proxy-body-size')};",
        "proxy_next_upstream error timeout;",
        "proxy_next_upstream_tries 3;",
    ]
    return "".join(f"            {line}\n" for line in lines)


def render(routes: list[Route], listen_port: int, prefix: Path) -> str:
    """nginx.conf for `routes` (the first Ingress to claim a host+path keeps it, as
    ingress-nginx keeps the oldest)."""
    upstreams: dict[str, tuple[str, ...]] = {}
    methods: dict[str, str] = {}  # upstream -> its balancing directive
    pins: dict[str, tuple[str, str]] = {}  # upstream -> (cookie name, map variable)
    servers: dict[str, dict[str, Route]] = {}
    for r in routes:
        taken = servers.setdefault(r.host, {})
        for loc in _locations(r):
            taken.setdefault(loc, r)
        if r.endpoints:
            upstreams[r.upstream] = r.endpoints
            methods[r.upstream] = r.lb_directive
            if r.ann("affinity") == "cookie":
                pins[r.upstream] = (r.setting("session-cookie-name"), r.pin)
    http = []
    for name, eps in sorted(upstreams.items()):
        listed = " ".join(f"server {e};" for e in eps)
        http.append(f"    upstream {name} {{ {methods[name]}{listed} }}")
    for upstream, (cookie, var) in sorted(pins.items()):
        known = "".join(
            f'        "~(^|;\\s*){re.escape(cookie)}={re.escape(e)}(;|$)" {e};\n'
            for e in upstreams[upstream]
        )
        http.append(f"    map $http_cookie {var} {{\n        default {upstream};\n"
                    f"{known}    }}")  # fmt: skip
    if "" not in servers:
        servers[""] = {}
    for host, locs in sorted(servers.items()):
        default = " default_server" if host == "" else ""
        body = "".join(f"        location {loc} {{\n{_location_body(r)}        }}\n"
                       for loc, r in sorted(locs.items()))  # fmt: skip
        http.append(f"    server {{\n        listen 127.0.0.1:{listen_port}{default};\n"
                    f"        server_name {host or '_'};\n{body}    }}")  # fmt: skip
    return main_config(prefix, "\n".join(http), rendered_by="the e2e ingress from the cluster's Ingresses",
                       log_format=LOG_FORMAT, error_level="notice", worker_connections=1024)  # fmt: skip


@dataclass
class Reload:
    at: float  # time.time()
    endpoints: dict[str, tuple[str, ...]] = field(default_factory=dict)
    methods: dict[str, str] = field(default_factory=dict)  # upstream -> balancing directive


class IngressController:
    def __init__(self, api: client.ApiClient, workdir: Path, class_name: str = "nginx",
                 period: float = 0.5, cpus: set[int] | None = None) -> None:  # fmt: skip
        binary = find_nginx()
        if binary is None:
            raise FileNotFoundError("nginx not installed (apt-get install -y nginx)")
        self.binary = binary
        self.core = client.CoreV1Api(api)
        self.net = client.NetworkingV1Api(api)
        self.prefix = Path(workdir)
        self.prefix.mkdir(parents=True, exist_ok=True)
        self.class_name = class_name
        self.period = period
        self.cpus = cpus
        self.port = 0
        self.conf = self.prefix / "nginx.conf"
        self.reloads: list[Reload] = []
        self.errors: list[str] = []
        self.process: ManagedProcess | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="ingress", daemon=True)
        self._text = ""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def access_log(self) -> Path:
        return self.prefix / "access.log"

    def start(self) -> IngressController:
        def render_for(port: int) -> str:
            return render(self._routes(), port, self.prefix)

        started = start_nginx(self.binary, self.prefix, render_for, name="ingress-nginx",
                              cpus=self.cpus)  # fmt: skip
        self.process, self.port, self._text = started.process, started.port, started.text
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        if self.process is not None:
            self.process.stop()

    def sync(self) -> bool:
        """Render from the cluster now; reload when the text changed."""
        routes = self._routes()
        text = render(routes, self.port, self.prefix)
        if text == self._text:
            return False
        candidate = self.prefix / "nginx.conf.new"
        candidate.write_text(text)
        test = subprocess.run([self.binary, "-t", "-q", "-p", str(self.prefix), "-e",
                               str(self.prefix / "error.log"), "-c", str(candidate)],
                              capture_output=True, text=True)  # fmt: skip
        if test.returncode != 0:
            self.errors.append(f"config refused: {test.stderr.strip()}")
            self._text = text  # do not retry the same text every period
            return False
        shutil.move(candidate, self.conf)
        self._text = text
        assert self.process is not None, "sync() runs after start()"
        self.process.started().send_signal(signal.SIGHUP)
        self.reloads.append(Reload(time.time(), {r.upstream: r.endpoints for r in routes},
                                   {r.upstream: r.lb_directive for r in routes}))  # fmt: skip
        return True

    def _loop(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self.sync()
            except Exception as e:  # the API server busy or going away: next period
                self.errors.append(f"sync: {e}")

    def _routes(self) -> list[Route]:
        out = []
        ingresses = self.net.list_ingress_for_all_namespaces().items
        for ing in sorted(
            ingresses, key=lambda i: (i.metadata.creation_timestamp, i.metadata.name)
        ):
            if ing.spec.ingress_class_name != self.class_name or ing.metadata.deletion_timestamp:
                continue
            ns = ing.metadata.namespace
            for rule in ing.spec.rules or []:
                for p in (rule.http.paths if rule.http else None) or []:
                    svc = p.backend.service
                    if svc is None:
                        continue
                    port = svc.port.number if svc.port.number is not None else svc.port.name
                    eps = ready_endpoints(self.core, ns, svc.name, port)
                    out.append(Route(ns, ing.metadata.name, rule.host or "", p.path or "/",
                                     p.path_type, svc.name, port,
                                     dict(ing.metadata.annotations or {}),
                                     tuple(e.address for e in eps)))  # fmt: skip
        return out
