"""Problem-set files: schema detection (verl/DAPO, rStar, AIME variants, the project's own, an
explicit field mapping), bare problems, answers, ids, de-duplication, bad rows and
``rstar data inspect``. Every fixture is a real file written in tmp_path (pyarrow for Parquet)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from shared.datasets import (
    FieldMapping,
    ProblemSetError,
    generate_problems,
    load_problem_set,
    load_problems,
    write_jsonl,
)
from shared.datasets.cli import app as data_app

DAPO_PRE = ("Solve the following math problem step by step. The last line of your response should be of the form "
            "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n")
DAPO_POST = '\n\nRemember to put your answer on its own line after "Answer:".'

# (problem, ground truth) of the DAPO-shaped fixture.
DAPO_PROBLEMS = [
    ("In triangle $ABC$, $AB=13$, $BC=14$ and $CA=15$. Find the area of the triangle.", "84"),
    ("Let $x$ satisfy $4x = 3$. What is $x$?", "\\frac{3}{4}"),
    ("What is the length of the diagonal of a square with side $2$?", "2\\sqrt{2}"),
    ("Find the ordered pair $(a,b)$ with $a+b=3$ and $b-a=1$.", "(1,2)"),
    ("Write the set of $x$ with $0 \\le x < 1$ as an interval.", "[0, 1)"),
]


def dapo_row(problem: str, answer, index: str | None, *, wrap: bool = True) -> dict:
    content = DAPO_PRE + problem + DAPO_POST if wrap else problem
    return {"data_source": "math_dapo", "prompt": [{"content": content, "role": "user"}], "ability": "MATH",
            "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
            "extra_info": {"index": index}}


def write_parquet(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_jsonl_rows(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def dapo_file(tmp_path: Path) -> Path:
    """Each problem three times (DAPO-Math-17k repeats each ~100 times) with its own uuid; the
    third copy of the first problem differs only in case and spacing."""
    rows = []
    for copy in range(3):
        for j, (problem, answer) in enumerate(DAPO_PROBLEMS):
            if copy == 2 and j == 0:
                problem = "  IN TRIANGLE $ABC$,\n$AB=13$,  $BC=14$ and $CA=15$. Find the area of the triangle. "
            rows.append(dapo_row(problem, answer, f"uuid-{copy}-{j}"))
    return write_parquet(tmp_path / "dapo-math-17k.parquet", rows)


def errors_of(exc_info) -> list[str]:
    return [str(e) for e in exc_info.value.errors]


# --------------------------------------------------------------------------- verl / DAPO


def test_dapo_parquet_gives_bare_problems_answers_ids_and_drops_duplicates(tmp_path):
    path = dapo_file(tmp_path)
    ps = load_problem_set(path)
    assert [(p.problem_id, p.prompt, p.answer) for p in ps.problems] == [
        (f"uuid-0-{j}", problem, answer) for j, (problem, answer) in enumerate(DAPO_PROBLEMS)]
    for p in ps.problems:  # DAPO's own answer instruction is gone, nothing else
        assert "Answer:" not in p.prompt and "step by step" not in p.prompt
        assert p.prompt == p.prompt.strip()
    r = ps.report
    assert [(f.path, f.schema, f.rows, f.problems, f.duplicates, f.skipped) for f in r.files] == [
        (str(path), "verl", 15, 5, 10, 0)]
    assert (r.rows, r.problems, r.duplicates, r.skipped, r.conflicting_answers) == (15, 5, 10, 0, 0)
    assert r.answer_kinds == {"integer": 1, "fraction": 1, "radical": 1, "tuple": 1, "interval": 1}
    assert len(ps) == 5 and list(ps) == ps.problems


def test_without_dedupe_every_row_is_kept_under_its_own_id(tmp_path):
    ps = load_problem_set(dapo_file(tmp_path), dedupe=False)
    assert len(ps.problems) == 15 and ps.report.duplicates == 0
    assert len({p.problem_id for p in ps.problems}) == 15


def test_a_duplicate_with_another_answer_is_reported_and_the_first_kept(tmp_path):
    path = write_parquet(tmp_path / "d.parquet", [
        dapo_row("What is $1+1$?", "2", "a"),
        dapo_row("What is $1+1$?", " 2 ", "b"),  # the same answer once cleaned: no conflict
        dapo_row("what is  $1+1$?", "3", "c"),
    ])
    ps = load_problem_set(path)
    assert [(p.problem_id, p.answer) for p in ps.problems] == [("a", "2")]
    assert ps.report.duplicates == 2 and ps.report.conflicting_answers == 1
    assert ps.report.warnings == [f"{path}:3: the problem of {path}:1 with another answer ('3'; kept '2')"]


def test_other_verl_instructions_and_string_prompts_are_stripped(tmp_path):
    path = write_parquet(tmp_path / "math.parquet", [
        {"data_source": "lighteval/MATH", "prompt": [{"role": "system", "content": "You are helpful."},
                                                     {"role": "user", "content": "Compute $3^4$. Let's think step by step and output the final answer within \\boxed{}."}],
         "reward_model": {"ground_truth": ["81"], "style": "rule"}, "extra_info": {"index": 0, "split": "train"}},
        {"data_source": "lighteval/MATH", "prompt": [{"role": "user", "content": "Please reason step by step, and put your final answer within \\boxed{}.\nFind $\\sqrt{16}$."}],
         "reward_model": {"ground_truth": ["4"], "style": "rule"}, "extra_info": {"index": 1, "split": "train"}},
    ])
    ps = load_problem_set(path)
    assert [(p.problem_id, p.prompt, p.answer) for p in ps.problems] == [
        ("lighteval/MATH:0", "Compute $3^4$.", "81"), ("lighteval/MATH:1", "Find $\\sqrt{16}$.", "4")]


def test_open_r1_processed_dapo_string_prompt_is_read_as_verl(tmp_path):
    path = write_parquet(tmp_path / "processed.parquet", [
        {"prompt": "How many primes are below 10?", "solution": "4", "data_source": "math_dapo",
         "reward_model": {"ground_truth": "4", "style": "rule-lighteval/MATH_v2"}, "extra_info": {"index": "u1"}}])
    ps = load_problem_set(path)
    assert ps.report.files[0].schema == "verl"
    assert [(p.problem_id, p.prompt, p.answer) for p in ps.problems] == [("u1", "How many primes are below 10?", "4")]


# --------------------------------------------------------------------------- rStar


def test_rstar_preprocessed_parquet_reads_extra_info(tmp_path):
    source = "rstar_open-r1/DAPO-Math-17k-Processed"
    rows = [{"data_source": source, "agent_name": "rstar2_agent",
             "prompt": [{"role": "user", "content": f"wrapped {q} (ignored)"}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": a},
             "extra_info": {"split": "train", "index": i, "answer": a, "question": q, "need_tools_kwargs": False}}
            for i, (q, a) in enumerate([("Find $2^{10}$.", "1024"), ("Simplify $\\frac{6}{8}$.", "\\frac{3}{4}")])]
    ps = load_problem_set(write_parquet(tmp_path / "train.parquet", rows))
    assert ps.report.files[0].schema == "rstar"
    assert [(p.problem_id, p.prompt, p.answer) for p in ps.problems] == [
        (f"{source}:0", "Find $2^{10}$.", "1024"), (f"{source}:1", "Simplify $\\frac{6}{8}$.", "\\frac{3}{4}")]


# --------------------------------------------------------------------------- AIME


def test_aime_2024_jsonl(tmp_path):
    path = write_jsonl_rows(tmp_path / "aime_2024.jsonl", [
        {"ID": "2024-II-4", "Problem": "Let $x,y$ and $z$ be positive reals ...", "Solution": "...", "Answer": 33},
        {"ID": "2024-I-2", "Problem": "There exist real numbers $x$ and $y$ ...", "Solution": "...", "Answer": 25},
    ])
    ps = load_problem_set(path)
    assert ps.report.files[0].schema == "aime"
    assert [(p.problem_id, p.prompt, p.answer) for p in ps.problems] == [
        ("2024-II-4", "Let $x,y$ and $z$ be positive reals ...", "33"),
        ("2024-I-2", "There exist real numbers $x$ and $y$ ...", "25")]


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_aime_2025_variants_with_and_without_ids(tmp_path, fmt):
    variants = {
        "problem-id": [{"id": 0, "problem": "Find the sum of all integer bases $b>9$ ...", "answer": "70"},
                       {"id": 1, "problem": "On $\\triangle ABC$ points ...", "answer": "588"}],
        "problem": [{"problem": "Find the sum of all integer bases $b>9$ ...", "answer": "70"}],
        "question": [{"question": "Find the sum of all integer bases $b>9$ ...", "answer": "70"}],
    }
    loaded = {}
    for name, rows in variants.items():
        path = tmp_path / f"aime2025-{name}.{fmt}"
        write_parquet(path, rows) if fmt == "parquet" else write_jsonl_rows(path, rows)
        ps = load_problem_set(path)
        loaded[name] = (ps.report.files[0].schema, [(p.problem_id, p.prompt, p.answer) for p in ps.problems])
    assert loaded["problem-id"] == ("problem-answer", [
        ("0", "Find the sum of all integer bases $b>9$ ...", "70"), ("1", "On $\\triangle ABC$ points ...", "588")])
    schema, [(pid, prompt, answer)] = loaded["problem"]
    assert (schema, prompt, answer) == ("problem-answer", "Find the sum of all integer bases $b>9$ ...", "70")
    assert pid.startswith("p-") and len(pid) == 18
    assert loaded["question"] == ("question-answer", [(pid, prompt, answer)])  # the same content hash


# --------------------------------------------------------------------------- the project's own rows


def test_project_rows_string_and_message_prompts(tmp_path):
    path = write_jsonl_rows(tmp_path / "p.jsonl", [
        {"prompt": "What is 2+2?", "answer": "4", "id": "a"},
        "",
        {"prompt": "What is 3-5?", "answer": -2},
        {"prompt": [{"role": "user", "content": "Compute 7*6."}], "answer": " 42 ", "id": 7},
        {"prompt": "Evaluate $\\frac{1}{2}+\\frac{1}{4}$.", "answer": "$\\frac{3}{4}$"},
        {"prompt": "Give $1000$ with a comma.", "answer": "\\boxed{1,000}"},
    ])
    ps = load_problem_set(path)
    assert ps.report.files[0].schema == "project" and ps.report.rows == 5
    assert [p.answer for p in ps.problems] == ["4", "-2", "42", "\\frac{3}{4}", "1000"]
    assert ps.problems[0].problem_id == "a" and ps.problems[2].problem_id == "7"
    assert ps.problems[1].problem_id.startswith("p-")
    assert ps.problems[2].prompt == "Compute 7*6."


def test_generated_problems_round_trip_through_jsonl(tmp_path):
    problems = generate_problems(50, seed=3)
    loaded = load_problems(write_jsonl(problems, tmp_path / "gen.jsonl"))
    assert [(p.problem_id, p.prompt, p.answer) for p in loaded] == [(p.problem_id, p.prompt, p.answer) for p in problems]


def test_a_json_array_file_is_read(tmp_path):
    path = tmp_path / "aime.json"
    path.write_text(json.dumps([{"problem": "P1", "answer": 1, "id": "x"}, {"problem": "P2", "answer": "2", "id": "y"}]))
    assert [(p.problem_id, p.answer) for p in load_problems(path)] == [("x", "1"), ("y", "2")]


# --------------------------------------------------------------------------- field mapping


def test_unknown_layout_is_an_error_naming_columns_and_schemas(tmp_path):
    path = write_jsonl_rows(tmp_path / "odd.jsonl", [{"q": {"text": "What is 1+1?"}, "gold": "2", "key": "k1"}])
    with pytest.raises(ProblemSetError) as info:
        load_problem_set(path)
    (message,) = errors_of(info)
    assert message.startswith(f"{path}:0: columns: unknown column layout: columns gold, key, q (nested: q.text); "
                              "known schemas: rstar (extra_info.question + extra_info.answer); "
                              "verl (prompt + reward_model.ground_truth); aime (Problem + Answer); ")
    assert "project (prompt + answer)" in message and "--field prompt=PATH" in message


def test_a_field_mapping_reads_any_layout(tmp_path):
    rows = [{"q": {"text": "What is 1+1?"}, "gold": "2", "key": "k1"},
            {"q": {"text": "What is $\\frac12+\\frac14$?"}, "gold": "\\frac{3}{4}", "key": "k2"}]
    for path in (write_jsonl_rows(tmp_path / "odd.jsonl", rows), write_parquet(tmp_path / "odd.parquet", rows)):
        ps = load_problem_set(path, fields={"prompt": "q.text", "answer": "gold", "id": "key"})
        assert ps.report.files[0].schema == "fields(prompt=q.text, answer=gold, id=key)"
        assert [(p.problem_id, p.prompt, p.answer) for p in ps.problems] == [
            ("k1", "What is 1+1?", "2"), ("k2", "What is $\\frac12+\\frac14$?", "\\frac{3}{4}")]
    # A mapping also overrides detection, and steps into lists.
    dapo = write_parquet(tmp_path / "d.parquet", [dapo_row("P?", "5", "u")])
    ps = load_problem_set(dapo, fields=["prompt=prompt.0.content", "answer=reward_model.ground_truth"])
    assert [(p.prompt, p.answer) for p in ps.problems] == [("P?", "5")]
    assert ps.problems[0].problem_id.startswith("p-")


def test_field_mapping_errors(tmp_path):
    path = write_jsonl_rows(tmp_path / "odd.jsonl", [{"q": "x", "gold": "2"}])
    with pytest.raises(ProblemSetError) as info:
        load_problem_set(path, fields={"prompt": "question", "answer": "gold"})
    assert errors_of(info) == [f"{path}:0: columns: the field mapping reads question, but the file's columns are gold, q"]
    with pytest.raises(ValueError, match="prompt must be given"):
        FieldMapping.parse({"answer": "gold"})
    with pytest.raises(ValueError, match="unknown key"):
        FieldMapping.parse({"prompt": "q", "answer": "gold", "solution": "s"})
    with pytest.raises(ValueError, match="KEY=PATH"):
        FieldMapping.parse(["prompt"])


# --------------------------------------------------------------------------- bad rows


def test_every_bad_row_names_file_row_and_field(tmp_path):
    parquet = write_parquet(tmp_path / "bad.parquet", [
        dapo_row("Fine problem.", "7", "ok-1"),                                        # 1
        dapo_row("No answer here.", None, "r2"),                                       # 2
        dapo_row("", "1", "r3", wrap=False),                                           # 3
        dapo_row("", "1", "r4"),                                                       # 4 only DAPO's instruction
        dapo_row("Two answers.", "1", "r5") | {"reward_model": {"ground_truth": "  ", "style": "x"}},  # 5
        dapo_row("Another fine problem.", "8", "ok-1"),                                # 6 id taken
        {**dapo_row("System only.", "1", "r7"), "prompt": [{"role": "system", "content": "hi"}]},  # 7
    ])
    jsonl = write_jsonl_rows(tmp_path / "bad.jsonl", [
        {"prompt": "ok", "answer": 1, "id": "x"},          # 1
        "{not json",                                         # 2
        {"answer": 3},                                       # 3
        {"prompt": "p", "answer": True},                     # 4
        {"prompt": "p2", "answer": ["1", "2"]},              # 5
        [1, 2],                                              # 6
        {"prompt": "p3", "answer": 1, "id": ""},             # 7
        {"prompt": "p4", "answer": {"value": 1}},            # 8
        {"prompt": "p5", "answer": float("nan")},            # 9
    ])
    with pytest.raises(ProblemSetError) as info:
        load_problem_set([parquet, jsonl])
    got = errors_of(info)
    assert got == [
        f"{parquet}:2: reward_model.ground_truth: missing",
        f"{parquet}:3: prompt: empty",
        f"{parquet}:4: prompt: only an answer instruction, no problem text",
        f"{parquet}:5: reward_model.ground_truth: empty",
        f"{parquet}:6: extra_info.index: duplicate id 'ok-1': another problem has it at {parquet}:1",
        f"{parquet}:7: prompt: a message list without a user message",
        f"{jsonl}:2: row: not valid JSON: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)",
        f"{jsonl}:3: prompt: missing",
        f"{jsonl}:4: answer: a boolean (True), not an answer",
        f"{jsonl}:5: answer: a list of 2 answers (one expected)",
        f"{jsonl}:6: row: not a JSON object (a list)",
        f"{jsonl}:7: id: empty",
        f"{jsonl}:8: answer: a dict, not an answer (a string or a number expected)",
        f"{jsonl}:9: answer: not a finite number (nan)",
    ]
    assert info.value.total == 14
    message = str(info.value)
    assert message.startswith("14 error(s) in problem set (first 10 listed):\n")
    assert f"  {got[9]}\n" in message and got[10] not in message and "... and 4 more" in message
    assert "on_bad_row: skip" in message


def test_skip_drops_and_counts_bad_rows(tmp_path):
    path = write_jsonl_rows(tmp_path / "mixed.jsonl", [
        {"problem": "Good one.", "answer": "\\frac{1}{2}"},
        {"problem": "Bad one."},
        "{oops",
        {"problem": "Good two.", "answer": "2\\sqrt{3}"},
        {"problem": "", "answer": "1"},
    ])
    ps = load_problem_set(path, on_bad_row="skip")
    assert [(p.prompt, p.answer) for p in ps.problems] == [("Good one.", "\\frac{1}{2}"), ("Good two.", "2\\sqrt{3}")]
    r = ps.report
    assert (r.rows, r.problems, r.skipped, r.files[0].skipped) == (5, 2, 3, 3)
    assert [str(e) for e in r.skipped_rows] == [
        f"{path}:2: answer: missing", f"{path}:3: row: not valid JSON: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)",
        f"{path}:5: problem: empty"]
    assert r.summary()["skipped"] == 3


def test_only_the_first_errors_are_listed_but_all_counted(tmp_path):
    path = write_jsonl_rows(tmp_path / "many.jsonl", [{"prompt": f"p{i}", "answer": None} for i in range(25)])
    with pytest.raises(ProblemSetError) as info:
        load_problems(path)
    message = str(info.value)
    assert info.value.total == 25 and len(info.value.errors) == 25
    listed = [line for line in message.splitlines() if line.startswith(f"  {path}:")]
    assert listed == [f"  {path}:{i}: answer: missing" for i in range(1, 11)]
    assert message.startswith("25 error(s) in problem set (first 10 listed):") and "... and 15 more" in message


def test_duplicate_ids_across_files_name_both_places(tmp_path):
    a = write_jsonl_rows(tmp_path / "a.jsonl", [{"id": "x", "problem": "First.", "answer": 1}])
    b = write_jsonl_rows(tmp_path / "b.jsonl", [{"id": "y", "problem": "Other.", "answer": 2},
                                                 {"id": "x", "problem": "Second.", "answer": 1}])
    with pytest.raises(ProblemSetError) as info:
        load_problem_set([a, b])
    assert errors_of(info) == [f"{b}:2: id: duplicate id 'x': another problem has it at {a}:1"]
    # The same problem under the same id is a duplicate (dropped), not an error...
    c = write_jsonl_rows(tmp_path / "c.jsonl", [{"id": "x", "problem": "first.", "answer": 1}])
    assert load_problem_set([a, c]).report.duplicates == 1
    # ... unless dedupe is off.
    with pytest.raises(ProblemSetError, match="the same problem \\(dedupe is off\\)"):
        load_problem_set([a, c], dedupe=False)


def test_file_level_errors_are_collected_together(tmp_path):
    a = write_jsonl_rows(tmp_path / "a.jsonl", [{"prompt": "p", "answer": ""}])
    b = tmp_path / "missing.jsonl"
    c = tmp_path / "c.csv"
    c.write_text("prompt,answer\n")
    d = tmp_path / "broken.parquet"
    d.write_bytes(b"not parquet at all")
    e = tmp_path / "empty.jsonl"
    e.write_text("\n\n")
    with pytest.raises(ProblemSetError) as info:
        load_problems([a, b, c, d, e], on_bad_row="skip")  # skip is for rows, never for files
    got = errors_of(info)
    assert got[:3] == [f"{b}:0: file: file not found",
                       f"{c}:0: file: unknown file type '.csv' (one of .jsonl, .ndjson, .json, .parquet, .pq)",
                       f"{d}:0: file: cannot read Parquet file: " + got[2].split("cannot read Parquet file: ", 1)[1]]
    assert got[3] == f"{e}:0: file: no rows" and len(got) == 4


def test_bad_arguments():
    with pytest.raises(ValueError, match="on_bad_row"):
        load_problem_set([], on_bad_row="ignore")


# --------------------------------------------------------------------------- rstar data inspect


def _inspect(args):
    result = CliRunner().invoke(data_app, ["inspect", *map(str, args)])
    return result, json.loads(result.stdout.strip().splitlines()[-1]) if result.exit_code == 0 else None


def test_inspect_prints_schema_rows_duplicates_kinds_and_examples(tmp_path):
    path = dapo_file(tmp_path)
    result, figures = _inspect([path, "--examples", "5"])
    assert result.exit_code == 0, result.output
    assert figures == {
        "files": [{"path": str(path), "schema": "verl", "rows": 15, "problems": 5, "duplicates": 10, "skipped": 0}],
        "rows": 15, "problems": 5, "duplicates": 10, "skipped": 0, "dedupe": True,
        "answer_kinds": {"integer": 1, "fraction": 1, "radical": 1, "tuple": 1, "interval": 1},
        "conflicting_answers": 0}
    assert result.stdout.strip().count("\n") == 0  # the tables go to stderr, stdout is the JSON line
    err = result.stderr
    for text in ("verl", "answer kinds", "interval", "[0, 1)", "2\\sqrt{2}", "uuid-0-3", "examples"):
        assert text in err, text
    assert "Remember to put" not in err and "Answer: $Answer" not in err


def test_inspect_reports_bad_rows_and_uses_a_field_mapping(tmp_path):
    path = write_jsonl_rows(tmp_path / "odd.jsonl", [{"q": "What is 1+1?", "gold": "2"}, {"q": "No gold."}])
    result, _ = _inspect([path])
    assert result.exit_code == 2 and "unknown column layout" in result.stderr
    result, figures = _inspect([path, "--field", "prompt=q", "--field", "answer=gold", "-n", "1"])
    assert result.exit_code == 0, result.output
    assert (figures["problems"], figures["skipped"], figures["files"][0]["schema"]) == (1, 1, "fields(prompt=q, answer=gold)")
    assert f"{path}:2: gold: missing" in " ".join(result.stderr.split())
    result, _ = _inspect([path, "--field", "prompt"])
    assert result.exit_code == 2 and "KEY=PATH" in result.stderr


def test_rstar_data_inspect_is_mounted(tmp_path):
    rstar = Path(sys.executable).with_name("rstar")
    if not rstar.exists():
        pytest.skip("the rstar entry point is not installed in this environment")
    path = dapo_file(tmp_path)
    done = subprocess.run([str(rstar), "data", "inspect", str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert (figures["rows"], figures["problems"], figures["duplicates"]) == (15, 5, 10)
    assert "problem-set files" in done.stderr
    # Light imports only: the command must not pull in the model stack.
    probe = subprocess.run([sys.executable, "-c", (
        "import sys; from typer.testing import CliRunner; from shared.datasets.cli import app; "
        f"r = CliRunner().invoke(app, ['inspect', {str(path)!r}]); assert r.exit_code == 0, r.output; "
        "print(sorted(m for m in ('torch', 'vllm', 'transformers') if m in sys.modules))")],
        capture_output=True, text=True, timeout=120)
    assert probe.stdout.strip().splitlines()[-1] == "[]", probe.stderr
