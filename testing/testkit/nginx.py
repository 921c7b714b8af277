"""Debian's nginx, for every suite that runs one (tests/server's proxy, the e2e ingress):
finding the binary, the main configuration around a caller's `http` block (`main_config`),
and starting it on a free port (`start_nginx`)."""

from __future__ import annotations

import os
import shutil
import socket
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

from testkit.net import free_port
from testkit.process import ManagedProcess
from testkit.wait import eventually

NGINX_CANDIDATES = ("/usr/sbin/nginx", "/usr/local/sbin/nginx", "/usr/local/bin/nginx")
# F5 NGINX Ingress's `nginx.org/lb-method` values the test proxies apply, as the nginx
# upstream directive that controller writes for each (round_robin is nginx's default).
LB_DIRECTIVES = {"round_robin": "", "least_conn": "least_conn; "}


def find_nginx() -> str | None:
    found = shutil.which("nginx")
    if found:
        return found
    return next((p for p in NGINX_CANDIDATES if os.access(p, os.X_OK)), None)


def run_as_root_directive() -> str:
    """Running as root (CI containers), workers would switch to `nobody` and could not write
    the temp folders in a private prefix: keep them root (throw-away test proxies)."""
    return "user root;\n" if os.geteuid() == 0 else ""


def wait_listening(port: int, alive: Callable[[], bool], *, timeout: float,
                   log: Callable[[], str]) -> bool:  # fmt: skip
    """Until a just-started nginx listens on `port` (True) or has exited (False: the free
    port was taken between the probe and the bind, or the config is bad; the caller reads
    why). `AssertionError` with `log()` after `timeout` seconds."""

    def listening_or_exited() -> str | None:
        if not alive():
            return "exited"
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return "listening"
        except OSError:
            return None

    state = eventually(listening_or_exited, timeout=timeout,
                       message=lambda: f"nginx to listen on {port}\n{log()}")  # fmt: skip
    return state == "listening"


def main_config(prefix: Path, http: str, *, rendered_by: str, log_format: str | None = None,
                error_level: str = "warn", worker_connections: int = 256) -> str:  # fmt: skip
    """nginx.conf around `http` (the http block's upstreams, maps and servers): one worker
    in the foreground, everything nginx writes inside `prefix` (pid, logs, temp folders),
    the access log in `prefix/access.log` (in `log_format` when given), and
    `$connection_upgrade` as ingress-nginx sets it (upgrade only when the client asks)."""
    if log_format is None:
        access = f"access_log {prefix}/access.log;"
    else:
        access = f"log_format main '{log_format}';\n    access_log {prefix}/access.log main;"
    return f"""# Rendered by {rendered_by}
{run_as_root_directive()}worker_processes 1;
daemon off;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log {error_level};
events {{ worker_connections {worker_connections}; }}
http {{
    {access}
    client_body_temp_path {prefix}/client_body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
    map $http_upgrade $connection_upgrade {{
        default upgrade;
        ''      close;
    }}
{http}
}}
"""


@dataclass(frozen=True)
class Started:
    process: ManagedProcess
    port: int
    text: str  # the configuration it runs


def start_nginx(binary: str, prefix: Path, render: Callable[[int], str], *,
                name: str = "nginx", cpus: Collection[int] | None = None,
                timeout: float = 10.0) -> Started:  # fmt: skip
    """nginx in the foreground on a free port, listening: `render(port)` is written to
    `prefix/nginx.conf`, its output goes to `prefix/<name>.log`. A free port can be taken
    between the probe and the bind: then it tries another, three times in all; any other
    failure raises at once with nginx's words."""
    conf, errors = prefix / "nginx.conf", prefix / "error.log"

    def error_log() -> str:
        try:
            return errors.read_text(errors="replace")
        except OSError:
            return ""

    for attempt in range(3):
        port = free_port()
        text = render(port)
        conf.write_text(text)
        seen = len(error_log())
        argv = [binary, "-p", str(prefix), "-e", str(errors), "-c", str(conf)]
        process = ManagedProcess(name, argv, prefix, cpus=cpus).start()
        try:
            if wait_listening(port, process.alive, timeout=timeout, log=error_log):
                return Started(process, port, text)
        except AssertionError:
            process.stop()
            raise
        process.stop()
        why = f"{error_log()[seen:]}{process.tail()}"
        if "Address already in use" not in why or attempt == 2:
            raise RuntimeError(f"nginx did not start:\n{why}")
    raise AssertionError("unreachable")
