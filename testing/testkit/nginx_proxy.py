"""A real nginx (Debian's binary) in front of a test server, configured like our Ingress.

`NginxProxy(upstream_url, mode=...)` renders a config, starts nginx in the foreground on a
free loopback port and stops it on `stop()` / context exit. Modes:

- `ingress`: what the operator's Ingress asks ingress-nginx for (operator
  builders/ingress.py): `proxy_buffering off`, `proxy_request_buffering off`, HTTP/1.1
  upstream, `Upgrade`/`Connection` for WebSocket, long read/send timeouts, a body limit.
- `nginx-default`: stock nginx buffering (`proxy_buffering on`) plus gzip for event
  streams, honouring the server's `X-Accel-Buffering: no`: the header alone keeps it
  streaming.
- `buffered`: the negative control: the same, but `proxy_ignore_headers
  X-Accel-Buffering`. Streaming must visibly break through it.

`annotations` (the Ingress annotations the operator rendered) are honoured where they
change routing, so a wrong annotation fails a test: ingress-nginx cookie affinity
(`affinity: cookie`, `session-cookie-name`, `session-cookie-path`) pins a client to the
upstream server that answered it first, as ingress-nginx's balancer does (its cookie holds
a hash of the endpoint; ours holds the endpoint itself, mapped back over a fixed list).
Several upstream URLs make one upstream, round robin unless F5's `nginx.org/lb-method`
annotation asks for `least_conn` (nginx's own directive, which that annotation sets). `path` is the Ingress rule's path
(Prefix): only it is routed, unchanged, and everything else gets nginx's 404. `http2`:
the client side speaks HTTP/2 in cleartext (prior knowledge, as a gateway hop does); the
upstream side stays HTTP/1.1.

Measured with nginx 1.22: `proxy_buffering on` by itself does not delay an SSE response
(nginx forwards what it has read whenever the client socket is writable), so it is no
negative control. What does hold a stream is a body filter that only emits when its own
buffers fill or the response asks to flush, like gzip: with buffering off (or the header
honoured) every upstream read is a flush; with the header ignored, the answer arrives in
one burst at the end.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from testkit.nginx import LB_DIRECTIVES, find_nginx, main_config, start_nginx
from testkit.process import ManagedProcess

__all__ = ["NginxProxy", "find_nginx", "render_config"]
Mode = Literal["ingress", "nginx-default", "buffered"]


ING = "nginx.ingress.kubernetes.io/"


def render_config(
    prefix: Path,
    listen_port: int,
    upstream: str | list[str],
    mode: Mode = "ingress",
    *,
    timeout_seconds: int = 630,
    max_body: str = "1m",
    annotations: dict[str, str] | None = None,
    path: str = "/",
    http2: bool = False,
) -> str:
    """nginx.conf text. `upstream` is host:port (or several). Everything nginx writes stays
    in `prefix`."""
    upstreams = [upstream] if isinstance(upstream, str) else list(upstream)
    ann = annotations or {}
    servers = " ".join(f"server {u};" for u in upstreams)
    # The balancing method the operator's annotation asks for (builders/ingress.py
    # LB_METHODS): F5's lb-method is nginx's upstream directive; round_robin is nginx's
    # default and needs none.
    lb = ann.get("nginx.org/lb-method", "round_robin")
    if lb not in LB_DIRECTIVES:
        raise ValueError(
            f"nginx.org/lb-method {lb!r}: this test proxy knows {sorted(LB_DIRECTIVES)}"
        )
    method = LB_DIRECTIVES[lb]
    affinity_map, target, set_cookie = "", "sluice", ""
    if ann.get(ING + "affinity") == "cookie":
        name = ann.get(ING + "session-cookie-name", "INGRESSCOOKIE")
        path = ann.get(ING + "session-cookie-path", "/")
        # `$cookie_NAME` cannot name a cookie with a dash: match the Cookie header instead.
        known = "".join(f'        "~(^|;\\s*){name}={re.escape(u)}(;|$)" {u};\n' for u in upstreams)
        affinity_map = (f"map $http_cookie $sluice_pinned {{\n"
                        f"        default sluice;\n{known}    }}")  # fmt: skip
        target = "$sluice_pinned"
        set_cookie = f'add_header Set-Cookie "{name}=$upstream_addr; Path={path}; HttpOnly" always;'

    if mode == "ingress":
        buffering = "proxy_buffering off;\n        proxy_request_buffering off;"
    else:
        # Stock nginx buffering plus gzip for event streams, a common setup. With buffering
        # on, nginx only flushes gzip output when the response asks for no buffering
        # (`X-Accel-Buffering: no`); ignoring that header makes it hold the whole answer.
        buffering = (
            "proxy_buffering on;\n        gzip on;\n        gzip_proxied any;\n"
            "        gzip_types text/event-stream application/json;\n        gzip_buffers 16 64k;"
        )
        if mode == "buffered":
            buffering += "\n        proxy_ignore_headers X-Accel-Buffering;"
    # An Ingress `Prefix` path /p matches /p and /p/...: nginx locations `= /p` and `/p/`.
    prefix_path = path.rstrip("/")
    paths = [f"= {prefix_path}", f"{prefix_path}/"] if prefix_path else ["/"]
    location_body = f"""        proxy_pass http://{target};
        {set_cookie}
        proxy_http_version 1.1;
        proxy_set_header Host $host;
        proxy_set_header X-Forwarded-For $remote_addr;
        proxy_set_header Upgrade $http_upgrade;
        proxy_set_header Connection $connection_upgrade;
        proxy_read_timeout {timeout_seconds}s;
        proxy_send_timeout {timeout_seconds}s;
        {buffering}
"""
    locations = "\n".join(f"        location {p} {{\n{location_body}        }}" for p in paths)
    http = f"""    upstream sluice {{ {method}{servers} }}
    {affinity_map}
    server {{
        listen 127.0.0.1:{listen_port}{" http2" if http2 else ""};
        client_max_body_size {max_body};
{locations}
    }}"""
    return main_config(prefix, http, rendered_by=f"testing/testkit/nginx_proxy.py (mode: {mode})")


class NginxProxy:
    """`with NginxProxy("http://127.0.0.1:PORT") as p: p.url` (http://127.0.0.1:NGINX_PORT)."""

    def __init__(self, upstream_url: str | list[str], mode: Mode = "ingress", **render_kw) -> None:
        binary = find_nginx()
        if binary is None:
            raise FileNotFoundError("nginx not installed (apt-get install -y nginx)")
        self.binary = binary
        urls = [upstream_url] if isinstance(upstream_url, str) else upstream_url
        self.upstream = [f"{p.hostname}:{p.port}" for p in map(urlsplit, urls)]
        self.mode = mode
        self.render_kw = render_kw
        self.prefix = Path(tempfile.mkdtemp(prefix=f"sluice-nginx-{mode}-"))
        self.port = 0
        self.process: ManagedProcess | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    def error_log(self) -> str:
        try:
            return (self.prefix / "error.log").read_text()
        except OSError:
            return ""

    def start(self, wait_seconds: float = 10.0) -> NginxProxy:
        def render_for(port: int) -> str:
            return render_config(self.prefix, port, self.upstream, self.mode, **self.render_kw)

        started = start_nginx(self.binary, self.prefix, render_for, timeout=wait_seconds)
        self.process, self.port = started.process, started.port
        return self

    def stop(self, cleanup: bool = True) -> None:
        process, self.process = self.process, None
        if process is not None:
            process.stop()  # SIGTERM, fast shutdown: the master stops its workers
        if cleanup:
            shutil.rmtree(self.prefix, ignore_errors=True)

    def __enter__(self) -> NginxProxy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
