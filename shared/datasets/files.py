"""Loading problem sets from files (JSONL / JSON / Parquet). Pure data code: file reading only.

:func:`load_problem_set` reads one or more files in order, detects each file's row schema from
its columns (:mod:`shared.datasets.schemas`; or uses an explicit :class:`FieldMapping`),
extracts the bare problem (the dataset's own answer instruction removed,
:mod:`shared.datasets.prompts`), the cleaned gold answer (:mod:`shared.datasets.answers`) and
the id, de-duplicates by normalised problem text across all files, and returns a
:class:`ProblemSet`: the problems and a :class:`ProblemSetReport` (schema per file, rows read,
duplicates dropped, bad rows skipped, answer kinds, conflicting answers).

Bad rows: every row is checked before anything is returned; with ``on_bad_row="error"`` (the
default) a :class:`ProblemSetError` lists ``file:row: field: reason`` for the first
:attr:`ProblemSetError.MAX_LISTED` of them and gives the total; with ``on_bad_row="skip"`` bad
rows are skipped and counted in the report. File-level problems (missing file, unknown file
type or column layout, unreadable Parquet, no rows) are always errors.

Ids: the dataset's own id when it has one, else ``p-<sha256(problem, answer)[:16]>``. Two
different problems with one id are an error naming both places.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from shared.datasets.answers import answer_kind
from shared.datasets.problem import Problem
from shared.datasets.prompts import normalise_problem
from shared.datasets.schemas import (
    SCHEMAS,
    Extracted,
    FieldError,
    FieldMapping,
    RowSchema,
    content_id,
    detect_schema,
)

OnBadRow = Literal["error", "skip"]

JSONL_SUFFIXES = (".jsonl", ".ndjson")
JSON_SUFFIXES = (".json",)
PARQUET_SUFFIXES = (".parquet", ".pq")

# JSONL columns are the union of the keys (dotted, nested objects included) of this many rows.
_DETECT_ROWS = 1000
_PARQUET_BATCH_ROWS = 8192

# --------------------------------------------------------------------------- errors


@dataclass(frozen=True)
class RowError:
    file: str
    line: int  # JSONL line number or Parquet/JSON row number, 1-based; 0 for the whole file
    field: str  # dotted path of the field at fault; "row" for the whole row, "file" for the file
    reason: str

    @property
    def row(self) -> int:
        return self.line

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.field}: {self.reason}"


class ProblemSetError(ValueError):
    """A problem set has bad rows or cannot be read. ``errors``: the first :attr:`MAX_KEPT`
    errors (in file and row order); ``total``: how many there are."""

    MAX_LISTED = 10  # spelled out in the message
    MAX_KEPT = 1000  # kept in ``errors``

    def __init__(self, errors: list[RowError], total: int | None = None):
        self.errors = errors[: self.MAX_KEPT]
        self.total = len(errors) if total is None else total
        shown = "\n".join(f"  {e}" for e in errors[: self.MAX_LISTED])
        more = self.total - min(len(errors), self.MAX_LISTED)
        tail = f"\n  ... and {more} more" if more > 0 else ""
        hint = ""
        if any(e.line > 0 for e in errors):
            hint = "\n(dataset.on_bad_row: skip skips bad rows and counts them instead)"
        first = f" (first {self.MAX_LISTED} listed)" if self.total > self.MAX_LISTED else ""
        super().__init__(f"{self.total} error(s) in problem set{first}:\n{shown}{tail}{hint}")


class _FileError(Exception):
    def __init__(self, field: str, reason: str):
        self.field, self.reason = field, reason


@dataclass(frozen=True)
class _BadRow:
    field: str
    reason: str


# --------------------------------------------------------------------------- report


@dataclass
class FileReport:
    path: str
    schema: str = "-"
    rows: int = 0  # rows read (blank JSONL lines are not rows)
    problems: int = 0  # kept from this file
    duplicates: int = 0  # dropped: the same normalised problem as an earlier row (any file)
    skipped: int = 0  # bad rows skipped (on_bad_row="skip")


@dataclass
class ProblemSetReport:
    files: list[FileReport] = field(default_factory=list)
    dedupe: bool = True
    answer_kinds: dict[str, int] = field(default_factory=dict)
    conflicting_answers: int = 0  # duplicates whose answer differs from the kept row's
    warnings: list[str] = field(default_factory=list)  # the first MAX_WARNINGS of them, spelled out
    skipped_rows: list[RowError] = field(default_factory=list)  # the first MAX_WARNINGS skipped rows

    MAX_WARNINGS = 10

    @property
    def rows(self) -> int:
        return sum(f.rows for f in self.files)

    @property
    def problems(self) -> int:
        return sum(f.problems for f in self.files)

    @property
    def duplicates(self) -> int:
        return sum(f.duplicates for f in self.files)

    @property
    def skipped(self) -> int:
        return sum(f.skipped for f in self.files)

    def summary(self) -> dict[str, Any]:
        """The figures as plain JSON values."""
        return {
            "files": [vars(f).copy() for f in self.files],
            "rows": self.rows,
            "problems": self.problems,
            "duplicates": self.duplicates,
            "skipped": self.skipped,
            "dedupe": self.dedupe,
            "answer_kinds": dict(self.answer_kinds),
            "conflicting_answers": self.conflicting_answers,
        }


@dataclass
class ProblemSet:
    problems: list[Problem]
    report: ProblemSetReport

    def __len__(self) -> int:
        return len(self.problems)

    def __iter__(self) -> Iterator[Problem]:
        return iter(self.problems)


# --------------------------------------------------------------------------- reading


def _flat_keys(obj: Mapping[str, Any], prefix: str = "") -> Iterator[str]:
    for key, value in obj.items():
        name = f"{prefix}{key}"
        yield name
        if isinstance(value, Mapping):
            yield from _flat_keys(value, name + ".")


def _arrow_columns(schema) -> set[str]:
    import pyarrow as pa

    out: set[str] = set()

    def walk(fields, prefix: str) -> None:
        for f in fields:
            name = f"{prefix}{f.name}"
            out.add(name)
            if pa.types.is_struct(f.type):
                walk(list(f.type), name + ".")

    walk(list(schema), "")
    return out


def _jsonl_rows(path: Path) -> Iterator[tuple[int, Any]]:
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            if not raw.strip():
                continue  # blank lines (e.g. a trailing newline) are not rows
            try:
                yield lineno, json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                yield lineno, _BadRow("row", f"not valid JSON: {exc}")


def _json_rows(path: Path) -> Iterator[tuple[int, Any]]:
    try:
        data = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise _FileError("file", f"not valid JSON: {exc}") from None
    if isinstance(data, Mapping):  # {"data": [...]} / {"train": [...]}: one list of rows inside
        lists = [v for v in data.values() if isinstance(v, list)]
        if len(lists) == 1:
            data = lists[0]
    if not isinstance(data, list):
        raise _FileError("file", "a .json file must hold a list of row objects (use .jsonl for one object a line)")
    return iter(enumerate(data, start=1))


def _json_columns(rows: Iterator[tuple[int, Any]]) -> tuple[set[str], Iterator[tuple[int, Any]]]:
    head = list(itertools.islice(rows, _DETECT_ROWS))
    if not head:
        raise _FileError("file", "no rows")
    columns: set[str] = set()
    for _, row in head:
        if isinstance(row, Mapping):
            columns.update(_flat_keys(row))
    return columns, itertools.chain(head, rows)


class _ParquetSource:
    def __init__(self, path: Path):
        import pyarrow.parquet as pq

        try:
            self.file = pq.ParquetFile(path)
        except Exception as exc:  # noqa: BLE001 — pyarrow raises many types; report the reason
            raise _FileError("file", f"cannot read Parquet file: {exc}") from None
        self.path = path
        self.columns = _arrow_columns(self.file.schema_arrow)

    def rows(self, schema: RowSchema) -> Iterator[tuple[int, Any]]:
        top = [c for c in self.file.schema_arrow.names if c in schema.top_level_columns()]
        index = 0
        try:
            for batch in self.file.iter_batches(batch_size=_PARQUET_BATCH_ROWS, columns=top):
                for row in batch.to_pylist():
                    index += 1
                    yield index, row
        except OSError as exc:  # a corrupt page / column chunk
            raise _FileError("file", f"cannot read Parquet file after row {index}: {exc}") from None


def _columns_and_rows(path: Path) -> tuple[set[str], Any]:
    """(columns, a function schema -> iterator of (row number, row))."""
    suffix = path.suffix.lower()
    if suffix in PARQUET_SUFFIXES:
        source = _ParquetSource(path)
        return source.columns, source.rows
    if suffix in JSONL_SUFFIXES or suffix in JSON_SUFFIXES:
        rows = _jsonl_rows(path) if suffix in JSONL_SUFFIXES else _json_rows(path)
        columns, rows = _json_columns(rows)
        return columns, lambda schema: rows
    known = ", ".join(JSONL_SUFFIXES + JSON_SUFFIXES + PARQUET_SUFFIXES)
    raise _FileError("file", f"unknown file type {suffix!r} (one of {known})")


def _choose_schema(columns: set[str], mapping: FieldMapping | None) -> RowSchema:
    shown = ", ".join(sorted(c for c in columns if "." not in c)) or "none"
    if mapping is not None:
        missing = mapping.missing_columns(columns)
        if missing:
            raise _FileError("columns", f"the field mapping reads {', '.join(missing)}, but the file's columns are {shown}")
        return mapping
    schema = detect_schema(columns)
    if schema is None:
        known = "; ".join(f"{s.name} ({' + '.join(s.required)})" for s in SCHEMAS)
        nested = sorted(c for c in columns if "." in c)
        more = f" (nested: {', '.join(nested[:20])})" if nested else ""
        raise _FileError("columns", f"unknown column layout: columns {shown}{more}; known schemas: {known}; "
                                    "map the fields explicitly (dataset.fields / --field prompt=PATH --field answer=PATH)")
    return schema


# --------------------------------------------------------------------------- loading


def _answer_key(answer: str) -> str:
    return "".join(answer.split())


class _Loader:
    """One :func:`load_problem_set` call: the problems so far, the dedupe and id indexes, the
    report and the errors. ``load_file`` reads one file; ``add`` decides about one extracted row."""

    def __init__(self, mapping: FieldMapping | None, on_bad_row: OnBadRow, dedupe: bool):
        self.mapping, self.on_bad_row, self.dedupe = mapping, on_bad_row, dedupe
        self.report = ProblemSetReport(dedupe=dedupe)
        self.problems: list[Problem] = []
        self.errors: list[RowError] = []
        self.n_errors = 0
        self.by_key: dict[str, tuple[int, str, int]] = {}  # normalised problem -> (index in problems, file, row)
        self.by_id: dict[str, tuple[str, int, str]] = {}  # problem id -> (file, row, normalised problem)
        self.content_repeats: Counter[str] = Counter()

    def error(self, err: RowError) -> None:
        self.n_errors += 1
        if len(self.errors) < ProblemSetError.MAX_KEPT:
            self.errors.append(err)

    def bad(self, file: FileReport, line: int, fld: str, reason: str) -> None:
        """A bad row: an error, or (``on_bad_row="skip"``) skipped and counted."""
        err = RowError(file.path, line, fld, reason)
        if self.on_bad_row != "skip":
            self.error(err)
            return
        file.skipped += 1
        if len(self.report.skipped_rows) < self.report.MAX_WARNINGS:
            self.report.skipped_rows.append(err)

    def load_file(self, path: Path) -> None:
        file = FileReport(str(path))
        self.report.files.append(file)
        try:
            if not path.is_file():
                raise _FileError("file", "file not found")
            columns, open_rows = _columns_and_rows(path)
            schema = _choose_schema(columns, self.mapping)
            file.schema = schema.name
            for line, row in open_rows(schema):
                file.rows += 1
                if isinstance(row, _BadRow):
                    self.bad(file, line, row.field, row.reason)
                elif not isinstance(row, Mapping):
                    self.bad(file, line, "row", f"not a JSON object (a {type(row).__name__})")
                else:
                    try:
                        self.add(file, line, schema, schema.extract(row))
                    except FieldError as exc:
                        self.bad(file, line, exc.field, exc.reason)
            if file.rows == 0:
                raise _FileError("file", "no rows")
        except _FileError as exc:
            self.error(RowError(file.path, 0, exc.field, exc.reason))

    def add(self, file: FileReport, line: int, schema: RowSchema, ex: Extracted) -> None:
        """Keep an extracted row, or count it as a duplicate, or refuse its id."""
        key = normalise_problem(ex.prompt)
        if self.dedupe and key in self.by_key:
            self.duplicate(file, line, key, ex.answer)
            return
        pid = ex.problem_id
        if pid is None:
            pid = content_id(ex.prompt, ex.answer)
            self.content_repeats[pid] += 1
            if self.content_repeats[pid] > 1:  # the same row again, kept because dedupe is off
                pid = f"{pid}-{self.content_repeats[pid]}"
        if pid in self.by_id:
            first_file, first_line, first_key = self.by_id[pid]
            what = "another problem" if first_key != key else "the same problem (dedupe is off)"
            self.bad(file, line, schema.id_field or "id", f"duplicate id {pid!r}: {what} has it at {first_file}:{first_line}")
            return
        self.by_id[pid] = (file.path, line, key)
        self.by_key.setdefault(key, (len(self.problems), file.path, line))
        self.problems.append(Problem(problem_id=pid, prompt=ex.prompt, answer=ex.answer))
        file.problems += 1

    def duplicate(self, file: FileReport, line: int, key: str, answer: str) -> None:
        index, first_file, first_line = self.by_key[key]
        file.duplicates += 1
        kept = self.problems[index].answer
        if _answer_key(kept) != _answer_key(answer):
            self.report.conflicting_answers += 1
            if len(self.report.warnings) < self.report.MAX_WARNINGS:
                self.report.warnings.append(f"{file.path}:{line}: the problem of {first_file}:{first_line} with another "
                                            f"answer ({answer!r}; kept {kept!r})")


def load_problem_set(
    paths: str | Path | Iterable[str | Path],
    *,
    fields: FieldMapping | Mapping[str, str | None] | Iterable[str] | None = None,
    on_bad_row: OnBadRow = "error",
    dedupe: bool = True,
) -> ProblemSet:
    """Load, validate and de-duplicate one or more problem-set files (see the module docstring).

    ``fields``: an explicit field mapping (``{"prompt": ..., "answer": ..., "id": ...}`` dotted
    paths, or ``["prompt=a.b", ...]``) used for every file instead of schema detection.
    """
    if on_bad_row not in ("error", "skip"):
        raise ValueError(f"on_bad_row must be 'error' or 'skip', got {on_bad_row!r}")
    if isinstance(paths, (str, Path)):
        paths = [paths]
    loader = _Loader(FieldMapping.parse(fields) if fields else None, on_bad_row, dedupe)
    for p in paths:
        loader.load_file(Path(p))
    if loader.n_errors:
        raise ProblemSetError(loader.errors, loader.n_errors)
    loader.report.answer_kinds = dict(Counter(answer_kind(p.answer) for p in loader.problems).most_common())
    return ProblemSet(loader.problems, loader.report)


def load_problems(paths: str | Path | Iterable[str | Path], **options: Any) -> list[Problem]:
    """The problems of :func:`load_problem_set` (same options), without the report."""
    return load_problem_set(paths, **options).problems


def write_jsonl(problems: Iterable[Problem], path: str | Path) -> Path:
    """Write problems as the project's own JSONL rows (``id``, ``prompt``, ``answer``: what
    ``load_problems`` reads back)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as fh:
        for p in problems:
            fh.write(json.dumps(p.to_row(), ensure_ascii=False) + "\n")
    return out
