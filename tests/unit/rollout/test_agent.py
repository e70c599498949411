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
from shared.formats import ToolResult, load_format

FMT = None  # the tiny model's real format (its tokenizer and chat template), set per module


@pytest.fixture(autouse=True, scope="module")
def _tiny_format(tiny_model_dir):
    global FMT
    FMT = load_format(tiny_model_dir, "compact", tool_response_max_chars=200)


def encode(text: str) -> list[int]:
    return FMT.encode(text)


def ok(output: str) -> ToolOutcome:
    return ToolOutcome(ToolResult("ok", output), 1.0)


def config(**kw) -> AgentConfig:
    base = dict(max_tokens=2000, max_turns=5, max_model_len=4096)
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

    async def __call__(self, call) -> ToolOutcome:
        self.codes.append(call.code)
        return self.outcomes.pop(0)


def run(loop, policy, tools):
    return asyncio.run(run_agent(loop, policy, tools))


def new_loop(**kw) -> AgentLoop:
    return AgentLoop("t1", FMT.prompt_ids("What is 2**10?"), config(**kw), FMT)


def test_tool_call_round_trip_masks_and_versions():
    policy = ScriptedPolicy([
        "Let me compute." + FMT.tool_call_text("print(2**10)"),
        FMT.answer_text("1024") + FMT.end_of_turn_text,
    ])
    tools = FakeTools([ToolOutcome(ToolResult("ok", "1024"), 12.5)])
    loop = new_loop()
    traj = run(loop, policy, tools)
    assert tools.codes == ["print(2**10)"]
    assert traj.finish_reason == "answer" and traj.turns == 2
    assert [t.status for t in traj.tool_calls] == ["ok"]
    assert traj.tool_calls[0].duration_ms == 12.5
    # the response is: turn 1 (model) + tool block (tool) + turn 2 (model)
    turn1 = encode("Let me compute." + FMT.tool_call_text("print(2**10)"))
    block = FMT.tool_response_ids(ToolResult("ok", "1024"))
    turn2 = encode(FMT.answer_text("1024") + FMT.end_of_turn_text)
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
        "ok" + FMT.end_of_turn_text,
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
        FMT.tool_call_text("while True: pass"),
        FMT.tool_call_text("1/0"),
        FMT.answer_text("3") + FMT.end_of_turn_text,
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
    policy = ScriptedPolicy([FMT.tool_call_text("print(1)")])
    tools = FakeTools([unavailable_outcome("connection refused", 40.0)])
    traj = run(new_loop(), policy, tools)
    assert traj.finish_reason == "tool_failure"
    assert [t.status for t in traj.tool_calls] == ["error"]
    assert "unavailable" in traj.tool_calls[0].output
    assert traj.loss_mask and all(m == 1 for m in traj.loss_mask)  # nothing appended after the call


def test_max_turns_stops_before_running_the_last_call():
    policy = ScriptedPolicy([FMT.tool_call_text(f"print({i})") for i in range(3)])
    tools = FakeTools([ok("0"), ok("1")])
    traj = run(new_loop(max_turns=3), policy, tools)
    assert traj.finish_reason == "max_turns" and traj.turns == 3
    assert tools.codes == ["print(0)", "print(1)"]


def test_budget_bounds_model_and_tool_tokens():
    long_turn = "x" * 500 + FMT.end_of_turn_text
    policy = ScriptedPolicy([FMT.tool_call_text("print(1)"), long_turn])
    tools = FakeTools([ok("y" * 50)])
    traj = run(new_loop(max_tokens=200), policy, tools)
    assert len(traj.response_token_ids) == 200
    assert traj.finish_reason == "max_tokens"
    assert policy.requests[0].max_new_tokens == 200
    response_so_far = len(policy.requests[1].token_ids) - len(traj.prompt_token_ids)
    assert policy.requests[1].max_new_tokens == 200 - response_so_far


def test_tool_response_that_does_not_fit_ends_the_trajectory():
    call = FMT.tool_call_text("print(1)")
    policy = ScriptedPolicy([call])
    tools = FakeTools([ok("z" * 150)])
    budget = len(encode(call)) + 20
    traj = run(new_loop(max_tokens=budget), policy, tools)
    assert traj.finish_reason == "max_tokens"
    assert [t.status for t in traj.tool_calls] == ["ok"]
    assert traj.loss_mask == [1] * len(encode(call))


def test_long_tool_output_is_middle_elided():
    policy = ScriptedPolicy([FMT.tool_call_text("print('a'*5000)"), FMT.end_of_turn_text])
    out = "HEAD" + "a" * 5000 + "TAIL"
    tools = FakeTools([ok(out)])
    traj = run(new_loop(), policy, tools)
    assert "HEAD" in traj.response_text and "TAIL" in traj.response_text
    assert "characters elided" in traj.response_text
    assert len(traj.tool_calls[0].output) <= 200


def test_versions_follow_the_generator_and_tool_tokens_inherit():
    policy = ScriptedPolicy([FMT.tool_call_text("print(1)"), FMT.end_of_turn_text])
    tools = FakeTools([ok("1")])
    loop = new_loop()

    async def gen(req):
        g = await policy(req)
        v = 1 if req.turn == 1 else 2
        return Generation(g.token_ids, g.logprobs, [v] * len(g.token_ids))

    traj = asyncio.run(run_agent(loop, gen, tools))
    n1 = len(encode(FMT.tool_call_text("print(1)")))
    nb = len(FMT.tool_response_ids(ToolResult("ok", "1")))
    assert traj.token_versions == [1] * (n1 + nb) + [2]


def test_misuse_is_an_error():
    loop = new_loop()
    with pytest.raises(RuntimeError):
        loop.on_tool_result(ok(""))
    with pytest.raises(ValueError):
        Generation([1, 2], [0.0], [0, 0])
    with pytest.raises(ValueError):
        AgentLoop("t", [], config(), FMT)


# --------------------------------------------------------------------------- real model families


def _script(fmt, turns: list[str]) -> ScriptedPolicy:
    policy = ScriptedPolicy([])
    policy.turns = turns

    async def call(req):
        policy.requests.append(req)
        ids = fmt.encode(policy.turns.pop(0))[: req.max_new_tokens]
        return Generation(ids, [-0.5] * len(ids), [1] * len(ids))

    return call


@pytest.mark.parametrize("fmt_name", ["qwen3_format", "llama3_format"])
def test_real_tokenizers_round_trip_a_tool_call(fmt_name, request):
    """Qwen3 has </tool_call> as one token (stop id); Llama-3 has none of the tags (stop string,
    text detection): both run the call, append the template's tool turn masked, and finish."""
    fmt = request.getfixturevalue(fmt_name)
    assert (fmt.tool_call_end_id is None) == (fmt_name == "llama3_format")
    turn1 = "I will compute it." + fmt.tool_call_text("print(2**10)")
    turn2 = "<answer>The answer is \\boxed{1024}</answer>" + fmt.end_of_turn_text
    tools = FakeTools([ToolOutcome(ToolResult("ok", "1024\n"), 3.0)])
    loop = AgentLoop("t", fmt.prompt_ids("What is 2**10?"), config(), fmt)
    traj = asyncio.run(run_agent(loop, _script(fmt, [turn1, turn2]), tools))
    assert tools.codes == ["print(2**10)"]
    assert traj.finish_reason == "answer" and traj.turns == 2
    block = fmt.tool_response_ids(ToolResult("ok", "1024\n"))
    t1, t2 = fmt.encode(turn1), fmt.encode(turn2)
    assert traj.response_token_ids == t1 + block + t2
    assert traj.loss_mask == [1] * len(t1) + [0] * len(block) + [1] * len(t2)
    assert "Tool call success\nstdout: 1024" in fmt.decode(block)


def test_text_detection_ignores_a_closing_tag_far_back(llama3_format):
    fmt = llama3_format
    ids = fmt.encode(fmt.tool_call_text("print(1)") + " and then I kept writing a long explanation of it")
    assert fmt.classify(ids) == "truncated"
    assert fmt.classify(fmt.encode(fmt.tool_call_text("print(1)"))) == "tool_call"
    assert fmt.classify(fmt.encode("no call at all")) == "truncated"


def test_a_base_model_ending_on_its_eos_is_an_end_not_max_tokens(qwen3_base_model):
    fmt = load_format(qwen3_base_model, "boxed")
    text = "2 + 2 = 4, so the answer is \\boxed{4}.<|endoftext|>"
    loop = AgentLoop("t", fmt.prompt_ids("What is 2+2?"), config(), fmt)
    traj = asyncio.run(run_agent(loop, _script(fmt, [text]), FakeTools([])))
    assert traj.finish_reason == "answer"  # the boxed preset: an answer is a \boxed{}
    loop = AgentLoop("t", fmt.prompt_ids("What is 2+2?"), config(), fmt)
    traj = asyncio.run(run_agent(loop, _script(fmt, ["I do not know.<|endoftext|>"]), FakeTools([])))
    assert traj.finish_reason == "eos"
