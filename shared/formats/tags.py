"""The tags every conversation format shares (a contract: rollout writes them, reward reads
answers out of them, RoC counts them). Hermes-style tool calls, as in Qwen2.5/3's templates and
the rStar2-Agent release::

    ...reasoning...<tool_call>{"name": "python", "arguments": {"code": "print(2**10)"}}</tool_call>
    <tool_response>\\n1024\\n</tool_response>
    ...reasoning...<answer>The answer is \\boxed{1024}</answer>

Whether a tag is a single token depends on the vocabulary (``</tool_call>`` is one in Qwen's,
none of them are in Llama-3's); nothing here assumes it. The answer tags are plain text.
"""

from __future__ import annotations

import re

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
TOOL_RESPONSE_START = "<tool_response>"
TOOL_RESPONSE_END = "</tool_response>"
ANSWER_START = "<answer>"
ANSWER_END = "</answer>"

# Tool output longer than this is cut, keeping its head and tail (errors sit at the end).
DEFAULT_TOOL_RESPONSE_CHARS = 1024

_ANSWER_TAG = re.compile(re.escape(ANSWER_START))


def count_answer_tags(text: str) -> int:
    return len(_ANSWER_TAG.findall(text))


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
    """stdout, then stderr on a new line; nothing stripped, so a printed value keeps its newline.
    The plain presets show exactly this; real executions and the SFT traces both compose it here."""
    if stderr:
        return f"{stdout}\n{stderr}" if stdout else stderr
    return stdout
