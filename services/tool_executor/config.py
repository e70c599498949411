"""Settings of the tool executor (env: RSTAR_TOOL_EXECUTOR_<FIELD>, or YAML section
`tool_executor:`). Every limit a request can ask for is bounded by a maximum here."""

from __future__ import annotations

import os
from pathlib import Path
from typing import ClassVar

from pydantic import Field, model_validator

from shared.settings import ServiceSettings, service_config

_REPO_ROOT = Path(__file__).resolve().parents[2]

# Imported by every pool parent before it forks: modules math solutions use all the time.
# Kept short on purpose: each C extension adds ~5 memory mappings to the parent, and fork and
# exit cost grows with the number of mappings (measured here: 58 mappings -> ~0.5 ms per
# fork+exit, 281 -> ~2.3 ms), so a rarely used module is cheaper imported by the few calls
# that use it (the child imports it lazily) than preloaded into every fork.
LIGHT_PRELOAD = [
    "math", "fractions", "decimal", "itertools", "functools", "collections", "random", "re",
    "string", "heapq", "bisect", "operator", "copy", "numbers", "threading", "traceback",
]
# The heavy pool parents also import these (fork from them costs more, see policy.py).
HEAVY_PRELOAD = LIGHT_PRELOAD + ["numpy", "sympy", "mpmath"]
# Code that names one of these goes to a heavy pool parent.
HEAVY_MODULES = ["numpy", "np", "sympy", "sp", "mpmath", "scipy"]
# Run once in each heavy parent so the children do not each pay sympy's lazy first-use costs.
HEAVY_WARMUP = "import sympy, numpy\nsympy.factorint(2**64 - 1)\nsympy.simplify(sympy.Symbol('x') ** 2 - 1)\nnumpy.arange(10).sum()\n"


# Automatic uid ranges: replica on port P uses UID_BASE_AUTO + (P % UID_PORT_BUCKETS) * UIDS_PER_REPLICA.
UID_BASE_AUTO = 200_000
UID_PORT_BUCKETS = 4096
UIDS_PER_REPLICA = 1000


def _default_hidden() -> list[str]:
    # The service's source tree and state (the repo; the interpreter and virtualenv stay visible
    # because they are bound back), home directories, and password hashes.
    # /run holds daemons' unix sockets (databases); the seccomp filter refuses AF_UNIX sockets
    # anyway, hiding them is the second line.
    # The repo's parent (sibling checkouts, shared docs) too; where that is /tmp itself the
    # sandbox leaves it to the calls' private /tmp (zygote.plan_hidden).
    return [str(_REPO_ROOT), str(_REPO_ROOT.parent), "/root", "/home", "/run", "/etc/shadow", "/etc/gshadow", "/var/lib/postgresql", "/var/lib/mysql"]


class Settings(ServiceSettings):
    model_config = service_config("TOOL_EXECUTOR")
    service_name: ClassVar[str] = "tool-executor"

    workers: int = Field(default_factory=lambda: os.cpu_count() or 1, ge=1, description="pool parents of each kind (light and heavy); default: number of cores")
    slots_per_worker: int = Field(4, ge=1, le=64, description="calls one pool parent runs at once (each gets its own uid)")
    prefetch_per_worker: int = Field(4, ge=0, le=64, description="calls a pool parent holds beyond its slots, to start the moment a slot frees")
    queue_max: int = Field(2048, ge=0, description="single calls that may wait for a slot; beyond this, `rejected` (429)")
    batch_backlog_max: int = Field(20000, ge=1, description="batch items (all batches together) admitted and not yet finished; a batch that does not fit is rejected whole (429)")
    max_batch_items: int = Field(2000, ge=1, description="items in one batch request (422 beyond)")
    default_timeout_s: float = Field(10.0, gt=0)
    max_timeout_s: float = Field(60.0, gt=0)
    default_memory_mb: int = Field(1024, ge=16, description="address space a call may add to its pool parent's")
    max_memory_mb: int = Field(4096, ge=16)
    max_output_chars: int = Field(16384, ge=64, description="characters kept of stdout and of stderr (middle elided)")
    output_hard_limit_bytes: int = Field(4 * 1024 * 1024, ge=1024, description="RLIMIT_FSIZE: a stream that reaches this ends the call as output_limit")
    max_open_files: int = Field(64, ge=16)
    max_processes: int = Field(32, ge=1, description="RLIMIT_NPROC per call (processes and threads of its own uid)")
    max_code_chars: int = Field(200_000, ge=1)
    max_stdin_chars: int = Field(1_000_000, ge=0)
    tmpfs_mb: int = Field(512, ge=16, description="size of each pool parent's private /tmp holding the calls' directories")
    uid_base: int = Field(
        0,
        ge=0,
        description="first uid given to calls (2 x workers x slots uids from here, none of them a real user); "
        "0: derived from the port, so replicas on one host never share uids (they kill each other's leftovers by uid)",
    )
    hidden_paths: list[str] = Field(default_factory=_default_hidden, description="covered by empty read-only mounts in the sandbox")
    light_preload: list[str] = Field(default_factory=lambda: list(LIGHT_PRELOAD))
    heavy_preload: list[str] = Field(default_factory=lambda: list(HEAVY_PRELOAD))
    heavy_modules: list[str] = Field(default_factory=lambda: list(HEAVY_MODULES))
    heavy_warmup: str = HEAVY_WARMUP
    insecure: bool = Field(False, description="serve even where namespaces/uids cannot be set up (logged, and shown in /readyz)")
    session_ttl_s: float = Field(900.0, gt=0)
    session_max_cells: int = Field(64, ge=1)
    session_max_code_chars: int = Field(200_000, ge=1)
    max_sessions: int = Field(10_000, ge=1)
    worker_start_timeout_s: float = Field(60.0, gt=0)

    @property
    def effective_uid_base(self) -> int:
        if self.uid_base:
            return self.uid_base
        return UID_BASE_AUTO + (self.http_port % UID_PORT_BUCKETS) * UIDS_PER_REPLICA

    @model_validator(mode="after")
    def _check(self) -> "Settings":
        if 2 * self.workers * self.slots_per_worker > UIDS_PER_REPLICA:
            raise ValueError(f"2 x workers x slots_per_worker must be at most {UIDS_PER_REPLICA} (uids per replica)")
        if 0 < self.uid_base < 1000:
            raise ValueError("uid_base must be 0 (automatic) or at least 1000 (above system users)")
        if self.default_timeout_s > self.max_timeout_s:
            raise ValueError("default_timeout_s exceeds max_timeout_s")
        if self.default_memory_mb > self.max_memory_mb:
            raise ValueError("default_memory_mb exceeds max_memory_mb")
        return self
