"""Prompt presets: what the policy is told (system prompt, the user turn around the problem, the
tool it may call) and how a tool's result is shown to it. Chosen by name in the run config
(``format: {preset: ...}``); the model's own chat template does the rendering
(:mod:`shared.formats.hermes`).

``rstar2``
    The rStar2-Agent prompt (paper, Fig. 3; the public release's data and tool service): a system
    prompt asking for ``<reason>...</reason>`` then one ``<answer>...</answer>``, the python tool's
    JSON schema as the template's tools block (``execute_python_code_with_standard_io`` with
    ``code`` and ``input``), a user turn that asks for ``<answer>`` and ``\\boxed{}``, and tool
    results as ``Tool call success\\nstdout: ...\\nstderr: ...`` or ``Tool call failure\\nreason:
    ...``. Deviation: the release also appends ``execution time: 0.12s``; we leave it out, since
    a timing the model reads makes identical programs produce different contexts.
``boxed``
    A plain tool-use prompt: the same tool block with a one-argument ``python`` tool, the problem
    followed by "put your final answer within \\boxed{}" (the instruction Qwen's math models and
    most verl recipes use), tool results shown as the raw stdout/stderr. No answer tags: the
    answer is the last ``\\boxed{}``.
``compact``
    The embedded default's tiny model: a one-sentence system prompt naming the tags (every prompt
    token costs a tiny model training compute), no tools block, raw tool output, ``<answer>``
    tags. Its chat template renders the tool response inside the assistant message.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import AfterValidator

from shared.formats.tags import tool_output_text

# Execution statuses of services/tool_executor (plus the parser's), as the tool result records them.
ResultStatus = Literal["ok", "error", "timeout", "memory", "output_limit", "parse_error"]


@dataclass(frozen=True)
class ToolResult:
    """What one tool call came to, before any preset turns it into text."""

    status: ResultStatus
    stdout: str = ""
    stderr: str = ""
    detail: str = ""  # parse_error: the parser's message; timeout: the limit ("10 s")

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def python_tool_schema(name: str, *, with_input: bool) -> dict[str, Any]:
    """The OpenAI-style function schema of the python tool (what ``tools=`` of a chat template takes)."""
    props: dict[str, Any] = {"code": {"type": "string", "description": (
        "A string containing Python code to be executed. The code can read from standard input using the "
        "input() function." if with_input else "Python source; print what you need to see.")}}
    required = ["code"]
    if with_input:
        props["input"] = {"type": "string",
                          "description": "A string that will be provided as standard input to the code when it calls input()."}
        required.append("input")
    description = ("Execute Python code with standard input and capture standard output. This function takes a Python "
                   "code string and an input string, provides the input string through standard input (stdin) to the "
                   "code, and captures and returns any output produced through standard output (stdout). If the "
                   "executed code raises an exception, the error message will be captured and returned instead."
                   if with_input else "Run Python code and return what it printed (stdout, then stderr).")
    return {"type": "function", "function": {"name": name, "description": description,
                                             "parameters": {"type": "object", "properties": props, "required": required}}}


def _plain_result(r: ToolResult) -> str:
    """The raw output, with one line saying what went wrong when the run did not finish normally."""
    if r.status == "parse_error":
        return f"ToolCallError: {r.detail}"
    text = tool_output_text(r.stdout, r.stderr)
    line = {
        "timeout": f"TimeoutError: the code exceeded the time limit{' of ' + r.detail if r.detail else ''}",
        "memory": "MemoryError: the code exceeded the memory limit",
        "output_limit": "OutputLimitError: the code printed more than the output limit",
    }.get(r.status)
    if line is None:
        return text
    return f"{text}\n{line}" if text else line


# The release's code-judge reasons, in words a model can act on.
_RSTAR2_REASONS = {
    "error": "runtime error",
    "timeout": "timeout",
    "memory": "memory limit exceeded",
    "output_limit": "output limit exceeded",
}


def _rstar2_result(r: ToolResult) -> str:
    """``Tool call success`` / ``Tool call failure`` blocks as the rStar2-Agent release writes them."""
    if r.status == "parse_error":
        return f"Tool call failure\nreason: {r.detail}"
    lines = ["Tool call success"] if r.ok else ["Tool call failure", f"reason: {_RSTAR2_REASONS.get(r.status, r.status)}"
                                                + (f" ({r.detail})" if r.status == "timeout" and r.detail else "")]
    if r.stdout:
        lines.append(f"stdout: {r.stdout}")
    if r.stderr:
        lines.append(f"stderr: {r.stderr}")
    return "\n".join(lines)


@dataclass(frozen=True)
class PromptPreset:
    name: str
    system: str | None
    user: str  # ``{problem}`` is replaced by the problem text
    tool_name: str
    tool_schema: dict[str, Any] | None = field(default=None, compare=False)  # None: no tools block
    answer_tags: bool = True  # the answer is asked for inside <answer>...</answer>
    result_style: Literal["plain", "rstar2"] = "plain"

    @property
    def tool_takes_input(self) -> bool:
        """Whether the tool's schema requires ``input`` (the release's tool does): calls then carry it."""
        params = (self.tool_schema or {}).get("function", {}).get("parameters", {})
        return "input" in params.get("required", [])

    def user_text(self, problem: str) -> str:
        return self.user.replace("{problem}", problem)

    def tool_result_text(self, result: ToolResult) -> str:
        return _rstar2_result(result) if self.result_style == "rstar2" else _plain_result(result)


RSTAR2_TOOL = "execute_python_code_with_standard_io"

PRESETS: dict[str, PromptPreset] = {
    "rstar2": PromptPreset(
        name="rstar2",
        system=("A conversation between User and Assistant. The user asks a question, and the Assistant solves it. "
                "The Assistant first thinks about the reasoning process in the mind and then provides the user with "
                "the answer. The reasoning process and answer are enclosed within <reason> </reason> and <answer> "
                "</answer> tags, respectively, i.e., <reason> reasoning process here </reason><answer> answer here "
                "</answer>."),
        user=("You must put your answer inside <answer> </answer> tags, i.e., <answer> answer here </answer>. And "
              "your final answer will be extracted automatically by the \\boxed{} tag.\nThis is the problem:\n{problem}"),
        tool_name=RSTAR2_TOOL,
        tool_schema=python_tool_schema(RSTAR2_TOOL, with_input=True),
        answer_tags=True,
        result_style="rstar2",
    ),
    "boxed": PromptPreset(
        name="boxed",
        system="You are a helpful assistant. You can run Python code with the python tool to compute and check results.",
        user="{problem}\n\nPlease reason step by step, and put your final answer within \\boxed{}.",
        tool_name="python",
        tool_schema=python_tool_schema("python", with_input=False),
        answer_tags=False,
    ),
    # Short on purpose: for the tiny model of the embedded default the system prompt was two
    # thirds of each trace's tokens.
    "compact": PromptPreset(
        name="compact",
        system=('Solve the problem. Run Python with <tool_call>{"name": "python", "arguments": {"code": "..."}}'
                "</tool_call> and read its output in <tool_response>...</tool_response>. Finish with "
                "<answer>...\\boxed{answer}...</answer>."),
        user="{problem}",
        tool_name="python",
        tool_schema=None,
        answer_tags=True,
    ),
}
DEFAULT_PRESET = "rstar2"


def get_preset(name: str) -> PromptPreset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown prompt preset {name!r}; known: {', '.join(PRESETS)}") from None


def known_preset(name: str) -> str:
    """``name`` if it is a preset, else ValueError."""
    get_preset(name)
    return name


# The type of a preset-name field in settings and run configs: validated when they load.
PresetName = Annotated[str, AfterValidator(known_preset)]
