"""SFT traces: real tool outputs, exact loss masks, buggy first calls that really fail."""

from __future__ import annotations

import json
import random

import pytest

from shared import chat_format as cf
from shared.datasets.generated import KINDS, generate_problems
from shared.datasets.sft_traces import (
    BUGGY_FRACTION,
    CodeRun,
    TraceError,
    make_copy_drills,
    make_trace,
    make_traces,
    read_traces_jsonl,
    run_code,
    tokenize_trace,
    tool_output_text,
    write_traces_jsonl,
)


@pytest.fixture(scope="module")
def problems():
    return generate_problems(300, seed=21)


@pytest.fixture(scope="module")
def traces(problems):
    return make_traces(problems, seed=0)


def test_run_code_captures_output_and_tracebacks():
    assert run_code("print(6 * 7)") == CodeRun(True, "42\n")
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


def test_tool_output_text_matches_the_rollout_composition():
    from services.rollout.agent import outcome_from_execution

    for stdout, stderr in [("42\n", ""), ("", "Traceback\nNameError: x\n"), ("a\n", "E\n"), ("", "")]:
        status = "error" if stderr else "ok"
        assert tool_output_text(stdout, stderr) == outcome_from_execution(status, stdout, stderr, 1.0).output


def test_traces_follow_the_chat_format_and_answer_correctly(traces):
    for t in traces:
        text = t.response_text
        assert text.endswith(format_end(t.problem.answer))
        assert cf.count_answer_tags(text) == 1
        # Every tool call parses, and its code is the recorded code.
        calls = text.split(cf.TOOL_CALL_END)[:-1]
        assert len(calls) == len(t.codes) == (2 if t.buggy_first_call else 1)
        for call, code in zip(calls, t.codes):
            parsed = cf.parse_tool_call(call + cf.TOOL_CALL_END)
            assert parsed.ok and parsed.code == code
        # Every tool response is exactly what running the code prints now.
        responses = [s.text for s in t.segments if not s.from_model]
        assert responses == [cf.format_tool_response(run_code(c).output) for c in t.codes]


def format_end(answer):
    return cf.format_answer(answer) + cf.IM_END


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


def test_loss_mask_is_exact(traces, tokenizer):
    for t in traces[:120]:
        tok = tokenize_trace(t, tokenizer)
        assert len(tok.loss_mask) == len(tok.response_token_ids)
        model_ids = [i for i, m in zip(tok.response_token_ids, tok.loss_mask) if m]
        tool_ids = [i for i, m in zip(tok.response_token_ids, tok.loss_mask) if not m]
        assert tokenizer.decode(model_ids) == t.model_text
        assert tokenizer.decode(tool_ids) == "".join(s.text for s in t.segments if not s.from_model)
        assert tokenizer.decode(tok.response_token_ids) == t.response_text
        assert tokenizer.decode(tok.prompt_token_ids) == cf.render_prompt(t.problem.prompt)
        # The model's last token is <|im_end|> and it is trained on.
        assert tok.response_token_ids[-1] == tokenizer.eos_token_id and tok.loss_mask[-1] == 1
        # The stop token </tool_call> is a model token; <tool_response> and </tool_response> are not.
        ids = dict(zip(["call_end", "resp_start", "resp_end"],
                       tokenizer.convert_tokens_to_ids([cf.TOOL_CALL_END, cf.TOOL_RESPONSE_START, cf.TOOL_RESPONSE_END])))
        for i, m in zip(tok.response_token_ids, tok.loss_mask):
            if i == ids["call_end"]:
                assert m == 1
            if i in (ids["resp_start"], ids["resp_end"]):
                assert m == 0


def test_mask_spans_match_rollout_segments(traces, tokenizer):
    """Masked spans are exactly the separately tokenised tool responses, as the rollout appends them."""
    for t in traces[:60]:
        tok = tokenize_trace(t, tokenizer)
        spans, cur = [], []
        for i, m in zip(tok.response_token_ids, tok.loss_mask):
            if m == 0:
                cur.append(i)
            elif cur:
                spans.append(cur)
                cur = []
        expected = [tokenizer.encode(s.text, add_special_tokens=False) for s in t.segments if not s.from_model]
        assert spans == expected


def test_jsonl_rows_round_trip(traces, tokenizer, tmp_path):
    path = write_traces_jsonl(traces[:20], tokenizer, tmp_path / "traces.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert set(rows[0]) == {"problem_id", "prompt_token_ids", "response_token_ids", "loss_mask"}
    back = read_traces_jsonl(path)
    assert [b.response_token_ids for b in back] == [tokenize_trace(t, tokenizer).response_token_ids for t in traces[:20]]


def test_traces_are_deterministic(problems):
    a = [t.response_text for t in make_traces(problems[:50], seed=3)]
    b = [t.response_text for t in make_traces(problems[:50], seed=3)]
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


def test_copy_drills_copy_exactly_without_the_system_prompt(tokenizer):
    from services.reward.answers import extract_answer

    drills = make_copy_drills(200, seed=3)
    assert [d.problem.problem_id for d in drills] == [f"drill-{i}" for i in range(200)]
    assert make_copy_drills(200, seed=3) == drills  # deterministic
    shapes = {" " in d.problem.answer for d in drills}
    assert shapes == {True, False}  # single numbers and expressions
    for d in drills:
        text = d.problem.answer
        assert d.problem.prompt == f"Repeat {text}"
        assert extract_answer(d.response_text).text == text
        tok = tokenize_trace(d, tokenizer)
        prompt = tokenizer.decode(tok.prompt_token_ids)
        assert prompt == cf.render_prompt(d.problem.prompt, system=None)
        assert cf.SYSTEM_PROMPT not in prompt
        assert tok.loss_mask == [1] * len(tok.response_token_ids)
        assert tokenizer.decode(tok.response_token_ids) == d.response_text
