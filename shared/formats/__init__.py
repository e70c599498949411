"""Conversation formats: how a prompt, tool calls, tool results and answers become token ids for
one model, chosen from the model directory (its tokenizer and chat template) and a prompt
preset. ``load_format(model_dir, preset)`` is the entry point; rollout, SFT traces, evaluation and
the model-directory checks all go through it, the embedded default's tiny model included."""

from shared.formats.hermes import (
    FAMILIES,
    FormatError,
    HermesFormat,
    ParsedToolCall,
    detect_family,
    load_format,
    parse_call_object,
)
from shared.formats.model_dir import ModelDirError, ModelFiles
from shared.formats.presets import DEFAULT_PRESET, PRESETS, PromptPreset, ToolResult, get_preset

ConversationFormat = HermesFormat  # the type every caller annotates with

__all__ = [
    "ConversationFormat", "DEFAULT_PRESET", "FAMILIES", "FormatError", "HermesFormat", "ModelDirError", "ModelFiles",
    "PRESETS", "ParsedToolCall", "PromptPreset", "ToolResult", "detect_family", "get_preset", "load_format",
    "parse_call_object",
]
