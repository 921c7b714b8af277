"""Autoscaling on time to first token, end to end: the pieces the test composes.

Each builds on the e2e harness (testing/e2e_harness) through its public options or by
composing, never by changing it:
- `cluster.aggregating_control_plane`: the harness's control plane with the API aggregation
  layer's front-proxy certificates and a 5 s HPA sync period;
- the harness's `node_agent.NodeAgent` in live mode: pods really run `python -m sluice_server`
  (simulator engine) under bubblewrap on a loopback address of their own, with their probes;
- `prometheus.Prometheus`: Debian's prometheus binary discovering those pods through
  `kubernetes_sd_configs` (pod role, the operator's scrape annotations);
- `adapter.CustomMetricsAdapter`: `custom.metrics.k8s.io/v1beta2` over TLS behind an
  APIService, evaluating exactly the chart's prometheus-adapter rule;
- `loadgen.LoadGenerator`: bounded closed-loop SSE load over the Service's ready pods, TTFT
  measured at the client;
- `timeline.Timeline`: samples TTFT, desired and ready replicas; writes CSV and a PNG plot.
"""
