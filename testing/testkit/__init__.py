"""Helpers shared by test suites that live in different folders, the e2e harness and the
benchmark (part of the `sluice-testing` package in testing/, installed into the venv, so
`from testkit.net import ...` works in pytest and in every process a test starts).

- `repo`: the repository root, tools from `.tools/bin` before PATH;
- `wait`: `eventually()` / `eventually_async()`, the one loop that waits for a condition
  (every wait in the tests goes through it; no sleep is used as synchronisation);
- `net`: `free_port()`, `wait_http()` (poll a URL until 200, failing fast when the process
  behind it exits);
- `process`: `ManagedProcess`, every child process the tests and the bench start, stopped
  by PID and process group;
- `k8s`: the Kubernetes versions manifests are validated against;
- `clock`: a virtual-time event loop for code that runs on the loop's timers;
- `cpus`: vLLM's engine processes on cores of their own, apart from the servers and
  clients (for checks whose verdict depends on when bytes arrive, and the benchmark);
- `live_cluster`: a control plane with the CRD for suites outside tests/e2e, and the
  one-line skip of e2e-marked tests without one;
- `promtool`: Prometheus's rule-test runner;
- `nginx`: Debian's nginx, its main configuration and its start on a free port;
  `nginx_proxy`: an nginx in front of a test server, configured like our Ingress;
- `redis_server`, `otlp`, `lora`: a Redis server, an OTLP receiver, a test LoRA adapter.

Suite-specific helpers stay with their suite: tests/operator/operator_helpers.py,
tests/server/app_helpers.py, tests/chart/chartlib.py; the e2e harness (the control plane,
fake nodes, the operator process) is testing/e2e_harness.
"""
