"""What the server reports: Prometheus metrics (metrics), OpenTelemetry tracing (tracing),
and each request's access-log line and span (accesslog).
"""
