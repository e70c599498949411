"""Reward benchmark: how many groups of 32 trajectories the reward pipeline scores per second on
this machine, how many answers it judges per second, and what share of the time is answer
checking.

What runs is the service's own scoring path (services.reward.scoring.score_trajectory_group):
answer extraction from each response, the integer fast path in-process, math-verify checks in
the pebble worker pool (with its timeout), then GRPO-RoC 2G → G and advantages. Groups are
synthetic but shaped like real ones: 32 multi-turn responses with tool calls and an
``<answer>\\boxed{}`` each, ~2K tokens per trajectory.

Answer mixes (--mix):
  integer   every answer an integer (the project's generated datasets): fast path only
  symbolic  fractions / LaTeX / decimals: every distinct answer goes through math-verify
  mixed     (default) half of the groups of each kind

Figures (last line, one JSON object):
  groups_per_s        groups of 32 scored per second (one replica, sequential groups)
  checks_per_s        answers judged per second (32 per group, fast path and symbolic together)
  symbolic_checks_per_s  math-verify checks actually run in the pool per second of checking
                      time (distinct answers of a group are checked once)
  check_share         fraction of the scoring time spent in answer checking
  concurrent_groups_per_s  the same groups with --concurrency groups in flight (as the service
                      runs them), showing what the pool's parallelism adds

With --e2e the whole service runs instead (shared.runtime.run_service on the embedded broker
and PostgreSQL started in a temporary directory): the groups are produced to the trajectories
topic first, then the clock runs from the service's start of consumption until every group's
row is recorded and its ScoredGroup published. Extra figure: e2e_groups_per_s (decode 32 x 2K
tokens, check, RoC, one DB transaction, publish, mark, commit).

Usage: .venv/bin/python bench/reward.py [--groups 60] [--mix mixed] [--workers 2] [--concurrency 4] [--e2e]
       (--groups 500 for the long version)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from services.reward.checker import AnswerChecker  # noqa: E402
from services.reward.roc import RocConfig  # noqa: E402
from services.reward.scoring import score_trajectory_group  # noqa: E402
from lab.tiny_model import compact_answer as format_answer  # noqa: E402
from lab.tiny_model import compact_tool_call as format_tool_call  # noqa: E402
from lab.tiny_model import compact_tool_response as format_tool_response  # noqa: E402
from shared.events import ToolCallRecord, Trajectory, TrajectoryGroup  # noqa: E402

GROUP = 32
TOKENS = 2048

INTEGER_GOLD = ["42", "1024", "123456789", "7", "-3", "1000000"]
SYMBOLIC_GOLD = [("\\frac{1}{2}", ["0.5", "\\dfrac{1}{2}", "\\frac{2}{4}", "1/3", "0.51"]),
                 ("\\sqrt{2}", ["\\sqrt{2}", "1.41421356", "2^{1/2}", "\\frac{\\sqrt{8}}{2}", "1.4"]),
                 ("\\frac{3}{4}", ["0.75", "\\frac{6}{8}", "3/4", "\\frac{3}{5}", "75\\%"]),
                 ("2\\pi", ["2\\pi", "6.283185", "\\pi", "\\frac{4\\pi}{2}", "6.28"])]


def make_group(i: int, kind: str, rng: random.Random) -> TrajectoryGroup:
    if kind == "integer":
        gold = rng.choice(INTEGER_GOLD)
        candidates = [gold, gold, str(int(gold) + 1), f"{int(gold):,}", str(int(gold) - 7)]
    else:
        gold, candidates = rng.choice(SYMBOLIC_GOLD)
    trajs = []
    for j in range(GROUP):
        statuses = [rng.choice(["ok", "ok", "ok", "error", "timeout"]) for _ in range(rng.randint(0, 4))]
        parts = []
        for k, status in enumerate(statuses):
            parts.append(f"Step {k}: let me compute this with Python. " * 4)
            parts.append(format_tool_call(f"x = {k}\nprint(x ** 2 + {j})"))
            parts.append(format_tool_response("Traceback ... Error" if status != "ok" else str(k * k + j)))
        parts.append("So the result follows. " * 8 + format_answer(rng.choice(candidates)))
        trajs.append(Trajectory(
            traj_id=f"g{i}-t{j}",
            prompt_token_ids=[rng.randrange(512) for _ in range(128)],
            response_token_ids=[rng.randrange(512) for _ in range(TOKENS)],
            loss_mask=[1] * TOKENS,
            logprobs=[-0.5] * TOKENS,
            token_versions=[1] * TOKENS,
            turns=len(statuses) + 1,
            tool_calls=[ToolCallRecord(code="print(1)", status=s, duration_ms=5.0) for s in statuses],
            finish_reason="answer",
            response_text="".join(parts),
        ))
    return TrajectoryGroup(group_id=f"bench-{i}", run_id="bench", stage=1, problem_id=f"p{i}",
                           answer=gold, trajectories=trajs)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=60)
    ap.add_argument("--mix", choices=["integer", "symbolic", "mixed"], default="mixed")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=5.0)
    ap.add_argument("--e2e", action="store_true", help="also run the service over the embedded broker and database")
    args = ap.parse_args()

    rng = random.Random(0)
    kinds = {"integer": ["integer"], "symbolic": ["symbolic"], "mixed": ["integer", "symbolic"]}[args.mix]
    groups = [make_group(i, kinds[i % len(kinds)], rng) for i in range(args.groups)]
    roc = RocConfig(group_size=16)
    with AnswerChecker(args.workers, args.timeout) as checker:
        await score_trajectory_group(make_group(-1, "symbolic", rng), checker, roc, "answer_tag_then_last_boxed")  # warm

        t0 = time.perf_counter()
        check_s = 0.0
        symbolic = 0
        outcomes: dict[str, int] = {}
        for g in groups:
            res = await score_trajectory_group(g, checker, roc, "answer_tag_then_last_boxed")
            check_s += res.check_seconds
            for k, n in res.outcomes.items():
                outcomes[k] = outcomes.get(k, 0) + n
            symbolic += len({a for a, v in zip(res.answers, res.verdicts) if v.outcome in ("symbolic", "timeout")})
        total_s = time.perf_counter() - t0

        sem = asyncio.Semaphore(args.concurrency)

        async def one(g: TrajectoryGroup) -> None:
            async with sem:
                await score_trajectory_group(g, checker, roc, "answer_tag_then_last_boxed")

        t1 = time.perf_counter()
        await asyncio.gather(*(one(g) for g in groups))
        conc_s = time.perf_counter() - t1

    n = len(groups)
    result = {
        "groups_per_s": round(n / total_s, 2),
        "checks_per_s": round(n * GROUP / total_s, 1),
        "symbolic_checks_per_s": round(symbolic / check_s, 1) if check_s and symbolic else None,
        "check_share": round(check_s / total_s, 3),
        "concurrent_groups_per_s": round(n / conc_s, 2),
        "groups": n,
        "group_size": GROUP,
        "mix": args.mix,
        "workers": args.workers,
        "concurrency": args.concurrency,
        "outcomes": outcomes,
    }
    if args.e2e:
        result["e2e_groups_per_s"] = round(await run_e2e(groups, args), 2)
    print(f"scored {n} groups of {GROUP} ({args.mix} answers) in {total_s:.2f}s sequentially, "
          f"{conc_s:.2f}s with {args.concurrency} in flight; {check_s:.2f}s in answer checking "
          f"({symbolic} symbolic checks in the pool)")
    print(json.dumps(result))


async def run_e2e(groups: list[TrajectoryGroup], args: argparse.Namespace) -> float:
    import socket
    import tempfile

    from sqlalchemy import func, select

    from services.reward.config import Settings
    from services.reward.runtime import RewardService
    from shared import stack, topics
    from shared.db.models import TrajectoryGroupRow
    from shared.db.session import make_engine, session_factory
    from shared.events import encode
    from shared.kafka import EventProducer, ensure_topics
    from shared.runtime import run_service
    from shared.settings import load_settings

    state = Path(tempfile.mkdtemp(prefix="rstar-bench-reward-"))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        kafka_port = sock.getsockname()[1]
    info = await asyncio.to_thread(stack.up, state, kafka_port=kafka_port)
    try:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            http_port = sock.getsockname()[1]
        settings = load_settings(
            Settings, kafka_bootstrap=info.kafka_bootstrap, database_url=info.database_url, topic_prefix="bench.",
            state_dir=state, port=http_port, check_workers=args.workers, concurrency=args.concurrency,
            check_timeout_s=args.timeout, drop_all_equal=False,
        )
        await ensure_topics(info.kafka_bootstrap, "bench.")
        producer = EventProducer(info.kafka_bootstrap)
        await producer.start()
        try:
            for g in groups:
                await producer.send_raw(settings.topic(topics.TRAJECTORIES), encode(g), key=g.group_id)
        finally:
            await producer.stop()
        engine = make_engine(info.database_url)
        sessions = session_factory(engine)
        service = RewardService(settings)
        task = asyncio.create_task(run_service(service, settings, install_signals=False))
        while service.loop is None or not service.loop.started.is_set():
            if task.done():
                task.result()
            await asyncio.sleep(0.02)
        t0 = time.perf_counter()
        while True:
            async with sessions() as session:
                done = (await session.execute(select(func.count()).select_from(TrajectoryGroupRow).where(
                    TrajectoryGroupRow.status == "published"))).scalar_one()
            if done >= len(groups):
                break
            if task.done():
                task.result()
            await asyncio.sleep(0.05)
        elapsed = time.perf_counter() - t0
        service.request_stop()
        await task
        await engine.dispose()
        return len(groups) / elapsed
    finally:
        await asyncio.to_thread(stack.down, state)


if __name__ == "__main__":
    asyncio.run(main())
