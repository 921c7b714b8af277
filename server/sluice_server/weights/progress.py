"""Where a run is, for the operator: `GET /progress` on `--progress-port` answers
{"phase", "commit", "files_done", "files_total", "bytes_done", "bytes_total"}. Bytes count
while a file downloads (huggingface_hub reports each chunk), so a 5 GB shard moves the
number too, not only its end."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

PHASES = ("resolving", "downloading", "verifying", "ready", "failed")


class Progress:
    """The run's counters; written by the download thread, read by the HTTP server's."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.phase = "resolving"
        self.commit: str | None = None
        self.files_done = 0
        self.files_total = 0
        self.bytes_done = 0  # files finished
        self.bytes_total = 0
        self._in_flight = 0  # bytes of the file being downloaded

    def set(self, **fields: Any) -> None:
        with self._lock:
            for k, v in fields.items():
                if not hasattr(self, k) or k.startswith("_"):
                    raise AttributeError(k)
                setattr(self, k, v)

    def chunk(self, n: int) -> None:
        with self._lock:
            self._in_flight += n

    def restart_file(self) -> None:
        with self._lock:
            self._in_flight = 0

    def file_done(self, size: int) -> None:
        with self._lock:
            self._in_flight = 0
            self.files_done += 1
            self.bytes_done += size

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "phase": self.phase,
                "commit": self.commit,
                "files_done": self.files_done,
                "files_total": self.files_total,
                "bytes_done": min(self.bytes_done + max(self._in_flight, 0), self.bytes_total),
                "bytes_total": self.bytes_total,
            }


class ChunkBar:
    """What huggingface_hub's downloads take as a progress bar (`tqdm_class`: a class that
    is not its own tqdm is called with the bar's keyword arguments and must count with
    `update(n)` inside a `with`): hands each chunk's size to the Progress."""

    def __init__(self, progress: Progress, **_bar_args: Any) -> None:
        self._progress = progress

    def __enter__(self) -> ChunkBar:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def update(self, n: int | float = 1) -> None:
        self._progress.chunk(int(n))

    def close(self) -> None:
        return None


def serve_progress(progress: Progress, port: int, host: str = "0.0.0.0") -> ThreadingHTTPServer:
    """Serve `GET /progress` in a daemon thread until the process exits."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path.split("?")[0] != "/progress":
                self.send_error(404)
                return
            body = json.dumps(progress.snapshot()).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            return None  # the operator polls: one line per poll would drown the file lines

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="progress", daemon=True).start()
    return server
