"""`rstar eval`: pass@1 averaged over k samples with tools, and mean response length, as in the
paper's tables. It reuses the pieces training uses, so an evaluation measures exactly what RL
optimises: the rollout service's engine, scheduler and agent loop (``RolloutRunner``), a running
tool-executor, and the reward service's answer extraction and checker.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from shared.datasets import Problem
from lab.evaluate_metrics import SampleResult, summarize
from shared.events import RolloutTask, SamplingParams, new_id, utcnow


@dataclass(frozen=True)
class EvalConfig:
    samples: int = 4  # k: samples per problem (pass@1 is averaged over them)
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 1024
    max_turns: int = 4
    kv_cache_gib: float = 1.0
    max_model_len: int = 4096
    tool_timeout_s: float = 10.0
    seed: int = 1234
    preset: str = "rstar2"  # the conversation preset (shared/formats/presets.py)
    dtype: str = "float32"  # float32 on CPU; bfloat16 on GPUs


async def evaluate_model(model_dir: str | Path, problems: list[Problem], tool_urls: list[str],
                         cfg: EvalConfig = EvalConfig(), *, progress=None, fmt=None) -> dict:
    """Run every problem ``cfg.samples`` times; return the summary (pass@1_mean, pass@k, lengths).

    ``fmt``: the model's conversation format when the caller has already built (and so checked) it."""
    from services.reward.answers import extract_answer
    from services.reward.checker import AnswerChecker
    from services.rollout.engine import RolloutEngine
    from services.rollout.rollouts import AdmissionGate, RolloutRunner
    from services.rollout.scheduler import RolloutScheduler
    from services.tool_executor.client import ToolExecutorClient
    from shared.formats import load_format

    model_dir = Path(model_dir).resolve()
    if fmt is None:  # a model the format cannot use fails here, before the engine
        fmt = load_format(model_dir, cfg.preset)
    engine = RolloutEngine(0, model=model_dir, dtype=cfg.dtype, block_size=32, max_model_len=cfg.max_model_len,
                           kv_cache_gib=cfg.kv_cache_gib, max_num_seqs=256, seed=cfg.seed)
    await engine.start()
    tools = ToolExecutorClient(tool_urls, timeout_s=cfg.tool_timeout_s)
    checker = AnswerChecker(workers=1, timeout_s=5.0)
    t0 = time.monotonic()
    try:
        scheduler = RolloutScheduler({0: engine.capacity_tokens}, block_size=engine.block_size, max_rollouts_per_engine=256)
        runner = RolloutRunner([engine], AdmissionGate(scheduler), fmt, tools,
                               max_model_len=cfg.max_model_len, tool_timeout_s=cfg.tool_timeout_s)
        sampling = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, max_tokens=cfg.max_tokens,
                                  max_turns=cfg.max_turns)
        done = 0

        async def one(p: Problem) -> list[SampleResult]:
            nonlocal done
            task = RolloutTask(task_id=new_id(), run_id="eval", stage=0, problem_id=p.problem_id, prompt=p.prompt,
                               answer=p.answer, n_samples=cfg.samples, sampling=sampling,
                               deadline=utcnow() + timedelta(hours=1))
            group = await runner.run_task(task)
            results = []
            for t in group.trajectories:
                found = extract_answer(t.response_text)
                verdict = await checker.check(found.text if found else None, p.answer)
                results.append(SampleResult(
                    problem_id=p.problem_id, correct=verdict.correct, response_tokens=len(t.response_token_ids),
                    tool_calls=len(t.tool_calls),
                    well_formed_tool_calls=sum(c.status != "parse_error" for c in t.tool_calls),
                    answered=found is not None))
            done += 1
            if progress:
                progress(done, len(problems))
            return results

        nested = await asyncio.gather(*(one(p) for p in problems))
        summary = summarize([s for group in nested for s in group], ks=(1, cfg.samples))
        summary[f"avg@{cfg.samples}"] = summary["pass@1_mean"]  # the paper's name for the same figure
        summary["eval_s"] = round(time.monotonic() - t0, 1)
        return summary
    finally:
        checker.close()
        await tools.aclose()
        engine.shutdown()
