"""HTTP request/response bodies of the tool executor (shared by the app and the client)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

StatusName = Literal["ok", "error", "timeout", "memory", "output_limit", "rejected"]


class ExecuteRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    code: str = Field(description="Python source run as __main__")
    stdin: str = Field("", description="text fed to the call's standard input")
    timeout_s: float | None = Field(None, gt=0, description="wall-clock limit (default and maximum: service settings)")
    memory_mb: int | None = Field(None, gt=0, description="address space the call may add (default and maximum: service settings)")
    session_id: str | None = Field(None, min_length=1, max_length=200, description="run after the earlier ok cells of this session")


class BatchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    items: list[ExecuteRequest] = Field(min_length=1)


class ExecutionResult(BaseModel):
    status: StatusName
    stdout: str = ""
    stderr: str = ""
    truncated: bool = False
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    exit_code: int | None = None
    signal: int | None = None
    duration_ms: float = 0.0
    queue_ms: float = 0.0
    kind: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"


class BatchResult(BaseModel):
    results: list[ExecutionResult]
