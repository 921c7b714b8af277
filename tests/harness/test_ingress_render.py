"""The e2e ingress's nginx configuration from Ingress routes, without a cluster: the
operator's annotations become directives, defaults are ingress-nginx's, and nginx itself
accepts the result (`nginx -t`)."""

from __future__ import annotations

import subprocess

import pytest
from e2e_harness.ingress import ANN, Route, render
from testkit.nginx import find_nginx

OPERATOR = {  # what builders/ingress.py sets for a resumable model under /llm
    ANN + "proxy-buffering": "off", ANN + "proxy-request-buffering": "off",
    ANN + "proxy-http-version": "1.1", ANN + "proxy-read-timeout": "630",
    ANN + "proxy-send-timeout": "630", ANN + "proxy-body-size": "1048576",
    ANN + "affinity": "cookie", ANN + "affinity-mode": "persistent",
    ANN + "session-cookie-name": "sluice-affinity", ANN + "session-cookie-path": "/llm",
}  # fmt: skip


def _route(annotations, endpoints=("127.1.0.2:8000", "127.1.0.3:8000"), path="/llm", **kw):
    base = dict(namespace="ns", ingress="m", host="", path=path, path_type="Prefix",
                service="m", port="http", annotations=annotations, endpoints=endpoints)  # fmt: skip
    return Route(**{**base, **kw})


def _location(conf: str, loc: str) -> str:
    start = conf.index(f"location {loc} {{")
    return conf[start : conf.index("}", start)]


def test_operator_annotations_become_directives(tmp_path):
    conf = render([_route(OPERATOR)], 8080, tmp_path)
    assert "upstream ns_m_http { server 127.1.0.2:8000; server 127.1.0.3:8000; }" in conf
    loc = _location(conf, "/llm/")
    for directive in ("proxy_buffering off;", "proxy_request_buffering off;",
                      "proxy_read_timeout 630s;", "proxy_send_timeout 630s;",
                      "client_max_body_size 1048576;", "proxy_http_version 1.1;",
                      "proxy_pass http://$pin_",
                      'Set-Cookie "sluice-affinity=$upstream_addr; Path=/llm; HttpOnly"'):  # fmt: skip
        assert directive in loc, directive
    assert _location(conf, "= /llm")  # Prefix /llm: /llm itself and /llm/..., not /llmx
    assert "location /llm {" not in conf
    assert '"~(^|;\\s*)sluice\\-affinity=127\\.1\\.0\\.2:8000(;|$)" 127.1.0.2:8000;' in conf


def test_defaults_are_ingress_nginx_defaults_and_no_endpoint_is_503(tmp_path):
    conf = render([_route({}), _route({}, endpoints=(), path="/empty", service="e")], 8080,
                  tmp_path)  # fmt: skip
    loc = _location(conf, "/llm/")
    for directive in ("proxy_buffering off;", "proxy_request_buffering on;",
                      "proxy_read_timeout 60s;", "client_max_body_size 1m;",
                      "proxy_pass http://ns_m_http;"):  # fmt: skip
        assert directive in loc, directive
    assert "Set-Cookie" not in conf
    assert "return 503;" in _location(conf, "/empty/")


def test_upstream_vhost_is_the_host_sent_upstream(tmp_path):
    vhost = {"nginx.ingress.kubernetes.io/upstream-vhost": "m.ns.svc.cluster.local"}
    conf = render([_route(vhost), _route({}, path="/plain", service="p")], 8080, tmp_path)
    assert "proxy_set_header Host m.ns.svc.cluster.local;" in _location(conf, "/llm/")
    assert "proxy_set_header Host $host;" in _location(conf, "/plain/")


def test_first_ingress_keeps_a_path_and_hosts_get_their_own_server(tmp_path):
    conf = render([_route({}), _route({}, service="later"), _route({}, host="a.example")],
                  8080, tmp_path)  # fmt: skip
    assert "ns_later_http" not in conf.split("server_name _;")[1].split("server {")[0]
    assert "server_name a.example;" in conf and "default_server" in conf


@pytest.mark.parametrize(
    ("annotations", "upstream"),
    [
        ({"nginx.org/lb-method": "least_conn"}, "upstream ns_m_http { least_conn; server "),
        ({"nginx.org/lb-method": "round_robin"}, "upstream ns_m_http { server "),
        ({ANN + "load-balance": "round_robin"}, "upstream ns_m_http { server "),
    ],
)
def test_the_balancing_annotation_becomes_the_upstream_method(tmp_path, annotations, upstream):
    assert upstream in render([_route(annotations)], 8080, tmp_path)


@pytest.mark.skipif(find_nginx() is None, reason="nginx not installed (apt-get install nginx)")
def test_nginx_accepts_the_rendered_config(tmp_path):
    """Names as long as Kubernetes allows (a 63-character namespace and Service)."""
    long = "n" * 63
    conf = tmp_path / "nginx.conf"
    routes = [
        _route({**OPERATOR, "nginx.org/lb-method": "least_conn"}, namespace=long, service=long),
        _route({}, host="h", endpoints=()),
    ]
    conf.write_text(render(routes, 8080, tmp_path))
    got = subprocess.run([find_nginx(), "-t", "-p", str(tmp_path), "-e",
                          str(tmp_path / "error.log"), "-c", str(conf)],
                         capture_output=True, text=True)  # fmt: skip
    assert got.returncode == 0, got.stderr
