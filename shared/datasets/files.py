"""Loading problem sets from files (JSONL / Parquet). Pure data code: file reading only."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.datasets.problem import Problem

# --------------------------------------------------------------------------- loading


@dataclass(frozen=True)
class RowError:
    file: str
    line: int  # JSONL line number or Parquet row number, 1-based
    reason: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.reason}"


class ProblemSetError(ValueError):
    """A problem set has bad rows (all of them listed in ``errors``) or cannot be read."""

    # At most this many rows are spelled out in the message; all are in ``errors``.
    MAX_LISTED = 50

    def __init__(self, errors: list[RowError]):
        self.errors = errors
        shown = "\n".join(f"  {e}" for e in errors[: self.MAX_LISTED])
        more = len(errors) - self.MAX_LISTED
        tail = f"\n  ... and {more} more" if more > 0 else ""
        super().__init__(f"{len(errors)} bad row(s) in problem set:\n{shown}{tail}")


def parse_integer_answer(value: Any) -> str:
    """The canonical decimal string of an integer answer; raises ValueError with the reason."""
    if isinstance(value, bool):
        raise ValueError(f"answer must be an integer, got boolean {value!r}")
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if value.is_integer() and abs(value) < 2**53:
            return str(int(value))
        raise ValueError(f"answer must be an integer, got {value!r}")
    if isinstance(value, str):
        text = value.strip()
        body = text[1:] if text[:1] in ("+", "-") else text
        if body.isascii() and body.isdigit():
            return str(int(text))
        raise ValueError(f"answer must be an integer, got {value!r}")
    if value is None:
        raise ValueError("missing 'answer'")
    raise ValueError(f"answer must be an integer, got {type(value).__name__}")


def _prompt_text(value: Any) -> str:
    if isinstance(value, str):
        if not value.strip():
            raise ValueError("'prompt' is empty")
        return value
    if isinstance(value, list):  # chat messages, as in the original DAPO-Math-17k parquet
        users = [m.get("content") for m in value if isinstance(m, dict) and m.get("role") == "user"]
        if not users or not isinstance(users[-1], str) or not users[-1].strip():
            raise ValueError("'prompt' is a message list without a non-empty user message")
        return users[-1]
    if value is None:
        raise ValueError("missing 'prompt'")
    raise ValueError(f"'prompt' must be a string or a list of chat messages, got {type(value).__name__}")


def _content_id(prompt: str, answer: str) -> str:
    return "p-" + hashlib.sha256(f"{prompt}\0{answer}".encode()).hexdigest()[:16]


def _row_to_problem(row: Any) -> Problem:
    if not isinstance(row, dict):
        raise ValueError(f"row must be a JSON object, got {type(row).__name__}")
    prompt = _prompt_text(row.get("prompt"))
    answer = parse_integer_answer(row.get("answer"))
    raw_id = row.get("id")
    if raw_id is None:
        pid = _content_id(prompt, answer)
    elif isinstance(raw_id, bool) or not isinstance(raw_id, (str, int)) or str(raw_id).strip() == "":
        raise ValueError(f"'id' must be a non-empty string or an integer, got {raw_id!r}")
    else:
        pid = str(raw_id)
    return Problem(problem_id=pid, prompt=prompt, answer=answer)


def _jsonl_rows(path: Path, errors: list[RowError]) -> Iterator[tuple[int, Any]]:
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            if not raw.strip():
                continue  # blank lines (e.g. a trailing newline) are not rows
            try:
                yield lineno, json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                errors.append(RowError(str(path), lineno, f"not valid JSON: {exc}"))


def _parquet_rows(path: Path, errors: list[RowError]) -> Iterator[tuple[int, Any]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as exc:  # noqa: BLE001 — pyarrow raises many types; report the reason
        errors.append(RowError(str(path), 0, f"cannot read Parquet file: {exc}"))
        return
    for index, row in enumerate(table.to_pylist(), start=1):
        yield index, row


def load_problems(paths: str | Path | Iterable[str | Path]) -> list[Problem]:
    """Load and validate one or more ``.jsonl`` / ``.parquet`` files (in order).

    Raises :class:`ProblemSetError` listing every bad row of every file (and duplicate ids
    across them) before returning anything.
    """
    if isinstance(paths, (str, Path)):
        paths = [paths]
    errors: list[RowError] = []
    problems: list[Problem] = []
    first_seen: dict[str, tuple[str, int]] = {}
    for p in paths:
        path = Path(p)
        if not path.is_file():
            errors.append(RowError(str(path), 0, "file not found"))
            continue
        suffix = path.suffix.lower()
        if suffix in (".jsonl", ".ndjson"):
            rows = _jsonl_rows(path, errors)
        elif suffix in (".parquet", ".pq"):
            rows = _parquet_rows(path, errors)
        else:
            errors.append(RowError(str(path), 0, f"unknown file type {suffix!r} (use .jsonl or .parquet)"))
            continue
        n_rows = 0
        for lineno, row in rows:
            n_rows += 1
            try:
                problem = _row_to_problem(row)
            except ValueError as exc:
                errors.append(RowError(str(path), lineno, str(exc)))
                continue
            if problem.problem_id in first_seen:
                f, ln = first_seen[problem.problem_id]
                errors.append(RowError(str(path), lineno, f"duplicate id {problem.problem_id!r} (first at {f}:{ln})"))
                continue
            first_seen[problem.problem_id] = (str(path), lineno)
            problems.append(problem)
        if n_rows == 0 and not any(e.file == str(path) for e in errors):
            errors.append(RowError(str(path), 0, "no rows"))
    if errors:
        raise ProblemSetError(errors)
    return problems


def write_jsonl(problems: Iterable[Problem], path: str | Path) -> Path:
    """Write problems as DAPO-style JSONL rows (what ``load_problems`` reads back)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as fh:
        for p in problems:
            fh.write(json.dumps(p.to_row(), ensure_ascii=False) + "\n")
    return out


