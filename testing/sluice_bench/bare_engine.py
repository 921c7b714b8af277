"""The ceiling: vLLM's `AsyncLLM.generate` in-process, no HTTP (a worker process).

Built from the same engine arguments as both servers (parsed by vLLM's own server argument
parser with the same usage context, so defaults such as `max_num_seqs` match), fed the same
prompts rendered with the same chat template, measured by the same closed loop as the HTTP
load generator (`loadgen.closed_loop` / `loadgen.summarise`).

Usage (driven by run.py): `python bare_engine.py MODEL_PATH ENGINE_ARGS...`, then JSON
commands on stdin; prints `{"ready": true}` once the engine is up.
"""

from __future__ import annotations

import itertools
import sys
import time


def main() -> None:
    model_path, engine_argv = sys.argv[1], sys.argv[2:]
    from sluice_bench import loadgen
    from sluice_bench.loadgen import Record, closed_loop, serve_stdin, summarise

    loadgen._PROTO = loadgen.claim_stdout()  # before vLLM prints anything
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.sampling_params import RequestOutputKind
    from vllm.usage.usage_lib import UsageContext
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.v1.engine.async_llm import AsyncLLM

    parser = make_arg_parser(FlexibleArgumentParser(prog="bare-engine"))
    args = parser.parse_args(["--model", model_path, *engine_argv])
    engine_args = AsyncEngineArgs.from_cli_args(args)
    state: dict = {}
    ids = itertools.count()

    async def handle(cmd: dict) -> dict:
        if "llm" not in state:
            config = engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
            state["llm"] = AsyncLLM.from_vllm_config(
                vllm_config=config,
                usage_context=UsageContext.OPENAI_API_SERVER,
                disable_log_stats=engine_args.disable_log_stats,
            )
            state["tok"] = state["llm"].get_tokenizer()
        if cmd.get("op") == "start":
            return {"ready": True}
        if cmd.get("op") == "stop":
            state["llm"].shutdown()
            return {"stopped": True}
        llm, tok = state["llm"], state["tok"]
        # Render like vLLM's chat server does: template to text, then tokenize without
        # adding special tokens again. (apply_chat_template(tokenize=True) returns a
        # BatchEncoding on this transformers, which is not a dict and not a list of ids.)
        prompts = []
        for p in cmd["prompts"]:
            text = tok.apply_chat_template(
                [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
            )
            prompts.append(tok.encode(text, add_special_tokens=False))
        params = SamplingParams(
            max_tokens=cmd["max_tokens"],
            temperature=0.0,
            ignore_eos=True,
            output_kind=RequestOutputKind.DELTA,
        )

        async def one(i: int) -> Record:
            rec = Record(start=time.perf_counter())
            prompt = {"prompt_token_ids": prompts[i % len(prompts)]}
            async for out in llm.generate(prompt, params, f"bare-{next(ids)}"):
                now = time.perf_counter()
                o = out.outputs[0]
                rec.tokens += len(o.token_ids)
                if o.text:
                    if rec.ttft is None:
                        rec.ttft = now - rec.start
                    rec.chunk_times.append(now)
            return rec

        records, start, end, timed_out = await closed_loop(
            cmd["concurrency"], cmd["num_requests"], one, cmd.get("point_timeout_s", 300)
        )
        return summarise(records, start, end, timed_out)

    serve_stdin(handle)


if __name__ == "__main__":
    main()
