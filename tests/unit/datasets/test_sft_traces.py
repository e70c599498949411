"""SFT traces: real tool outputs, exact loss masks, buggy first calls that really fail."""

from __future__ import annotations

import json
import random

import pytest

from shared.datasets.generated import KINDS, generate_problems
from shared.datasets.sft_traces import (
    BUGGY_FRACTION,
    ChatDataError,
    TraceError,
    make_copy_drills,
    make_trace,
    make_traces,
    read_traces_jsonl,
    render_trace,
    run_code,
    steps_from_messages,
    write_traces_jsonl,
)
from shared.formats import ToolResult
from shared.formats.tags import TOOL_CALL_END, TOOL_RESPONSE_END, TOOL_RESPONSE_START, count_answer_tags


@pytest.fixture(scope="module")
def problems():
    return generate_problems(300, seed=21)


@pytest.fixture(scope="module")
def traces(problems):
    return make_traces(problems, seed=0)


def test_run_code_captures_output_and_tracebacks():
    assert run_code("print(6 * 7)").output == "42\n" and run_code("print(6 * 7)").ok
    bad = run_code("x = 1\nprint(y)")
    assert not bad.ok
    assert bad.output.startswith("Traceback (most recent call last):")
    assert 'File "<cell>", line 2, in <module>\n    print(y)' in bad.output  # source line shown
    assert bad.output.endswith("NameError: name 'y' is not defined\n")
    assert "sft_traces.py" not in bad.output
    partial = run_code("print('before')\n1/0")
    # stdout, then stderr on a new line: composed as the rollout composes executor results.
    assert partial.output.startswith("before\n\nTraceback") and "ZeroDivisionError" in partial.output
    syntax = run_code("print(1")
    assert not syntax.ok and syntax.output.startswith('  File "<cell>", line 1') and "SyntaxError" in syntax.output


def test_code_results_are_shown_as_the_rollout_shows_executor_results(tiny_format, qwen3_format):
    """The trace generator's results are the rollout's: the same ToolResult from the same stdout and
    stderr, so both render the same tool segment in any format."""
    from lab.tiny_model import compact_tool_response
    from services.rollout.agent import outcome_from_execution

    for stdout, stderr in [("42\n", ""), ("", "Traceback\nNameError: x\n"), ("a\n", "E\n"), ("", "")]:
        status = "error" if stderr else "ok"
        assert outcome_from_execution(status, stdout, stderr, 1.0).result == ToolResult(status, stdout, stderr)
    for code, status in [("print(42)", "ok"), ("print('a')\n1/0", "error")]:
        run = run_code(code)
        assert run.result() == outcome_from_execution(status, run.stdout, run.stderr, 1.0).result
    failed = run_code("print('a')\n1/0").result()
    assert tiny_format.tool_response_text(failed) == compact_tool_response("a\n\n" + failed.stderr)
    segment = qwen3_format.tool_response_text(failed)
    assert "Tool call failure\nreason: runtime error\nstdout: a\n\nstderr: Traceback" in segment
    assert segment.endswith("ZeroDivisionError: division by zero\n\n</tool_response><|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("fmt_name", ["tiny_format", "qwen3_format"])
def test_traces_follow_the_format_and_answer_correctly(traces, fmt_name, request):
    fmt = request.getfixturevalue(fmt_name)
    for t in traces[:100]:
        text = t.response_text(fmt)
        assert text.endswith(fmt.answer_text(t.problem.answer) + fmt.end_of_turn_text)
        assert count_answer_tags(text) == 1
        # Every tool call parses with the format's parser, and its code is the recorded code.
        calls = text.split(TOOL_CALL_END)[:-1]
        assert len(calls) == len(t.codes) == (2 if t.buggy_first_call else 1)
        for call, code in zip(calls, t.codes):
            parsed = fmt.parse_tool_call(call + TOOL_CALL_END)
            assert parsed.ok and parsed.code == code
        # Every tool segment is exactly what running the code prints now, wrapped as the rollout wraps it.
        responses = [seg for seg, from_model in t.segments(fmt) if not from_model]
        assert responses == [fmt.tool_response_text(run_code(c).result()) for c in t.codes]


def test_buggy_first_calls_fail_and_the_fix_succeeds(traces):
    buggy = [t for t in traces if t.buggy_first_call]
    assert abs(len(buggy) / len(traces) - BUGGY_FRACTION) < 0.08
    assert {t.problem.kind for t in buggy} == set(KINDS)
    for t in buggy:
        first, second = (run_code(c) for c in t.codes)
        assert not first.ok and "Error" in first.output.splitlines()[-1] and "Traceback" in first.output
        assert second.ok and second.output == t.problem.answer + "\n"
    for t in traces:
        if not t.buggy_first_call:
            assert run_code(t.codes[0]).ok


def test_every_bug_variant_of_every_kind_really_fails():
    from shared.datasets.sft_traces import _buggy_codes

    for p in generate_problems(60, seed=4):
        for bad, _note, fixed in _buggy_codes(p.kind, dict(p.params)):
            assert not run_code(bad).ok, bad
            assert run_code(fixed).output == p.answer + "\n", fixed


@pytest.mark.parametrize("fmt_name", ["tiny_format", "qwen3_format", "llama3_format"])
def test_loss_mask_is_exact(traces, fmt_name, request):
    fmt = request.getfixturevalue(fmt_name)
    for t in traces[:60]:
        tok = render_trace(t, fmt)
        assert len(tok.loss_mask) == len(tok.response_token_ids)
        model_ids = [i for i, m in zip(tok.response_token_ids, tok.loss_mask) if m]
        tool_ids = [i for i, m in zip(tok.response_token_ids, tok.loss_mask) if not m]
        assert fmt.decode(model_ids) == t.model_text(fmt)
        assert fmt.decode(tool_ids) == "".join(seg for seg, m in t.segments(fmt) if not m)
        assert fmt.decode(tok.response_token_ids) == t.response_text(fmt)
        assert tok.prompt_token_ids == fmt.prompt_ids(t.problem.prompt)
        # The model's last token is the template's end-of-turn and it is trained on.
        assert tok.response_token_ids[-1] == fmt.end_of_turn_id and tok.loss_mask[-1] == 1
        assert fmt.classify(tok.response_token_ids) == "end"
        # The tool segments hold the <tool_response> tags, never trained on.
        for seg, from_model in t.segments(fmt):
            assert (TOOL_RESPONSE_START in seg and TOOL_RESPONSE_END in seg) == (not from_model)


@pytest.mark.parametrize("fmt_name", ["tiny_format", "qwen3_format"])
def test_mask_spans_match_rollout_segments(traces, fmt_name, request):
    """Masked spans are exactly the separately tokenised tool segments, as the rollout appends them."""
    fmt = request.getfixturevalue(fmt_name)
    for t in traces[:60]:
        tok = render_trace(t, fmt)
        spans, cur = [], []
        for i, m in zip(tok.response_token_ids, tok.loss_mask):
            if m == 0:
                cur.append(i)
            elif cur:
                spans.append(cur)
                cur = []
        expected = [fmt.tool_response_ids(run_code(c).result()) for c in t.codes]
        assert spans == expected


def test_jsonl_rows_round_trip(traces, tiny_format, tmp_path):
    path = write_traces_jsonl(traces[:20], tiny_format, tmp_path / "traces.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert set(rows[0]) == {"problem_id", "prompt_token_ids", "response_token_ids", "loss_mask"}
    back = read_traces_jsonl(path)
    assert [b.response_token_ids for b in back] == [render_trace(t, tiny_format).response_token_ids for t in traces[:20]]


def test_chat_messages_render_through_the_format(qwen3_format):
    fmt = qwen3_format
    messages = [
        {"role": "system", "content": "You are a careful mathematician."},
        {"role": "user", "content": "What is 2**10?"},
        {"role": "assistant", "content": "Let me compute.", "tool_calls": [
            {"type": "function", "function": {"name": fmt.preset.tool_name,
                                              "arguments": json.dumps({"code": "print(2**10)", "input": ""})}}]},
        {"role": "tool", "content": "Tool call success\nstdout: 1024\n"},
        {"role": "assistant", "content": "<answer>\\boxed{1024}</answer>"},
    ]
    trace = steps_from_messages(messages, fmt, "m1")
    tok = render_trace(trace, fmt)
    prompt = fmt.decode(tok.prompt_token_ids)
    assert prompt.startswith("<|im_start|>system\nYou are a careful mathematician.") and "# Tools" in prompt
    assert prompt.endswith("<|im_start|>user\nWhat is 2**10?<|im_end|>\n<|im_start|>assistant\n")
    model_text = fmt.decode([i for i, m in zip(tok.response_token_ids, tok.loss_mask) if m])
    assert model_text == "Let me compute." + fmt.tool_call_text("print(2**10)", "") + "<answer>\\boxed{1024}</answer><|im_end|>"
    tool_text = fmt.decode([i for i, m in zip(tok.response_token_ids, tok.loss_mask) if not m])
    assert tool_text == fmt.tool_response_text("Tool call success\nstdout: 1024\n")
    with pytest.raises(ChatDataError, match="tool"):
        steps_from_messages([messages[1], {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "bash", "arguments": "{}"}}]}], fmt)
    with pytest.raises(ChatDataError, match="end with an assistant"):
        steps_from_messages(messages[:4], fmt)


def test_traces_are_deterministic(problems):
    a = [t.steps for t in make_traces(problems[:50], seed=3)]
    b = [t.steps for t in make_traces(problems[:50], seed=3)]
    assert a == b


def test_loaded_problems_without_kind_are_refused():
    from shared.datasets import Problem

    with pytest.raises(ValueError, match="kind"):
        make_trace(Problem("x", "What is 1+1?", "2"), random.Random(0))


def test_a_wrong_answer_is_caught(problems):
    from dataclasses import replace

    wrong = replace(problems[0], answer=str(int(problems[0].answer) + 1))
    with pytest.raises(TraceError, match="expected"):
        make_trace(wrong, random.Random(0), buggy=False)


def test_copy_drills_copy_exactly_without_the_system_prompt(tiny_format):
    from services.reward.answers import extract_answer

    fmt = tiny_format
    drills = make_copy_drills(200, seed=3)
    assert [d.problem.problem_id for d in drills] == [f"drill-{i}" for i in range(200)]
    assert make_copy_drills(200, seed=3) == drills  # deterministic
    shapes = {" " in d.problem.answer for d in drills}
    assert shapes == {True, False}  # single numbers and expressions
    for d in drills:
        text = d.problem.answer
        assert d.problem.prompt == f"Repeat {text}"
        assert extract_answer(d.response_text(fmt)).text == text
        tok = render_trace(d, fmt)
        prompt = fmt.decode(tok.prompt_token_ids)
        assert prompt == f"<|im_start|>user\nRepeat {text}<|im_end|>\n<|im_start|>assistant\n"
        assert tok.loss_mask == [1] * len(tok.response_token_ids)
        assert fmt.decode(tok.response_token_ids) == d.response_text(fmt)
