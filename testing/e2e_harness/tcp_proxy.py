"""A TCP proxy in front of the apiserver that can stop answering one client.

`cut()` makes the proxy a black hole: it keeps every connection open and reads what the
client sends, but forwards nothing either way and answers nothing (as a network partition
or a hung load balancer would); new connections are accepted and treated the same. Nothing
read during a cut is ever delivered later, so a request sent into the cut cannot land
after it. `restore()` closes every connection it had (their TLS streams lost bytes) and
forwards again on new ones. TLS passes through untouched: the client verifies the apiserver's own
certificate (its SANs include 127.0.0.1).
"""

from __future__ import annotations

import socket
import threading
import time


class TcpProxy:
    def __init__(self, target_port: int, host: str = "127.0.0.1") -> None:
        self.target = (host, target_port)
        self._server = socket.create_server((host, 0))
        self.port = self._server.getsockname()[1]
        self.url = f"https://{host}:{self.port}"
        self._cut = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self.cut_at: float | None = None  # time.time() of the last cut
        self.dropped_bytes = 0

    def start(self) -> TcpProxy:
        threading.Thread(target=self._accept, name=f"proxy-{self.port}", daemon=True).start()
        return self

    def cut(self) -> None:
        self.cut_at = time.time()
        self._cut.set()

    def restore(self) -> None:
        self._close_all()
        self._cut.clear()

    def stop(self) -> None:
        self._stop.set()
        self._server.close()
        self._close_all()

    def _close_all(self) -> None:
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for s in sockets:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            with self._lock:
                self._sockets.append(client)
            if self._cut.is_set():
                threading.Thread(target=self._swallow, args=(client,), daemon=True).start()
                continue
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._sockets.append(upstream)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _swallow(self, sock: socket.socket) -> None:
        while True:
            try:
                data = sock.recv(65536)
            except OSError:
                return
            if not data:
                return
            self.dropped_bytes += len(data)

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                break
            if not data:
                break
            if self._cut.is_set():
                self.dropped_bytes += len(data)
                continue
            try:
                dst.sendall(data)
            except OSError:
                break
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
