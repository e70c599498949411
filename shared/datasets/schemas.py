"""Row schemas of problem-set files: which columns hold the problem, the answer and the id.

A file's schema is chosen from its columns — the dotted paths of its fields, nested structs
included (``reward_model.ground_truth``) — by :func:`detect_schema`: the first schema of
:data:`SCHEMAS` whose required columns are all present wins. The order (most specific first):

=================  ===========================================  ==================================
name               required columns                             id column (optional)
=================  ===========================================  ==================================
``rstar``          ``extra_info.question``, ``extra_info.answer``  ``extra_info.index``
``verl``           ``prompt``, ``reward_model.ground_truth``    ``extra_info.index``
``aime``           ``Problem``, ``Answer``                      ``ID``
``problem-answer`` ``problem``, ``answer``                      ``id``, else ``unique_id``
``question-answer`` ``question``, ``answer``                    ``id``
``project``        ``prompt``, ``answer``                       ``id``
=================  ===========================================  ==================================

* ``rstar`` — rStar2-Agent's preprocessed parquet (verl's ``recipe/rstar2_agent``): the clean
  problem and answer in ``extra_info``.
* ``verl`` — verl's RL parquet, e.g. DAPO-Math-17k: ``prompt`` is a chat-message list (its last
  ``user`` message is taken) or a string, the answer is ``reward_model.ground_truth``.
* ``aime`` — AIME 2024 (``ID``, ``Problem``, ``Solution``, ``Answer``).
* ``problem-answer`` / ``question-answer`` — AIME 2025 variants and MATH-500-like sets.
* ``project`` — this project's own rows (``write_jsonl``): ``prompt`` string or message list.

Every schema strips the known answer instructions from the problem
(:func:`shared.datasets.prompts.strip_instructions`). ``extra_info.index`` is taken as the id
as it is when it is a string (DAPO's uuids); an integer index (a row number, which repeats
across datasets) becomes ``<data_source>:<index>``.

Anything else: an explicit :class:`FieldMapping` (``prompt``, ``answer`` and optionally ``id``
as dotted paths; a path may step into a list with an integer, ``prompt.0.content``), which
replaces detection for every file it is given for.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence, Set
from typing import Any, NamedTuple

from shared.datasets.answers import clean_answer
from shared.datasets.prompts import strip_instructions

# --------------------------------------------------------------------------- errors


class FieldError(ValueError):
    """A row's field is missing or unusable: ``field`` is its dotted path, ``reason`` why."""

    def __init__(self, field: str, reason: str):
        self.field = field
        self.reason = reason
        super().__init__(f"{field}: {reason}")


# --------------------------------------------------------------------------- fields

_MISSING = object()


def get_path(row: Any, path: str) -> Any:
    """The value at a dotted path (``a.b``, ``prompt.0.content``), or None where it is absent."""
    value = row
    for part in path.split("."):
        if isinstance(value, Mapping):
            value = value.get(part, _MISSING)
        elif isinstance(value, Sequence) and not isinstance(value, str) and part.lstrip("-").isdigit():
            i = int(part)
            value = value[i] if -len(value) <= i < len(value) else _MISSING
        else:
            value = _MISSING
        if value is _MISSING or value is None:
            return None
    return value


def problem_text(value: Any, field: str) -> str:
    """The bare problem of a prompt field: a string, or a chat-message list whose last ``user``
    message is taken; known answer instructions stripped."""
    if value is None:
        raise FieldError(field, "missing")
    if isinstance(value, (list, tuple)):
        users = [m.get("content") for m in value if isinstance(m, Mapping) and m.get("role") == "user"]
        if not users:
            raise FieldError(field, "a message list without a user message")
        value = users[-1]
        if not isinstance(value, str):
            raise FieldError(field, f"the last user message's content is a {type(value).__name__}, not a string")
    elif not isinstance(value, str):
        raise FieldError(field, f"a {type(value).__name__}, not a string or a list of chat messages")
    if not value.strip():
        raise FieldError(field, "empty")
    text = strip_instructions(value)
    if not text:
        raise FieldError(field, "only an answer instruction, no problem text")
    return text


def answer_text(value: Any, field: str) -> str:
    try:
        return clean_answer(value)
    except ValueError as exc:
        raise FieldError(field, str(exc)) from None


def id_text(value: Any, field: str) -> str | None:
    """A dataset's id as a string; None when absent."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise FieldError(field, f"a boolean ({value!r}), not an id")
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))  # an integer column with nulls, as pandas writes it
    if isinstance(value, str):
        if not value.strip():
            raise FieldError(field, "empty")
        return value.strip()
    raise FieldError(field, f"a {type(value).__name__}, not a string or an integer")


def content_id(prompt: str, answer: str) -> str:
    """The id of a row without one: ``p-`` and 16 hex digits of sha256(prompt, answer)."""
    return "p-" + hashlib.sha256(f"{prompt}\0{answer}".encode()).hexdigest()[:16]


# --------------------------------------------------------------------------- schemas


class Extracted(NamedTuple):
    """What a schema takes from a row: ``(id or None, bare problem, cleaned answer)``."""

    problem_id: str | None
    prompt: str
    answer: str


class RowSchema:
    """A row layout: ``matches(columns)`` from the file's dotted column paths, ``extract(row)``
    the (id or None, bare problem, cleaned answer), raising :class:`FieldError`."""

    name: str = ""
    description: str = ""
    required: tuple[str, ...] = ()  # dotted column paths that must all be present
    reads: tuple[str, ...] = ()  # every dotted path extract() may read (for column pruning)
    id_field: str | None = None  # the path reported for id problems

    def matches(self, columns: Set[str]) -> bool:
        return all(c in columns for c in self.required)

    def top_level_columns(self) -> set[str]:
        return {p.split(".", 1)[0] for p in self.reads}

    def extract(self, row: Mapping[str, Any]) -> Extracted:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<schema {self.name}>"


def _verl_id(row: Mapping[str, Any]) -> str | None:
    index = get_path(row, "extra_info.index")
    pid = id_text(index, "extra_info.index")
    if pid is not None and not isinstance(index, str):
        source = get_path(row, "data_source")
        if isinstance(source, str) and source.strip():
            return f"{source.strip()}:{pid}"
    return pid


class _VerlLayout(RowSchema):
    """verl's parquet layout: the problem and the answer at nested paths, the id from
    ``extra_info.index`` (made unique per ``data_source``, see :func:`_verl_id`)."""

    problem_path = ""
    answer_path = ""
    id_field = "extra_info.index"

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        cls.required = (cls.problem_path, cls.answer_path)
        cls.reads = (cls.problem_path, cls.answer_path, "extra_info.index", "data_source")

    def extract(self, row):
        prompt = problem_text(get_path(row, self.problem_path), self.problem_path)
        answer = answer_text(get_path(row, self.answer_path), self.answer_path)
        return Extracted(_verl_id(row), prompt, answer)


class RStarSchema(_VerlLayout):
    name = "rstar"
    description = "rStar2-Agent preprocessed parquet: extra_info.question / extra_info.answer"
    problem_path, answer_path = "extra_info.question", "extra_info.answer"


class VerlSchema(_VerlLayout):
    name = "verl"
    description = "verl RL parquet (DAPO-Math-17k, ...): prompt messages / reward_model.ground_truth"
    problem_path, answer_path = "prompt", "reward_model.ground_truth"


class _Columns(RowSchema):
    """A flat layout: one problem column, one answer column, id columns tried in order."""

    problem_col = ""
    answer_col = ""
    id_cols: tuple[str, ...] = ()

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        cls.required = (cls.problem_col, cls.answer_col)
        cls.reads = (cls.problem_col, cls.answer_col, *cls.id_cols)
        cls.id_field = cls.id_cols[0] if cls.id_cols else None

    def extract(self, row):
        prompt = problem_text(row.get(self.problem_col), self.problem_col)
        answer = answer_text(row.get(self.answer_col), self.answer_col)
        pid = None
        for col in self.id_cols:
            pid = id_text(row.get(col), col)
            if pid is not None:
                break
        return Extracted(pid, prompt, answer)


class AimeSchema(_Columns):
    name = "aime"
    description = "AIME 2024 style: ID / Problem / Answer"
    problem_col, answer_col, id_cols = "Problem", "Answer", ("ID",)


class ProblemAnswerSchema(_Columns):
    name = "problem-answer"
    description = "problem / answer (+ id or unique_id): AIME 2025, MATH-500"
    problem_col, answer_col, id_cols = "problem", "answer", ("id", "unique_id")


class QuestionAnswerSchema(_Columns):
    name = "question-answer"
    description = "question / answer (+ id): AIME 2025 (opencompass)"
    problem_col, answer_col, id_cols = "question", "answer", ("id",)


class ProjectSchema(_Columns):
    name = "project"
    description = "this project's own rows: id / prompt / answer"
    problem_col, answer_col, id_cols = "prompt", "answer", ("id",)


# Detection order: the first match wins (most specific first; see the module docstring).
SCHEMAS: tuple[RowSchema, ...] = (
    RStarSchema(), VerlSchema(), AimeSchema(), ProblemAnswerSchema(), QuestionAnswerSchema(), ProjectSchema(),
)


def schema_named(name: str) -> RowSchema:
    for s in SCHEMAS:
        if s.name == name:
            return s
    raise KeyError(f"unknown schema {name!r} (known: {', '.join(s.name for s in SCHEMAS)})")


def detect_schema(columns: Set[str]) -> RowSchema | None:
    """The first schema of :data:`SCHEMAS` whose required columns are all in ``columns``."""
    for schema in SCHEMAS:
        if schema.matches(columns):
            return schema
    return None


class FieldMapping(RowSchema):
    """An explicit layout: dotted paths of the prompt, the answer and (optionally) the id."""

    def __init__(self, prompt: str, answer: str, id: str | None = None):  # noqa: A002 - the config key
        for key, path in (("prompt", prompt), ("answer", answer), ("id", id)):
            if path is None and key == "id":
                continue
            if not isinstance(path, str) or not path.strip() or any(not p for p in path.split(".")):
                raise ValueError(f"field mapping: {key} must be a dotted path like 'a.b', got {path!r}")
        self.prompt, self.answer, self.id = prompt.strip(), answer.strip(), id.strip() if id else None
        self.reads = tuple(p for p in (self.prompt, self.answer, self.id) if p)
        self.required = self.reads
        self.id_field = self.id
        self.name = "fields(" + ", ".join(f"{k}={v}" for k, v in self.as_dict().items()) + ")"
        self.description = "explicit field mapping"

    @classmethod
    def parse(cls, value: "FieldMapping | Mapping[str, str | None] | Iterable[str]") -> "FieldMapping":
        """From a mapping ``{prompt: ..., answer: ..., id: ...}`` or ``["prompt=a.b", ...]``."""
        if isinstance(value, FieldMapping):
            return value
        if not isinstance(value, Mapping):
            pairs: dict[str, str] = {}
            for item in value:
                key, sep, path = str(item).partition("=")
                if not sep:
                    raise ValueError(f"field mapping: {item!r} is not KEY=PATH (KEY: prompt, answer or id)")
                pairs[key.strip()] = path.strip()
            value = pairs
        unknown = sorted(set(value) - {"prompt", "answer", "id"})
        if unknown:
            raise ValueError(f"field mapping: unknown key(s) {', '.join(unknown)} (prompt, answer, id)")
        missing = [k for k in ("prompt", "answer") if not value.get(k)]
        if missing:
            raise ValueError(f"field mapping: {' and '.join(missing)} must be given")
        return cls(value["prompt"], value["answer"], value.get("id"))

    def matches(self, columns: Set[str]) -> bool:
        return all(p.split(".", 1)[0] in columns for p in self.reads)

    def missing_columns(self, columns: Set[str]) -> list[str]:
        return [p for p in self.reads if p.split(".", 1)[0] not in columns]

    def as_dict(self) -> dict[str, str]:
        return {k: v for k, v in (("prompt", self.prompt), ("answer", self.answer), ("id", self.id)) if v}

    def extract(self, row):
        prompt = problem_text(get_path(row, self.prompt), self.prompt)
        answer = answer_text(get_path(row, self.answer), self.answer)
        pid = id_text(get_path(row, self.id), self.id) if self.id else None
        return Extracted(pid, prompt, answer)
