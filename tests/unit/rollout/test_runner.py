"""RolloutRunner with fake engines and tools: a group is assembled in sample order, and an
engine failure cancels the task's other rollouts and leaves the scheduler clean for a retry."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest

from services.rollout.agent import Generation
from services.rollout.rollouts import AdmissionGate, RolloutRunner
from services.rollout.scheduler import RolloutScheduler
from shared.events import RolloutTask, SamplingParams, utcnow
from shared.formats import load_format

FMT = None


@pytest.fixture(autouse=True, scope="module")
def _tiny_format(tiny_model_dir):
    global FMT
    FMT = load_format(tiny_model_dir, "compact")


class FakeEngine:
    index = 0
    version = 7
    capacity_tokens = 100_000
    used_tokens = 0

    def __init__(self, fail_turn_of: str | None = None):
        self.fail_turn_of = fail_turn_of

    async def generate(self, req, *, temperature, top_p, stop_token_ids, stop_strings=None, request_id=None,
                       extra=None):
        if self.fail_turn_of and request_id.startswith(self.fail_turn_of):
            await asyncio.sleep(0.01)
            raise RuntimeError("engine died")
        await asyncio.sleep(0.2 if self.fail_turn_of else 0.01)
        ids = FMT.encode("done" + FMT.end_of_turn_text)
        return Generation(ids, [-1.0] * len(ids), [self.version] * len(ids))


class NoTools:
    async def execute(self, code, timeout_s=None):  # pragma: no cover - never called
        raise AssertionError("no tool call expected")


def task(n: int) -> RolloutTask:
    return RolloutTask(task_id="t1", run_id="r", stage=1, problem_id="p", prompt="2+2?", answer="4", n_samples=n,
                       sampling=SamplingParams(max_tokens=64, max_turns=2), deadline=utcnow() + timedelta(minutes=1))


def runner(engine) -> RolloutRunner:
    gate = AdmissionGate(RolloutScheduler({0: 100_000}, block_size=1))
    return RolloutRunner([engine], gate, FMT, NoTools(), max_model_len=4096, tool_timeout_s=1.0)


def test_group_in_sample_order():
    r = runner(FakeEngine())
    group = asyncio.run(r.run_task(task(4)))
    assert [t.traj_id for t in group.trajectories] == [f"t1-{i}" for i in range(4)]
    assert all(t.finish_reason == "eos" and set(t.token_versions) == {7} for t in group.trajectories)
    assert r.gate.scheduler.running == 0


def test_engine_failure_cancels_siblings_and_frees_the_scheduler():
    async def scenario():
        r = runner(FakeEngine(fail_turn_of="t1/1/2/"))
        with pytest.raises(RuntimeError, match="engine died"):
            await r.run_task(task(4))
        # the three slower siblings were cancelled and released before the error surfaced
        assert r.gate.scheduler.running == 0 and r.gate.scheduler.waiting == 0

    asyncio.run(scenario())
    group = asyncio.run(runner(FakeEngine()).run_task(task(4)))  # a retry starts clean
    assert len(group.trajectories) == 4


def test_a_task_carries_its_runs_preset_and_an_unknown_one_is_refused():
    from services.rollout.rollouts import BadTask

    r = runner(FakeEngine())
    compact = r.prompt_ids(task(1))
    boxed = task(1).model_copy(update={"prompt_preset": "boxed"})
    ids = r.prompt_ids(boxed)
    assert ids != compact and "put your final answer within \\boxed{}" in FMT.decode(ids)
    group = asyncio.run(r.run_task(boxed))
    assert group.trajectories[0].finish_reason == "eos"  # "done": no \boxed, the boxed preset's answer
    with pytest.raises(BadTask, match="unknown prompt preset 'fancy'"):
        r.prompt_ids(task(1).model_copy(update={"prompt_preset": "fancy"}))


class DownTools:
    async def execute(self, code, stdin=None, timeout_s=None):
        from services.tool_executor.client import ToolExecutorUnavailable

        raise ToolExecutorUnavailable("connection refused")


def test_an_executor_outage_is_counted_and_warned_once_per_interval(capsys):
    from services.rollout import rollouts
    from services.rollout.agent import ToolRequest

    r = RolloutRunner([FakeEngine()], AdmissionGate(RolloutScheduler({0: 100_000}, block_size=1)), FMT, DownTools(),
                      max_model_len=4096, tool_timeout_s=1.0)
    before = rollouts.TOOL_UNAVAILABLE._value.get()

    async def calls():
        return [await r.run_tool(ToolRequest("print(1)", "")) for _ in range(5)]

    outcomes = asyncio.run(calls())
    assert all(o.fatal for o in outcomes)  # each ends its trajectory as tool_failure
    assert rollouts.TOOL_UNAVAILABLE._value.get() - before == 5
    out = capsys.readouterr().out
    assert out.count("tool_executor_unavailable") == 1 and "connection refused" in out
