"""Debian's nginx binary, for every suite that runs one (tests/server's proxy, the e2e
ingress)."""

from __future__ import annotations

import os
import shutil

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
