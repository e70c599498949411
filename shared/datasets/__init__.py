"""Datasets: the problem record, problem-set files (DAPO / rStar / AIME / the project's own),
generated problems, and the SFT traces written from generated problems.

Pure data code (file reading only): every service and tool that needs problems imports them
from here, so the run controller holds no dataset logic.
"""

from shared.datasets.files import ProblemSetError, RowError, load_problems, parse_integer_answer, write_jsonl
from shared.datasets.generated import generate_problems, make_splits, problem_stream
from shared.datasets.problem import Problem

__all__ = [
    "Problem", "ProblemSetError", "RowError", "generate_problems", "load_problems", "make_splits",
    "parse_integer_answer", "problem_stream", "write_jsonl",
]
