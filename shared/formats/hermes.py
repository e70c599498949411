"""The Hermes conversation format (pure: no I/O once built), rendered by the model's own chat
template.

Algorithm
---------
A trajectory is the prompt the template renders (system turn, the python tool's schema in
``tools=`` where the template supports it, the user turn, the generation prompt) followed by
alternating *model segments* and *tool segments*:

* a model segment is what the engine samples. Generation pauses at the tool call's closing tag
  ``</tool_call>``: a stop token id where the vocabulary has it as one token (Qwen2.5/3), else a
  stop string (vLLM ``stop=["</tool_call>"]``) checked on the decoded text (:meth:`classify`);
  it ends at any end id: the tokenizer's EOS, the template's end-of-turn token and
  ``generation_config.json``'s eos ids (a base model's ``<|endoftext|>``);
* a tool segment is appended with loss_mask 0, exactly as the template renders a ``tool``
  message after the assistant's: the wrap is found once, at build time, by rendering a
  conversation with placeholder contents and cutting around them. For Qwen that is
  ``<|im_end|>\\n<|im_start|>user\\n<tool_response>\\n{result}\\n</tool_response><|im_end|>\\n
  <|im_start|>assistant\\n`` (the assistant turn closed, a user turn, a fresh assistant header);
  for the tiny model's template it stays inside the assistant message. A template whose tool
  wrap has no ``<tool_response>`` tags gets them around the result, so answer extraction (which
  cuts tool output out) works for every model.

The tool call is JSON in ``<tool_call>``: ``{"name": <the preset's tool>, "arguments": {"code":
..., "input": ...}}``. The answer tags are plain text. What the model is told and how tool
results read come from the preset (:mod:`shared.formats.presets`).

Why placeholders: the alternative, rendering the whole conversation again at each turn and
diffing, re-tokenises earlier turns (a token can merge across a boundary) and re-renders history
that some templates rewrite (Qwen3 strips ``<think>`` from earlier turns), so the ids would no
longer be the ones the policy sampled.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from shared.formats.model_dir import ModelDirError, ModelFiles
from shared.formats.presets import PromptPreset, ToolResult, get_preset
from shared.formats.tags import (
    ANSWER_END,
    ANSWER_START,
    DEFAULT_TOOL_RESPONSE_CHARS,
    TOOL_CALL_END,
    TOOL_CALL_START,
    TOOL_RESPONSE_END,
    TOOL_RESPONSE_START,
    truncate_middle,
)

TurnEnd = Literal["end", "tool_call", "truncated"]

# Placeholders for the template probe: text no real conversation contains.
_A = "\u2063RSTAR_ASSISTANT_CONTENT\u2063"
_T = "\u2063RSTAR_TOOL_CONTENT\u2063"
_Q = "\u2063RSTAR_USER_CONTENT\u2063"


class FormatError(ModelDirError):
    """The model's template or vocabulary cannot carry this format (the message says why)."""


@dataclass(frozen=True)
class ParsedToolCall:
    """Either ``code`` (a well-formed call; ``stdin`` its standard input, None when the call
    gives none) or ``error``."""

    code: str | None
    error: str | None = None
    stdin: str | None = None

    @property
    def ok(self) -> bool:
        return self.code is not None


def parse_call_object(obj: Any, tool_name: str) -> ParsedToolCall:
    """Validate a decoded call ``{"name": ..., "arguments": {"code": ..., "input": ...}}`` (the JSON
    inside ``<tool_call>``, or an OpenAI-style ``tool_calls[i].function``; the arguments may be a
    JSON string, as some models double-encode them)."""
    if not isinstance(obj, dict):
        return ParsedToolCall(None, "tool call must be a JSON object")
    if obj.get("name") != tool_name:
        return ParsedToolCall(None, f"unknown tool {obj.get('name')!r}; the only tool is {tool_name!r}")
    args = obj.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return ParsedToolCall(None, "tool call arguments are not valid JSON")
    if not isinstance(args, dict) or not isinstance(args.get("code"), str):
        return ParsedToolCall(None, 'tool call needs "arguments": {"code": "<python source>"}')
    stdin = args.get("input")
    if stdin is not None and not isinstance(stdin, str):
        return ParsedToolCall(None, '"input" must be a string')
    return ParsedToolCall(args["code"], stdin=stdin)


class HermesFormat:
    family = "hermes"

    def __init__(self, model: ModelFiles, preset: PromptPreset, *,
                 tool_response_max_chars: int = DEFAULT_TOOL_RESPONSE_CHARS) -> None:
        self.model = model
        self.preset = preset
        self.tool_response_max_chars = tool_response_max_chars
        self._tok = model.tokenizer
        self.tool_call_end_id: int | None = model.single_token(TOOL_CALL_END)
        self._tools = [preset.tool_schema] if preset.tool_schema is not None else None
        self._tools_inline = False
        if self._tools is not None:
            with_tools = self._render([{"role": "user", "content": _Q}], tools=self._tools, add_generation_prompt=True)
            if preset.tool_name not in with_tools:  # the template ignores tools=: describe it in the system turn
                self._tools_inline = True
        self._probe()

    def with_preset(self, preset: str | PromptPreset) -> "HermesFormat":
        """The same model's format with another preset (the tokenizer is shared, not reloaded)."""
        p = get_preset(preset) if isinstance(preset, str) else preset
        return type(self)(self.model, p, tool_response_max_chars=self.tool_response_max_chars)

    # ------------------------------------------------------------------ building

    def _render(self, messages: list[dict[str, Any]], *, tools=None, add_generation_prompt: bool) -> str:
        from transformers.utils.chat_template_utils import render_jinja_template

        try:
            rendered, _ = render_jinja_template(conversations=[messages], tools=tools,
                                                chat_template=self.model.chat_template,
                                                add_generation_prompt=add_generation_prompt,
                                                **self.model.special_tokens)
        except Exception as exc:  # noqa: BLE001 - a template can raise anything (raise_exception(...))
            raise FormatError(f"model directory {self.model.path}: the chat template fails to render "
                              f"{[m['role'] for m in messages]}: {type(exc).__name__}: {exc}") from exc
        return rendered[0]

    def _tools_block(self) -> str:
        """The tools block Qwen's template writes, for templates that ignore ``tools=``."""
        return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided "
                "with function signatures within <tools></tools> XML tags:\n<tools>\n"
                + json.dumps(self.preset.tool_schema, ensure_ascii=False)
                + "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
                  'within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, '
                  '"arguments": <args-json-object>}\n</tool_call>')

    def _system_text(self, system: str | None) -> str | None:
        """A system turn with the tools block appended when the template cannot render ``tools=``."""
        if self._tools_inline:
            return f"{system}\n\n{self._tools_block()}" if system else self._tools_block()
        return system

    @property
    def _template_tools(self) -> list[dict[str, Any]] | None:
        """What the template's ``tools=`` gets: the schema, unless it is inlined in the system turn."""
        return None if self._tools_inline else self._tools

    def _messages(self, user: str, system: str | None) -> list[dict[str, Any]]:
        head = [{"role": "system", "content": system}] if system is not None else []
        return head + [{"role": "user", "content": user}]

    def _tool_prompt(self, user: str, system: str | None) -> str:
        """The prompt of a user turn with the tool described (template tools block or inlined)."""
        return self._render(self._messages(user, self._system_text(system)), tools=self._template_tools,
                            add_generation_prompt=True)

    def _probe(self) -> None:
        """Find the tool-message wrap and the end-of-turn token from placeholder renderings."""
        where = f"model directory {self.model.path}"
        tools, head = self._template_tools, self._messages(_Q, self._system_text(self.preset.system))
        prompt = self._render(head, tools=tools, add_generation_prompt=True)
        after_tool = self._render(head + [{"role": "assistant", "content": _A}, {"role": "tool", "content": _T}],
                                  tools=tools, add_generation_prompt=True)
        closed = self._render(head + [{"role": "assistant", "content": _A}], tools=tools, add_generation_prompt=False)
        for name, text in (("a tool message", after_tool), ("an assistant message", closed)):
            if text.count(_A) != 1:
                raise FormatError(f"{where}: the chat template does not render {name} after the assistant's "
                                  "content once, as the format needs")
        if after_tool.count(_T) != 1:
            raise FormatError(f"{where}: the chat template does not render a 'tool' message's content")
        if after_tool[: after_tool.index(_A)] != prompt:
            raise FormatError(f"{where}: the chat template renders an assistant turn in history differently from "
                              "its generation prompt, so a continued trajectory would not match what was sampled")
        wrap_head = after_tool[after_tool.index(_A) + len(_A): after_tool.index(_T)]
        wrap_tail = after_tool[after_tool.index(_T) + len(_T):]
        if TOOL_RESPONSE_START not in wrap_head:
            wrap_head, wrap_tail = wrap_head + TOOL_RESPONSE_START + "\n", "\n" + TOOL_RESPONSE_END + wrap_tail
        self.tool_wrap = (wrap_head, wrap_tail)
        turn_end = closed[closed.index(_A) + len(_A):]
        ids = self._tok.encode(turn_end, add_special_tokens=False).ids
        if not ids or ids[0] not in self._tok.get_added_tokens_decoder():
            # An ordinary token (a newline, '###') would end every generation where it first occurs.
            raise FormatError(f"{where}: the chat template closes an assistant turn with {turn_end[:20]!r}, not a "
                              "special token; the format needs an end-of-turn token to stop generation on")
        self.end_of_turn_id = int(ids[0])
        self.end_of_turn_text = self._tok.decode([ids[0]], skip_special_tokens=False)
        self.end_ids = frozenset({self.end_of_turn_id} | self.model.eos_ids())
        # What the engine stops on: the closing tag (as a token where it is one, else as text) and
        # every end id.
        self.stop_token_ids = ([self.tool_call_end_id] if self.tool_call_end_id is not None else []) + sorted(self.end_ids)
        self.stop_strings = [] if self.tool_call_end_id is not None else [TOOL_CALL_END]

    # ------------------------------------------------------------------ tokens

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    # ------------------------------------------------------------------ prompt

    def prompt_text(self, problem: str, *, bare: bool = False) -> str:
        """The rendered prompt up to the generation prompt. ``bare``: only a user turn holding the
        problem as given (no system turn, no tools, no preset wording; the SFT copy drills)."""
        if bare:
            return self._render(self._messages(problem, None), tools=None, add_generation_prompt=True)
        return self._tool_prompt(self.preset.user_text(problem), self.preset.system)

    def chat_prompt_text(self, user: str, system: str | None) -> str:
        """A prompt from chat data's own messages (no preset wording), with the tool described as
        the format describes it."""
        return self._tool_prompt(user, system)

    def prompt_ids(self, problem: str, *, bare: bool = False) -> list[int]:
        return self.encode(self.prompt_text(problem, bare=bare))

    # ------------------------------------------------------------------ generation

    def classify(self, turn_ids: list[int]) -> TurnEnd:
        """How a generation ended: an end id, a tool call's closing tag, or out of room."""
        if not turn_ids:
            return "truncated"
        last = turn_ids[-1]
        if last in self.end_ids:
            return "end"
        if self.tool_call_end_id is not None:
            return "tool_call" if last == self.tool_call_end_id else "truncated"
        # Text detection: a stop string ends generation on the token that completes it, which may
        # carry a few characters past the tag; anything further back would have stopped earlier.
        # As with the stop token, a tag without its opening is still a call (the parser says why
        # it is malformed).
        return "tool_call" if TOOL_CALL_END in self.decode(turn_ids[-8:]) else "truncated"

    # ------------------------------------------------------------------ tool calls

    def tool_call_text(self, code: str, stdin: str | None = None) -> str:
        args: dict[str, Any] = {"code": code}
        if stdin is not None or self.preset.tool_takes_input:
            args["input"] = stdin or ""
        payload = json.dumps({"name": self.preset.tool_name, "arguments": args}, ensure_ascii=False)
        return f"{TOOL_CALL_START}{payload}{TOOL_CALL_END}"

    def parse_tool_call(self, text: str) -> ParsedToolCall:
        """Parse the last ``<tool_call>...`` of a turn's text (the closing tag may be absent)."""
        start = text.rfind(TOOL_CALL_START)
        if start < 0:
            return ParsedToolCall(None, "no <tool_call> tag")
        body = text[start + len(TOOL_CALL_START):]
        end = body.find(TOOL_CALL_END)
        if end >= 0:
            body = body[:end]
        try:
            obj = json.loads(body.strip())
        except json.JSONDecodeError as exc:
            return ParsedToolCall(None, f"tool call is not valid JSON: {exc.msg} at position {exc.pos}")
        return parse_call_object(obj, self.preset.tool_name)

    def tool_result_body(self, result: ToolResult) -> str:
        """The preset's text of a result, cut to ``tool_response_max_chars`` (head and tail kept)."""
        return truncate_middle(self.preset.tool_result_text(result), self.tool_response_max_chars)[0]

    def tool_response_text(self, result: ToolResult | str) -> str:
        """The tool segment as the template renders a tool message (``str``: a body given as is)."""
        body = result if isinstance(result, str) else self.tool_result_body(result)
        return self.tool_wrap[0] + body + self.tool_wrap[1]

    def tool_response_ids(self, result: ToolResult | str) -> list[int]:
        return self.encode(self.tool_response_text(result))

    # ------------------------------------------------------------------ answers

    def answer_text(self, value: str, lead: str = "The answer is ") -> str:
        """How the SFT traces write a final answer in this preset."""
        boxed = f"{lead}\\boxed{{{value}}}"
        return f"{ANSWER_START}{boxed}{ANSWER_END}" if self.preset.answer_tags else boxed + "."

    def has_answer(self, text: str) -> bool:
        return ANSWER_START in text if self.preset.answer_tags else "\\boxed" in text

    # ------------------------------------------------------------------ identity

    def describe(self) -> dict[str, Any]:
        """What ``rstar`` commands print about the format chosen for a model."""
        return {
            "family": self.family, "preset": self.preset.name, "architecture": self.model.architecture,
            "vocab_size": self.model.vocab_size,
            "tool_call_detection": "token" if self.tool_call_end_id is not None else "text",
            "tools_block": "none" if self._tools is None else ("system prompt" if self._tools_inline else "template"),
            "end_tokens": sorted(self.decode([i]) for i in self.end_ids),
            "tool_wrap": list(self.tool_wrap),
        }


# Format families by name; ``detect_family`` picks one from the model directory. Hermes tool
# calls are what Qwen2.5/3 were trained on and what the rStar2-Agent release uses; other models
# (Llama-3) learn them from the prompt and stage-0 SFT. A family with another call syntax
# registers here.
FAMILIES: dict[str, type[HermesFormat]] = {"hermes": HermesFormat}


def detect_family(model: ModelFiles) -> str:
    return "hermes"


def load_format(model_dir: str | Path, preset: str | PromptPreset = "rstar2", *, family: str | None = None,
                tool_response_max_chars: int = DEFAULT_TOOL_RESPONSE_CHARS, need_weights: bool = True) -> HermesFormat:
    """The conversation format of a model directory (raises :class:`ModelDirError` with every reason)."""
    model = ModelFiles.load(model_dir, need_weights=need_weights)
    chosen = family or detect_family(model)
    if chosen not in FAMILIES:
        raise FormatError(f"unknown format family {chosen!r}; known: {', '.join(FAMILIES)}")
    p = get_preset(preset) if isinstance(preset, str) else preset
    return FAMILIES[chosen](model, p, tool_response_max_chars=tool_response_max_chars)
