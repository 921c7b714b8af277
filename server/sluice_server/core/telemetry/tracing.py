"""OpenTelemetry tracing: an OTLP/HTTP exporter and a ratio sampler, off unless an endpoint
is set (`--otlp-traces-endpoint`).

The provider is the server's own (not the global one), so tests can run many apps and vLLM's
engine spans keep their own setup. Spans are exported in batches from a background thread;
`shutdown()` flushes what is left when the server stops.
"""

from __future__ import annotations

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Tracer

SERVICE_NAME = "sluice-server"


class Tracing:
    """A tracer exporting to `endpoint`; `ratio` of new traces are sampled, and a caller's
    sampled `traceparent` is always followed (parent-based)."""

    def __init__(self, endpoint: str, ratio: float, model: str) -> None:
        self.provider = TracerProvider(
            resource=Resource.create({"service.name": SERVICE_NAME, "sluice.model": model}),
            sampler=ParentBased(TraceIdRatioBased(ratio)),
        )
        self.provider.add_span_processor(
            BatchSpanProcessor(
                OTLPSpanExporter(endpoint=endpoint, timeout=5), schedule_delay_millis=500
            )
        )
        self.tracer: Tracer = self.provider.get_tracer("sluice_server")

    def flush(self, timeout_s: float = 5.0) -> bool:
        return self.provider.force_flush(int(timeout_s * 1000))

    def shutdown(self) -> None:
        self.provider.shutdown()
