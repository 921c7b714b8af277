"""A Service's stable address, the way kube-proxy gives it one: each connection to
`ip:port` goes to one of the Service's Ready endpoints at that moment (endpoints.py), picked
in turn; with none, the connection is closed at once (kube-proxy rejects it).

Test harness, not product: there is no kube-proxy or Service IP here (docs/e2e.md). A pod
that must reach a Service by its cluster name gets it through `spec.hostAliases` (the node
agent writes them into the pod's /etc/hosts) pointing at a `ServiceProxy`.
"""

from __future__ import annotations

import itertools
import socket
import threading

from kubernetes import client

from .endpoints import ready_endpoints


class ServiceProxy:
    def __init__(self, core: client.CoreV1Api, namespace: str, service: str, ip: str,
                 port: int) -> None:  # fmt: skip
        self.core, self.namespace, self.service, self.port = core, namespace, service, port
        self.ip = ip
        self._server = socket.create_server((ip, port))
        self._stop = threading.Event()
        self._turn = itertools.count()
        self.connections = 0
        self.refused = 0

    def start(self) -> ServiceProxy:
        threading.Thread(target=self._accept, name=f"svc-{self.service}", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._server.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            eps = ready_endpoints(self.core, self.namespace, self.service, self.port)
        except Exception:  # the API server busy: as no endpoint
            eps = []
        if not eps:
            self.refused += 1
            conn.close()
            return
        ep = eps[next(self._turn) % len(eps)]
        try:
            upstream = socket.create_connection((ep.ip, ep.port), timeout=5)
        except OSError:
            self.refused += 1
            conn.close()
            return
        upstream.settimeout(None)
        self.connections += 1
        threading.Thread(target=_pipe, args=(upstream, conn), daemon=True).start()
        _pipe(conn, upstream)


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        src.close()
