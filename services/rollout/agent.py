"""The multi-turn tool-use agent loop of one trajectory, as a state machine (pure: no I/O).

Algorithm
---------
A trajectory is the model's response built turn by turn in a conversation format
(``shared.formats``: the model's chat template, the preset's wording, Hermes tool calls)::

    state GENERATE --(generation ends on </tool_call>: a stop token or stop string)--> parse
        the call in this turn's text
        well-formed  -> state TOOL: the caller runs the code, ``on_tool_result`` appends the
                        tool segment as the template renders a tool message (loss_mask 0) -> GENERATE
        malformed    -> a ``parse_error`` tool record; the parser's message is appended as the
                        tool response (the model sees why) -> GENERATE; never an exception
    GENERATE --(ends on an end id: EOS, end-of-turn, generation_config's eos)--> DONE: finish
        ``answer`` if the response holds an answer (``<answer>``, or ``\\boxed`` in a preset
        without answer tags), else ``eos``
    GENERATE --(ends without a stop token: the token budget / context is used up)--> DONE
        ``max_tokens``
    after the ``max_turns``-th generation, a tool call is not run -> DONE ``max_turns``
    a tool executor that cannot be reached (or refuses after retries) -> DONE
        ``tool_failure`` (an infrastructure failure, not the model's: the trajectory is still
        published, marked, with the failed call recorded as ``error``)

Budgets: ``max_tokens`` bounds the whole response (model + tool tokens: both occupy KV and
context); each generation asks for at most the budget left and at most what still fits in
``max_model_len``. A tool response that would overflow the budget ends the trajectory
(``max_tokens``) instead of being cut mid-block.

Per response token the loop keeps: the id, loss_mask (1 model / 0 tool), the behaviour logprob
(0.0 for tool tokens) and the policy version that produced it (tool tokens inherit the version
of the model token before them).

``run_agent`` drives one loop with two async callables (generate a turn, run a tool); the
engine, the tool-executor client and the scheduler stay outside, so the unit tests drive the
same state machine with a scripted fake generator.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from shared.formats import ConversationFormat, ToolResult
from shared.formats.tags import TOOL_CALL_START
from shared.events import FinishReason, ToolCallRecord, ToolStatus, Trajectory


@dataclass(frozen=True)
class AgentConfig:
    max_tokens: int  # response budget: model + tool tokens, all turns
    max_turns: int
    max_model_len: int


@dataclass(frozen=True)
class GenerateRequest:
    """Continue ``token_ids`` (prompt + response so far) by at most ``max_new_tokens``."""

    token_ids: list[int]
    max_new_tokens: int
    turn: int


@dataclass(frozen=True)
class Generation:
    """One turn's sampled tokens, their logprobs and the policy version of each."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]

    def __post_init__(self) -> None:
        if not (len(self.token_ids) == len(self.logprobs) == len(self.versions)):
            raise ValueError(
                f"generation arrays differ in length: {len(self.token_ids)} ids, "
                f"{len(self.logprobs)} logprobs, {len(self.versions)} versions"
            )


@dataclass(frozen=True)
class ToolRequest:
    code: str
    stdin: str = ""


@dataclass(frozen=True)
class ToolOutcome:
    """What a tool call came to. ``fatal``: the executor could not run it at all (``reason`` says
    why); otherwise ``result`` is what the format shows the model."""

    result: ToolResult
    duration_ms: float
    fatal: bool = False
    reason: str = ""

    @property
    def status(self) -> ToolStatus:
        """The trajectory record's status: a memory or output limit is an ``error`` of the code."""
        s = self.result.status
        return "error" if self.fatal or s in ("memory", "output_limit") else s  # type: ignore[return-value]


class State(enum.Enum):
    GENERATE = "generate"
    TOOL = "tool"
    DONE = "done"


def outcome_from_execution(status: str, stdout: str, stderr: str, duration_ms: float,
                           timeout_s: float | None = None) -> ToolOutcome:
    """Map a tool-executor result (``ExecutionResult`` fields) to a tool outcome."""
    if status in ("ok", "error", "memory", "output_limit"):
        return ToolOutcome(ToolResult(status, stdout, stderr), duration_ms)  # type: ignore[arg-type]
    if status == "timeout":
        return ToolOutcome(ToolResult("timeout", stdout, stderr, f"{timeout_s:g} s" if timeout_s else ""), duration_ms)
    # "rejected" after the client's retries, or anything unknown: the service did not run it.
    return ToolOutcome(ToolResult("error"), duration_ms, fatal=True,
                       reason=f"tool executor did not run the code (status {status})")


def unavailable_outcome(reason: str, duration_ms: float) -> ToolOutcome:
    return ToolOutcome(ToolResult("error"), duration_ms, fatal=True, reason=f"tool executor unavailable: {reason}")


@dataclass
class AgentLoop:
    traj_id: str
    prompt_token_ids: list[int]
    config: AgentConfig
    fmt: ConversationFormat

    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    tool_calls: list[ToolCallRecord] = field(default_factory=list)
    turns: int = 0
    state: State = State.GENERATE
    finish_reason: FinishReason | None = None
    _pending: ToolRequest | None = None
    _turn_start: int = 0

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("empty prompt")
        if len(self.prompt_token_ids) >= self.config.max_model_len:
            raise ValueError(
                f"prompt of {len(self.prompt_token_ids)} tokens does not fit max_model_len {self.config.max_model_len}"
            )

    # ------------------------------------------------------------------ driving

    @property
    def done(self) -> bool:
        return self.state is State.DONE

    @property
    def kv_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.response_ids)

    def _room(self) -> int:
        return min(self.config.max_tokens - len(self.response_ids), self.config.max_model_len - self.kv_tokens)

    def next_action(self) -> GenerateRequest | ToolRequest | None:
        """What to do next: generate, run a tool, or nothing (``None``: the loop is done)."""
        if self.state is State.DONE:
            return None
        if self.state is State.TOOL:
            assert self._pending is not None
            return self._pending
        room = self._room()
        if room <= 0:
            self._finish("max_tokens")
            return None
        return GenerateRequest(self.prompt_token_ids + self.response_ids, room, self.turns + 1)

    def on_generation(self, gen: Generation) -> None:
        if self.state is not State.GENERATE:
            raise RuntimeError(f"on_generation in state {self.state.value}")
        room = self._room()
        if len(gen.token_ids) > room:
            raise ValueError(f"generation of {len(gen.token_ids)} tokens exceeds the {room} tokens asked for")
        self.turns += 1
        self._turn_start = len(self.response_ids)
        self.response_ids.extend(gen.token_ids)
        self.loss_mask.extend([1] * len(gen.token_ids))
        self.logprobs.extend(gen.logprobs)
        self.versions.extend(gen.versions)
        end = self.fmt.classify(gen.token_ids)
        if end == "end":
            self._finish("answer" if self.fmt.has_answer(self.fmt.decode(self.response_ids)) else "eos")
        elif end == "tool_call":
            self._on_tool_call()
        else:
            # No stop token: the generation ran out of room (budget or context).
            self._finish("max_tokens")

    def _on_tool_call(self) -> None:
        turn_text = self.fmt.decode(self.response_ids[self._turn_start :])
        parsed = self.fmt.parse_tool_call(turn_text)
        if self.turns >= self.config.max_turns:
            self._finish("max_turns")
            return
        if parsed.ok:
            assert parsed.code is not None
            self._pending = ToolRequest(parsed.code, parsed.stdin or "")
            self.state = State.TOOL
            return
        start = turn_text.rfind(TOOL_CALL_START)
        raw = turn_text[start:] if start >= 0 else turn_text
        body = self.fmt.tool_result_body(ToolResult("parse_error", detail=parsed.error or ""))
        self._record(raw, "parse_error", 0.0, body)
        self._append_tool_response(body)

    def on_tool_result(self, outcome: ToolOutcome) -> None:
        if self.state is not State.TOOL or self._pending is None:
            raise RuntimeError(f"on_tool_result in state {self.state.value}")
        code, self._pending = self._pending.code, None
        self.state = State.GENERATE
        if outcome.fatal:
            self._record(code, outcome.status, outcome.duration_ms, outcome.reason)
            self._finish("tool_failure")
            return
        body = self.fmt.tool_result_body(outcome.result)
        self._record(code, outcome.status, outcome.duration_ms, body)
        self._append_tool_response(body)

    def _record(self, code: str, status: ToolStatus, duration_ms: float, output: str) -> None:
        self.tool_calls.append(ToolCallRecord(code=code, status=status, duration_ms=max(0.0, duration_ms), output=output))

    def _append_tool_response(self, body: str) -> None:
        """Append the tool segment around ``body`` (the preset's text of the result, already cut)."""
        ids = self.fmt.tool_response_ids(body)
        if len(ids) > self._room():
            self._finish("max_tokens")
            return
        version = self.versions[-1] if self.versions else 0
        self.response_ids.extend(ids)
        self.loss_mask.extend([0] * len(ids))
        self.logprobs.extend([0.0] * len(ids))
        self.versions.extend([version] * len(ids))

    def _finish(self, reason: FinishReason) -> None:
        self.state = State.DONE
        self.finish_reason = reason

    # ------------------------------------------------------------------ result

    def trajectory(self) -> Trajectory:
        if self.finish_reason is None:
            raise RuntimeError(f"trajectory {self.traj_id} is not finished")
        return Trajectory(
            traj_id=self.traj_id,
            prompt_token_ids=list(self.prompt_token_ids),
            response_token_ids=list(self.response_ids),
            loss_mask=list(self.loss_mask),
            logprobs=list(self.logprobs),
            token_versions=list(self.versions),
            turns=self.turns,
            tool_calls=list(self.tool_calls),
            finish_reason=self.finish_reason,
            response_text=self.fmt.decode(self.response_ids),
        )


GenerateFn = Callable[[GenerateRequest], Awaitable[Generation]]
ToolFn = Callable[[ToolRequest], Awaitable[ToolOutcome]]


async def run_agent(loop: AgentLoop, generate: GenerateFn, run_tool: ToolFn,
                    on_turn: Callable[[AgentLoop], None] | None = None) -> Trajectory:
    """Drive ``loop`` to the end: generate turns, run tools, return the trajectory.

    ``on_turn`` is called after every generation and tool response (the runtime reports the
    rollout's KV length to the scheduler there).
    """
    while (action := loop.next_action()) is not None:
        if isinstance(action, GenerateRequest):
            loop.on_generation(await generate(action))
        else:
            loop.on_tool_result(await run_tool(action))
        if on_turn is not None:
            on_turn(loop)
    return loop.trajectory()
