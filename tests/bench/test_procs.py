"""The benchmark's process helpers: a server whose picked port was taken before it bound
starts again on another one; a process's CPU time is read to the nanosecond."""

from __future__ import annotations

import socket
import sys

import pytest
from sluice_bench.procs import ProcGroup, Server

# Binds 127.0.0.1:<--port> (exits with "Address already in use" if taken), answers 200.
SERVE = """
import http.server, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
http.server.HTTPServer(("127.0.0.1", port), http.server.SimpleHTTPRequestHandler).serve_forever()
"""


def test_a_server_whose_port_was_taken_starts_on_another(tmp_path):
    with socket.socket() as taken, ProcGroup() as group:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = group.add(Server("http", [sys.executable, "-c", SERVE, "--port", str(port)],
                                  None, tmp_path, port, "/"))  # fmt: skip
        server.wait_ready(30)
        assert server.port != port and server.base_url.endswith(f":{server.port}")
        assert "address already in use" in server.log_path.read_text().lower()  # it did retry


def test_a_server_that_fails_otherwise_is_not_restarted(tmp_path):
    with ProcGroup() as group:
        server = group.add(Server("bad", [sys.executable, "-c", "raise SystemExit(3)",
                                          "--port", "1"], None, tmp_path, 1, "/"))  # fmt: skip
        with pytest.raises(RuntimeError, match="exited with 3"):
            server.wait_ready(30)
        assert server.port == 1
