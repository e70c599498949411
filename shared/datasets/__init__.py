"""Datasets: the problem record, problem-set files (verl/DAPO, rStar, AIME, the project's own,
or any layout through an explicit field mapping), generated problems, and the SFT traces
written from generated problems.

Pure data code (file reading only): every service and tool that needs problems imports them
from here, so the run controller holds no dataset logic. ``rstar data inspect FILE`` shows
what a file loads as (:mod:`shared.datasets.cli`).
"""

from shared.datasets.answers import ANSWER_KINDS, answer_kind, canonical_integer, clean_answer, parse_integer_answer
from shared.datasets.files import (
    FileReport,
    ProblemSet,
    ProblemSetError,
    ProblemSetReport,
    RowError,
    load_problem_set,
    load_problems,
    write_jsonl,
)
from shared.datasets.generated import generate_problems, make_splits, problem_stream
from shared.datasets.problem import Problem
from shared.datasets.prompts import INSTRUCTION_PHRASES, normalise_problem, strip_instructions
from shared.datasets.schemas import SCHEMAS, FieldError, FieldMapping, RowSchema, detect_schema

__all__ = [
    "ANSWER_KINDS", "FieldError", "FieldMapping", "FileReport", "INSTRUCTION_PHRASES", "Problem", "ProblemSet",
    "ProblemSetError", "ProblemSetReport", "RowError", "RowSchema", "SCHEMAS", "answer_kind", "canonical_integer",
    "clean_answer", "detect_schema", "generate_problems", "load_problem_set", "load_problems", "make_splits",
    "normalise_problem", "parse_integer_answer", "problem_stream", "strip_instructions", "write_jsonl",
]
