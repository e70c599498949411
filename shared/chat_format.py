"""The conversation format the policy reads and writes (a contract: rollout renders and parses
it, the SFT trace generator writes it, reward reads answers out of it).

A prompt is rendered in a ChatML layout; the whole multi-turn trajectory is ONE assistant
message in which tool calls and tool responses alternate (Hermes-style tags)::

    <|im_start|>system\\n{SYSTEM_PROMPT}<|im_end|>\\n<|im_start|>user\\n{problem}<|im_end|>\\n<|im_start|>assistant\\n
    ...reasoning...<tool_call>{"name": "python", "arguments": {"code": "print(2**10)"}}</tool_call>
    <tool_response>\\n1024\\n</tool_response>\\n
    ...reasoning...<answer>The answer is \\boxed{1024}</answer><|im_end|>

Generation stops at ``</tool_call>`` (a single token, like in Qwen2.5's vocabulary), the rollout
runs the code, appends the ``<tool_response>`` block (loss_mask 0) and generates on. The model
ends its message with ``<|im_end|>`` (the end-of-sequence token).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
TOOL_RESPONSE_START = "<tool_response>"
TOOL_RESPONSE_END = "</tool_response>"
ANSWER_START = "<answer>"
ANSWER_END = "</answer>"

# Single tokens in every tokenizer the pipeline uses (checked by `require_special_tokens`).
SPECIAL_TOKENS: tuple[str, ...] = (
    IM_START,
    IM_END,
    TOOL_CALL_START,
    TOOL_CALL_END,
    TOOL_RESPONSE_START,
    TOOL_RESPONSE_END,
    ANSWER_START,
    ANSWER_END,
)
# Tokens at which generation pauses (tool call) or ends (end of message).
STOP_TOKENS: tuple[str, ...] = (TOOL_CALL_END, IM_END)

TOOL_NAME = "python"

# Short on purpose: every prompt token costs generation, training and SFT compute, and for the
# tiny model of the embedded default the system prompt was two thirds of each trace's tokens.
SYSTEM_PROMPT = (
    'Solve the problem. Run Python with <tool_call>{"name": "python", "arguments": {"code": "..."}}'
    "</tool_call> and read its output in <tool_response>...</tool_response>. Finish with "
    "<answer>...\\boxed{answer}...</answer>."
)

# Tool output longer than this is cut, keeping its head and tail (errors sit at the end).
DEFAULT_TOOL_RESPONSE_CHARS = 1024


def render_prompt(problem: str, system: str | None = SYSTEM_PROMPT) -> str:
    """The prompt text, up to and including the assistant header the model continues from
    (``system=None``: no system turn)."""
    head = f"{IM_START}system\n{system}{IM_END}\n" if system is not None else ""
    return head + f"{IM_START}user\n{problem}{IM_END}\n{IM_START}assistant\n"


def format_tool_call(code: str) -> str:
    payload = json.dumps({"name": TOOL_NAME, "arguments": {"code": code}}, ensure_ascii=False)
    return f"{TOOL_CALL_START}{payload}{TOOL_CALL_END}"


def truncate_middle(text: str, max_chars: int) -> tuple[str, bool]:
    """Keep the head and tail of ``text`` within ``max_chars``; say whether anything was cut."""
    if len(text) <= max_chars:
        return text, False
    marker = f"\n...[{len(text) - max_chars} characters elided]...\n"
    keep = max(0, max_chars - len(marker))
    head = keep // 2
    tail = keep - head
    return text[:head] + marker + (text[-tail:] if tail else ""), True


def tool_output_text(stdout: str, stderr: str) -> str:
    """The text inside ``<tool_response>``: stdout, then stderr on a new line; nothing stripped,
    so a printed value keeps its newline (``<tool_response>\\n42\\n\\n</tool_response>``). The
    rollout (real executions) and the SFT traces (the bootstrap) both compose it here."""
    if stderr:
        return f"{stdout}\n{stderr}" if stdout else stderr
    return stdout


def format_tool_response(output: str, max_chars: int = DEFAULT_TOOL_RESPONSE_CHARS) -> str:
    body, _ = truncate_middle(output, max_chars)
    return f"\n{TOOL_RESPONSE_START}\n{body}\n{TOOL_RESPONSE_END}\n"


def format_answer(value: str, lead: str = "The answer is ") -> str:
    return f"{ANSWER_START}{lead}\\boxed{{{value}}}{ANSWER_END}"


@dataclass(frozen=True)
class ParsedToolCall:
    """Either ``code`` (a well-formed python call) or ``error`` (why it is malformed)."""

    code: str | None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.code is not None


def parse_tool_call(text: str) -> ParsedToolCall:
    """Parse the last ``<tool_call>...`` in a turn's generated text (the end tag may be absent:
    generation stops on it and it can be excluded from the returned text)."""
    start = text.rfind(TOOL_CALL_START)
    if start < 0:
        return ParsedToolCall(None, "no <tool_call> tag")
    body = text[start + len(TOOL_CALL_START) :]
    end = body.find(TOOL_CALL_END)
    if end >= 0:
        body = body[:end]
    body = body.strip()
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as exc:
        return ParsedToolCall(None, f"tool call is not valid JSON: {exc.msg} at position {exc.pos}")
    if not isinstance(obj, dict):
        return ParsedToolCall(None, "tool call must be a JSON object")
    if obj.get("name") != TOOL_NAME:
        return ParsedToolCall(None, f"unknown tool {obj.get('name')!r}; the only tool is {TOOL_NAME!r}")
    args = obj.get("arguments")
    if isinstance(args, str):  # some models double-encode the arguments
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return ParsedToolCall(None, "tool call arguments are not valid JSON")
    if not isinstance(args, dict) or not isinstance(args.get("code"), str):
        return ParsedToolCall(None, 'tool call needs "arguments": {"code": "<python source>"}')
    return ParsedToolCall(args["code"])


_ANSWER_TAG = re.compile(re.escape(ANSWER_START))


def count_answer_tags(text: str) -> int:
    return len(_ANSWER_TAG.findall(text))


def require_special_tokens(token_to_id) -> dict[str, int]:
    """Map each special token to its id; fail loudly when a tokenizer lacks one as a single token.

    ``token_to_id`` is e.g. ``tokenizers.Tokenizer.token_to_id`` or a HF tokenizer's
    ``convert_tokens_to_ids`` (which returns the unk id for a missing token: pass a wrapper).
    """
    ids: dict[str, int] = {}
    missing = []
    for tok in SPECIAL_TOKENS:
        tid = token_to_id(tok)
        if tid is None:
            missing.append(tok)
        else:
            ids[tok] = int(tid)
    if missing:
        raise ValueError(f"tokenizer lacks single tokens for {missing}; the chat format needs them")
    return ids
