"""Event contracts: the payloads that cross a service boundary, inside a versioned envelope.

Every Kafka message value is the JSON of an :class:`Envelope`::

    {"type": "TrajectoryGroup", "schema_version": 1, "event_id": "...", "run_id": "...",
     "created_at": "...", "payload": {...}}

``decode`` rejects an unknown ``type`` or ``schema_version`` with :class:`EventDecodeError`
(which consumers route to the dead-letter topic). Large numeric arrays use the compact
packing of :mod:`shared.codec`.
"""

from __future__ import annotations

import uuid
from datetime import datetime, timezone
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from shared.codec import ByteArray, Float32Array, Int32Array

SCHEMA_VERSION = 1


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


def new_id() -> str:
    return uuid.uuid4().hex


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False)


# --------------------------------------------------------------------------- rollout tasks


class SamplingParams(_Model):
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_tokens: int = Field(8192, gt=0, description="token budget of the whole response, all turns")
    max_turns: int = Field(10, gt=0)


TaskPurpose = Literal["train", "probe"]


class RolloutTask(_Model):
    task_id: str
    run_id: str
    stage: int = Field(ge=0)
    problem_id: str
    prompt: str
    answer: str = Field(description="ground truth, passed through for scoring and replay")
    n_samples: int = Field(gt=0, description="2G: rollouts per problem")
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    min_policy_version: int = Field(0, ge=0)
    deadline: datetime
    attempt: int = Field(1, ge=1, description="1 on first dispatch, +1 on each re-dispatch")
    prompt_preset: str | None = Field(None, description="the run's conversation preset (shared/formats/presets.py); "
                                                         "None: the rollout's own setting")
    purpose: TaskPurpose = Field("train", description="train: scored, down-sampled and trained on; probe: the "
                                                      "current policy's pass rate on the problem (stage-3 entry), "
                                                      "recorded and never trained on")


# --------------------------------------------------------------------------- trajectories

ToolStatus = Literal["ok", "error", "timeout", "parse_error"]
FinishReason = Literal["answer", "max_tokens", "max_turns", "tool_failure", "eos"]


class ToolCallRecord(_Model):
    code: str
    status: ToolStatus
    duration_ms: float = Field(ge=0)
    output: str = Field("", description="the (truncated) tool response text the model saw")


class Trajectory(_Model):
    traj_id: str
    prompt_token_ids: Int32Array
    response_token_ids: Int32Array
    loss_mask: ByteArray = Field(description="per response token: 1 = model token, 0 = tool output")
    logprobs: Float32Array = Field(description="behaviour logprob per response token (0 where loss_mask is 0)")
    token_versions: Int32Array = Field(description="policy version that produced each response token")
    turns: int = Field(ge=0)
    tool_calls: list[ToolCallRecord] = Field(default_factory=list)
    finish_reason: FinishReason
    response_text: str

    @model_validator(mode="after")
    def _aligned(self) -> "Trajectory":
        n = len(self.response_token_ids)
        for name in ("loss_mask", "logprobs", "token_versions"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries, response has {n} tokens")
        return self


class TrajectoryGroup(_Model):
    group_id: str = Field(description="= task_id; the idempotency key downstream")
    run_id: str
    stage: int = Field(ge=0)
    problem_id: str
    answer: str
    trajectories: list[Trajectory] = Field(min_length=1)
    attempt: int = Field(1, ge=1)
    rollout_instance: str = ""
    purpose: TaskPurpose = Field("train", description="the task's purpose, passed through (RolloutTask.purpose)")

    @property
    def policy_version_range(self) -> tuple[int, int]:
        versions = [v for t in self.trajectories for v in t.token_versions]
        return (min(versions), max(versions)) if versions else (0, 0)


# --------------------------------------------------------------------------- scored groups


class ScoredTrajectory(_Model):
    trajectory: Trajectory
    reward: float
    advantage: float
    correct: bool
    p_err: float
    p_format: float


class RocStats(_Model):
    """Tool-error rate and format penalty of the positives RoC kept vs the ones it dropped."""

    kept_pos_tool_error_rate: float | None = None
    dropped_pos_tool_error_rate: float | None = None
    kept_pos_format_penalty: float | None = None
    dropped_pos_format_penalty: float | None = None
    n_pos: int = 0
    n_neg: int = 0
    n_kept_pos: int = 0
    n_kept_neg: int = 0
    n_tool_failure: int = Field(0, ge=0, description="rollouts left out: they ended tool_failure (infrastructure)")


class ScoredGroup(_Model):
    group_id: str
    run_id: str
    stage: int = Field(ge=0)
    problem_id: str
    min_policy_version: int
    max_policy_version: int
    pass_rate: float = Field(ge=0.0, le=1.0, description="over the n_total rollouts, before down-sampling")
    n_total: int = Field(description="rollouts that count: all 2G but those that ended tool_failure")
    roc_mode: str
    all_equal: bool = Field(description="all kept rewards equal: the group carries no gradient")
    selected: list[ScoredTrajectory]
    roc: RocStats = Field(default_factory=RocStats)


# --------------------------------------------------------------------------- weights


class WeightVersion(_Model):
    run_id: str
    version: int = Field(ge=0, description="monotonic per run")
    step: int = Field(ge=0)
    stage: int = Field(ge=0)
    uri: str = Field(description="file:// directory with safetensors + config, written atomically (or s3://)")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    created_at: datetime = Field(default_factory=utcnow)


# --------------------------------------------------------------------------- envelope

EVENT_TYPES: dict[str, type[BaseModel]] = {
    cls.__name__: cls for cls in (RolloutTask, TrajectoryGroup, ScoredGroup, WeightVersion)
}
SUPPORTED_SCHEMA_VERSIONS = {SCHEMA_VERSION}


class EventDecodeError(ValueError):
    """A message that cannot become an event: it belongs in the dead-letter topic."""


class Envelope(_Model):
    type: str
    schema_version: int
    event_id: str
    run_id: str
    created_at: datetime
    payload: Any

    def event(self) -> BaseModel:
        return self.payload


def wrap(event: BaseModel, *, run_id: str | None = None, event_id: str | None = None) -> Envelope:
    name = type(event).__name__
    if name not in EVENT_TYPES:
        raise TypeError(f"{name} is not a registered event type")
    return Envelope(
        type=name,
        schema_version=SCHEMA_VERSION,
        event_id=event_id or new_id(),
        run_id=run_id if run_id is not None else getattr(event, "run_id", ""),
        created_at=utcnow(),
        payload=event,
    )


def encode(event: BaseModel | Envelope, **kw: Any) -> bytes:
    """Event (or envelope) → JSON bytes, compact arrays packed."""
    env = event if isinstance(event, Envelope) else wrap(event, **kw)
    payload = env.payload.model_dump(mode="json")
    head = env.model_dump(mode="json", exclude={"payload"})
    return orjson.dumps({**head, "payload": payload})


def decode(raw: bytes | str, expect: type[BaseModel] | None = None) -> Envelope:
    """JSON bytes → Envelope whose ``payload`` is the validated event model.

    Raises :class:`EventDecodeError` with a reason for anything that is not a valid event of a
    known type and schema version (or not of ``expect``, when given).
    """
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise EventDecodeError(f"not JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise EventDecodeError("envelope must be a JSON object")
    version = data.get("schema_version")
    if version not in SUPPORTED_SCHEMA_VERSIONS:
        raise EventDecodeError(
            f"unsupported schema_version {version!r} (this build reads {sorted(SUPPORTED_SCHEMA_VERSIONS)})"
        )
    type_name = data.get("type")
    cls = EVENT_TYPES.get(type_name) if isinstance(type_name, str) else None
    if cls is None:
        raise EventDecodeError(f"unknown event type {type_name!r}")
    if expect is not None and cls is not expect:
        raise EventDecodeError(f"expected a {expect.__name__}, got {type_name}")
    try:
        payload = cls.model_validate(data.get("payload"))
        return Envelope.model_validate({**data, "payload": payload})
    except ValidationError as exc:
        raise EventDecodeError(f"invalid {type_name}: {exc}") from exc
