"""The benchmark (`make bench`, docs/benchmarks.md): our server against vLLM's server and the
bare engine, fan-out, fairness, balancing, LoRA. Each module with a `main` runs as
`python -m sluice_bench.<module>`; `run` drives the whole benchmark, and the load generators
(`loadgen`, `fanout`, `bare_engine`, `vllm_bench`) run as JSON-lines worker processes.
Their tests are in tests/bench/."""
