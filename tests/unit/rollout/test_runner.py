"""RolloutRunner with fake engines and tools: a group is assembled in sample order, and an
engine failure cancels the task's other rollouts and leaves the scheduler clean for a retry."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest

from services.rollout.agent import Generation
from services.rollout.rollouts import AdmissionGate, RolloutRunner, Tokenizer
from services.rollout.scheduler import RolloutScheduler
from shared import chat_format as cf
from shared.events import RolloutTask, SamplingParams, utcnow

SPECIAL = {tok: 1000 + i for i, tok in enumerate(cf.SPECIAL_TOKENS)}
EOS, CALL_END = SPECIAL[cf.IM_END], SPECIAL[cf.TOOL_CALL_END]


def encode(text: str) -> list[int]:  # one id per character; the tags as single ids
    ids, i = [], 0
    while i < len(text):
        for tag, tid in SPECIAL.items():
            if text.startswith(tag, i):
                ids.append(tid)
                i += len(tag)
                break
        else:
            ids.append(ord(text[i]))
            i += 1
    return ids


def decode(ids: list[int]) -> str:
    rev = {v: k for k, v in SPECIAL.items()}
    return "".join(rev.get(i, chr(i)) for i in ids)


class FakeEngine:
    index = 0
    version = 7
    capacity_tokens = 100_000
    used_tokens = 0

    def __init__(self, fail_turn_of: str | None = None):
        self.fail_turn_of = fail_turn_of

    async def generate(self, req, *, temperature, top_p, stop_token_ids, request_id=None, extra=None):
        if self.fail_turn_of and request_id.startswith(self.fail_turn_of):
            await asyncio.sleep(0.01)
            raise RuntimeError("engine died")
        await asyncio.sleep(0.2 if self.fail_turn_of else 0.01)
        ids = encode("done" + cf.IM_END)
        return Generation(ids, [-1.0] * len(ids), [self.version] * len(ids))


class NoTools:
    async def execute(self, code, timeout_s=None):  # pragma: no cover - never called
        raise AssertionError("no tool call expected")


def task(n: int) -> RolloutTask:
    return RolloutTask(task_id="t1", run_id="r", stage=1, problem_id="p", prompt="2+2?", answer="4", n_samples=n,
                       sampling=SamplingParams(max_tokens=64, max_turns=2), deadline=utcnow() + timedelta(minutes=1))


def runner(engine) -> RolloutRunner:
    tok = Tokenizer(encode=encode, decode=decode, tool_call_end_id=CALL_END, eos_id=EOS)
    gate = AdmissionGate(RolloutScheduler({0: 100_000}, block_size=1))
    return RolloutRunner([engine], gate, tok, NoTools(), max_model_len=4096, tool_timeout_s=1.0,
                         tool_response_max_chars=100)


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
