"""The agent loop's turn state machine driven by a scripted fake generator (no vLLM)."""

from __future__ import annotations

import asyncio
import re

import pytest

from services.rollout.agent import (
    AgentConfig,
    AgentLoop,
    Generation,
    GenerateRequest,
    ToolOutcome,
    outcome_from_execution,
    run_agent,
    unavailable_outcome,
)
from shared import chat_format as cf

SPECIAL = {tok: 1000 + i for i, tok in enumerate(cf.SPECIAL_TOKENS)}
REV = {v: k for k, v in SPECIAL.items()}
_SPLIT = re.compile("(" + "|".join(re.escape(t) for t in cf.SPECIAL_TOKENS) + ")")


def encode(text: str) -> list[int]:
    ids: list[int] = []
    for part in _SPLIT.split(text):
        if part in SPECIAL:
            ids.append(SPECIAL[part])
        else:
            ids.extend(ord(c) for c in part)
    return ids


def decode(ids: list[int]) -> str:
    return "".join(REV.get(i, chr(i)) if i >= 1000 else chr(i) for i in ids)


EOS = SPECIAL[cf.IM_END]
CALL_END = SPECIAL[cf.TOOL_CALL_END]


def config(**kw) -> AgentConfig:
    base = dict(max_tokens=2000, max_turns=5, max_model_len=4096, tool_call_end_id=CALL_END, eos_id=EOS,
                tool_response_max_chars=200)
    base.update(kw)
    return AgentConfig(**base)


class ScriptedPolicy:
    """Emits scripted turn texts (cut to the room asked for), logprob -0.5, version v."""

    def __init__(self, turns: list[str], version: int = 3):
        self.turns = list(turns)
        self.version = version
        self.requests: list[GenerateRequest] = []

    async def __call__(self, req: GenerateRequest) -> Generation:
        self.requests.append(req)
        ids = encode(self.turns.pop(0))[: req.max_new_tokens]
        return Generation(ids, [-0.5] * len(ids), [self.version] * len(ids))


class FakeTools:
    def __init__(self, outcomes: list[ToolOutcome]):
        self.outcomes = list(outcomes)
        self.codes: list[str] = []

    async def __call__(self, code: str) -> ToolOutcome:
        self.codes.append(code)
        return self.outcomes.pop(0)


def run(loop, policy, tools):
    return asyncio.run(run_agent(loop, policy, tools))


def new_loop(**kw) -> AgentLoop:
    return AgentLoop("t1", encode(cf.render_prompt("What is 2**10?")), config(**kw), encode, decode)


def test_tool_call_round_trip_masks_and_versions():
    policy = ScriptedPolicy([
        "Let me compute." + cf.format_tool_call("print(2**10)"),
        cf.format_answer("1024") + cf.IM_END,
    ])
    tools = FakeTools([ToolOutcome("ok", "1024", 12.5)])
    loop = new_loop()
    traj = run(loop, policy, tools)
    assert tools.codes == ["print(2**10)"]
    assert traj.finish_reason == "answer" and traj.turns == 2
    assert [t.status for t in traj.tool_calls] == ["ok"]
    assert traj.tool_calls[0].duration_ms == 12.5
    # the response is: turn 1 (model) + tool block (tool) + turn 2 (model)
    turn1 = encode("Let me compute." + cf.format_tool_call("print(2**10)"))
    block = encode(cf.format_tool_response("1024", 200))
    turn2 = encode(cf.format_answer("1024") + cf.IM_END)
    assert traj.response_token_ids == turn1 + block + turn2
    assert traj.loss_mask == [1] * len(turn1) + [0] * len(block) + [1] * len(turn2)
    assert traj.logprobs == [-0.5] * len(turn1) + [0.0] * len(block) + [-0.5] * len(turn2)
    assert traj.token_versions == [3] * len(traj.response_token_ids)
    assert "<tool_response>\n1024\n</tool_response>" in traj.response_text
    # turn 2 continued from prompt + everything so far (same prefix: prefix-cache reuse)
    assert policy.requests[1].token_ids == traj.prompt_token_ids + turn1 + block


def test_malformed_json_becomes_parse_error_the_model_sees():
    policy = ScriptedPolicy([
        '<tool_call>{"name": "python", "arguments": {"code": "print(1)"</tool_call>',
        "ok" + cf.IM_END,
    ])
    tools = FakeTools([])
    traj = run(new_loop(), policy, tools)
    assert tools.codes == []  # nothing was executed
    assert [t.status for t in traj.tool_calls] == ["parse_error"]
    assert "not valid JSON" in traj.tool_calls[0].output
    assert "ToolCallError" in traj.response_text
    assert traj.finish_reason == "eos"
    assert 0 in traj.loss_mask


def test_timeout_and_error_are_recorded_and_the_loop_continues():
    policy = ScriptedPolicy([
        cf.format_tool_call("while True: pass"),
        cf.format_tool_call("1/0"),
        cf.format_answer("3") + cf.IM_END,
    ])
    tools = FakeTools([
        outcome_from_execution("timeout", "", "", 5000.0, timeout_s=5),
        outcome_from_execution("error", "", "ZeroDivisionError: division by zero", 3.0),
    ])
    traj = run(new_loop(), policy, tools)
    assert [t.status for t in traj.tool_calls] == ["timeout", "error"]
    assert "TimeoutError" in traj.response_text and "ZeroDivisionError" in traj.response_text
    assert traj.finish_reason == "answer"


def test_unreachable_executor_ends_with_tool_failure():
    policy = ScriptedPolicy([cf.format_tool_call("print(1)")])
    tools = FakeTools([unavailable_outcome("connection refused", 40.0)])
    traj = run(new_loop(), policy, tools)
    assert traj.finish_reason == "tool_failure"
    assert [t.status for t in traj.tool_calls] == ["error"]
    assert "unavailable" in traj.tool_calls[0].output
    assert traj.loss_mask and all(m == 1 for m in traj.loss_mask)  # nothing appended after the call


def test_max_turns_stops_before_running_the_last_call():
    policy = ScriptedPolicy([cf.format_tool_call(f"print({i})") for i in range(3)])
    tools = FakeTools([ToolOutcome("ok", "0", 1.0), ToolOutcome("ok", "1", 1.0)])
    traj = run(new_loop(max_turns=3), policy, tools)
    assert traj.finish_reason == "max_turns" and traj.turns == 3
    assert tools.codes == ["print(0)", "print(1)"]


def test_budget_bounds_model_and_tool_tokens():
    long_turn = "x" * 500 + cf.IM_END
    policy = ScriptedPolicy([cf.format_tool_call("print(1)"), long_turn])
    tools = FakeTools([ToolOutcome("ok", "y" * 50, 1.0)])
    traj = run(new_loop(max_tokens=200), policy, tools)
    assert len(traj.response_token_ids) == 200
    assert traj.finish_reason == "max_tokens"
    assert policy.requests[0].max_new_tokens == 200
    response_so_far = len(policy.requests[1].token_ids) - len(traj.prompt_token_ids)
    assert policy.requests[1].max_new_tokens == 200 - response_so_far


def test_tool_response_that_does_not_fit_ends_the_trajectory():
    call = cf.format_tool_call("print(1)")
    policy = ScriptedPolicy([call])
    tools = FakeTools([ToolOutcome("ok", "z" * 150, 1.0)])
    budget = len(encode(call)) + 20
    traj = run(new_loop(max_tokens=budget), policy, tools)
    assert traj.finish_reason == "max_tokens"
    assert [t.status for t in traj.tool_calls] == ["ok"]
    assert traj.loss_mask == [1] * len(encode(call))


def test_long_tool_output_is_middle_elided():
    policy = ScriptedPolicy([cf.format_tool_call("print('a'*5000)"), cf.IM_END])
    out = "HEAD" + "a" * 5000 + "TAIL"
    tools = FakeTools([ToolOutcome("ok", out, 1.0)])
    traj = run(new_loop(), policy, tools)
    assert "HEAD" in traj.response_text and "TAIL" in traj.response_text
    assert "characters elided" in traj.response_text
    assert len(traj.tool_calls[0].output) <= 200


def test_versions_follow_the_generator_and_tool_tokens_inherit():
    policy = ScriptedPolicy([cf.format_tool_call("print(1)"), cf.IM_END])
    tools = FakeTools([ToolOutcome("ok", "1", 1.0)])
    loop = new_loop()

    async def gen(req):
        g = await policy(req)
        v = 1 if req.turn == 1 else 2
        return Generation(g.token_ids, g.logprobs, [v] * len(g.token_ids))

    traj = asyncio.run(run_agent(loop, gen, tools))
    n1 = len(encode(cf.format_tool_call("print(1)")))
    nb = len(encode(cf.format_tool_response("1", 200)))
    assert traj.token_versions == [1] * (n1 + nb) + [2]


def test_misuse_is_an_error():
    loop = new_loop()
    with pytest.raises(RuntimeError):
        loop.on_tool_result(ToolOutcome("ok", "", 0))
    with pytest.raises(ValueError):
        Generation([1, 2], [0.0], [0, 0])
    with pytest.raises(ValueError):
        AgentLoop("t", [], config(), encode, decode)
