"""A real OTLP/HTTP trace receiver for tests: `POST /v1/traces` with a protobuf
`ExportTraceServiceRequest` (what OpenTelemetry's OTLP/HTTP exporter sends), decoded with
`opentelemetry-proto` into plain dicts.

    with OtlpReceiver() as rx:
        ... (point the server at rx.endpoint) ...
        spans = eventually(lambda: rx.trace(trace_id, at_least=3), timeout=15)
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


def _value(v):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


def _span(resource: dict, span) -> dict:
    return {
        "name": span.name,
        "trace_id": span.trace_id.hex(),
        "span_id": span.span_id.hex(),
        "parent_span_id": span.parent_span_id.hex(),
        "start_ns": span.start_time_unix_nano,
        "end_ns": span.end_time_unix_nano,
        "attributes": {a.key: _value(a.value) for a in span.attributes},
        "events": [(e.name, e.time_unix_nano) for e in span.events],
        "status_code": span.status.code,
        "resource": resource,
    }


class OtlpReceiver:
    def __init__(self) -> None:
        self.spans: list[dict] = []
        self.requests = 0
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                ok = self.path == "/v1/traces"
                if ok:
                    req = ExportTraceServiceRequest.FromString(body)
                    found = []
                    for rs in req.resource_spans:
                        res = {a.key: _value(a.value) for a in rs.resource.attributes}
                        for ss in rs.scope_spans:
                            found += [_span(res, s) for s in ss.spans]
                    with receiver._lock:
                        receiver.spans += found
                        receiver.requests += 1
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200 if ok else 404)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def snapshot(self) -> list[dict]:
        with self._lock:
            return list(self.spans)

    def trace(self, trace_id: str, at_least: int = 1) -> list[dict]:
        """The spans of `trace_id` received so far, or [] while fewer than `at_least` have
        arrived: a condition for `testkit.wait.eventually`."""
        spans = [s for s in self.snapshot() if s["trace_id"] == trace_id]
        return spans if len(spans) >= at_least else []


if (
    __name__ == "__main__"
):  # a receiver in its own process: prints its endpoint, serves until stdin closes
    import sys

    with OtlpReceiver() as receiver:
        print(receiver.endpoint, flush=True)
        sys.stdin.read()
        print(f"received {len(receiver.spans)} spans", file=sys.stderr)
