"""The service side of the worker pool: starts the pool parents (zygote.py), keeps them alive,
and hands each call to a free slot through a bounded queue.

- Two kinds of pool parents (policy.choose_kind): `workers` light ones and `workers` heavy
  ones, each running up to `slots_per_worker` calls at once (each slot has its own uid) and
  holding up to `prefetch_per_worker` more in its own queue, so it never waits for the next
  call to travel from here when a slot frees.
- A call takes a token (a place in a parent) from its kind's queue of free tokens. If none is free it waits,
  unless `queue_max` single calls are already waiting: then it is answered `rejected` at
  once (backpressure; HTTP 429). Batch items (admitted as a whole by the runtime) wait
  without that check — the runtime bounds them separately.
- A token is given back when the pool parent answers, not when the awaiting coroutine ends,
  so a cancelled request can never make a parent hold more calls than it has tokens.
- A pool parent that dies fails its running calls with an `error` result that says so, and is
  restarted in place (same uids; the new one kills anything left of them first).
"""

from __future__ import annotations

import asyncio
import itertools
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import marshal

from services.tool_executor import metrics, policy
from services.tool_executor.config import Settings
from services.tool_executor.zygote import FRAME_HEADER, decode_body, encode_frame
from shared.logging import get_logger

log = get_logger("tool_executor.pool")

# The only environment a pool parent (and so every call) gets: nothing of the service's own.
SANDBOX_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "PYTHONIOENCODING": "utf-8",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONHASHSEED": "0",
    # One thread per call: calls run side by side already, and threads count against RLIMIT_NPROC.
    "OPENBLAS_NUM_THREADS": "1",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "MPLBACKEND": "Agg",
    # Resolve every dynamic symbol when a library loads, in the parent: otherwise each child
    # resolves (and copies-on-write the GOT pages of) the libc functions only it calls
    # (setresuid, setpgid, setrlimit, ...), measured at ~4% of a child's CPU.
    "LD_BIND_NOW": "1",
}


# How long a pool parent may take to clean up and exit when the service stops.
CLOSE_GRACE_S = 3.0


class InsecureSandbox(RuntimeError):
    """Isolation could not be set up and `insecure` was not given."""


class WorkerCrashed(RuntimeError):
    pass


@dataclass
class CallRequest:
    code: str
    stdin: str
    limits: policy.Limits
    replay: tuple[str, ...] = ()
    extra_time_s: float = 0.0


@dataclass
class Worker:
    kind: policy.Kind
    index: int
    uid_base: int
    proc: asyncio.subprocess.Process | None = None
    writer: asyncio.StreamWriter | None = None
    pending: dict[int, asyncio.Future] = field(default_factory=dict)
    hello: dict[str, Any] = field(default_factory=dict)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    reader_task: asyncio.Task | None = None


class WorkerPool:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.maxima = policy.Maxima(
            default_timeout_s=settings.default_timeout_s,
            max_timeout_s=settings.max_timeout_s,
            default_memory_mb=settings.default_memory_mb,
            max_memory_mb=settings.max_memory_mb,
            output_hard_limit_bytes=settings.output_hard_limit_bytes,
            max_open_files=settings.max_open_files,
            max_processes=settings.max_processes,
        )
        self.heavy_re = policy.heavy_pattern(settings.heavy_modules)
        self.workers: dict[policy.Kind, list[Worker]] = {k: [] for k in policy.Kind}
        self.free: dict[policy.Kind, asyncio.Queue[int]] = {}
        self.busy: dict[policy.Kind, int] = {k: 0 for k in policy.Kind}
        self.waiting: dict[policy.Kind, int] = {k: 0 for k in policy.Kind}
        self.waiting_single = 0
        self._ids = itertools.count(1)
        self._closing = False
        self.secure = False
        self.isolation: dict[str, Any] = {}
        # Calls the pool takes at once (both kinds), running or held by a parent.
        self.capacity = 2 * settings.workers * (settings.slots_per_worker + settings.prefetch_per_worker)

    # -- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        s = self.settings
        for kind_no, kind in enumerate(policy.Kind):
            self.free[kind] = asyncio.Queue()
            for i in range(s.workers):
                uid_base = s.effective_uid_base + (kind_no * s.workers + i) * s.slots_per_worker
                self.workers[kind].append(Worker(kind=kind, index=i, uid_base=uid_base))
            # Each parent takes `slots_per_worker` running calls plus `prefetch_per_worker`
            # held in its own queue, to start the moment a slot frees.
            for _ in range(s.slots_per_worker + s.prefetch_per_worker):
                for i in range(s.workers):
                    self.free[kind].put_nowait(i)
            metrics.TOTAL_SLOTS.labels(kind.value).set(s.workers * s.slots_per_worker)
        await asyncio.gather(*(self._spawn(w) for ws in self.workers.values() for w in ws))
        reports = [w.hello["isolation"] for ws in self.workers.values() for w in ws]
        self.secure = all(r.get("secure") for r in reports)
        self.isolation = reports[0]
        if not self.secure:
            problems = sorted({e for r in reports for e in r.get("errors", [])} | ({"not root: calls cannot get their own uid"} if not all(r.get("uid_drop") for r in reports) else set()))
            if not s.insecure:
                log.error("sandbox_not_isolated_refusing_to_start", problems=problems)
                await self.close()
                raise InsecureSandbox(
                    "the sandbox cannot be isolated here (" + "; ".join(problems or ["unknown"]) + "); "
                    "set RSTAR_TOOL_EXECUTOR_INSECURE=true to serve anyway without isolation"
                )
            log.warning("sandbox_insecure", problems=problems)
        log.info(
            "pool_started",
            workers=s.workers,
            slots_per_worker=s.slots_per_worker,
            secure=self.secure,
            preload_ms={w.kind.value: w.hello.get("preload_ms") for ws in self.workers.values() for w in ws[:1]},
        )

    def _zygote_config(self, worker: Worker, ctrl_fd: int) -> dict[str, Any]:
        s = self.settings
        heavy = worker.kind is policy.Kind.HEAVY
        return {
            "kind": worker.kind.value,
            "slots": s.slots_per_worker,
            "uid_base": worker.uid_base,
            "maxima": self.maxima.__dict__,
            "max_output_chars": s.max_output_chars,
            "preload": s.heavy_preload if heavy else s.light_preload,
            "warmup": s.heavy_warmup if heavy else "",
            "hidden_paths": s.hidden_paths,
            "tmpfs_mb": s.tmpfs_mb,
            "ctrl_fd": ctrl_fd,
        }

    async def _spawn(self, worker: Worker) -> None:
        parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            cfg = marshal.dumps(self._zygote_config(worker, child_sock.fileno())).hex()
            worker.proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "services.tool_executor.zygote",
                worker.kind.value,  # for ps; the configuration follows
                cfg,
                pass_fds=(child_sock.fileno(),),
                env=SANDBOX_ENV,
                cwd="/",
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
            )
        finally:
            child_sock.close()
        reader, worker.writer = await asyncio.open_unix_connection(sock=parent_sock, limit=64 * 1024 * 1024)
        try:
            worker.hello = await asyncio.wait_for(self._read_frame(reader), self.settings.worker_start_timeout_s)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError) as exc:
            worker.proc.kill()
            raise RuntimeError(f"{worker.kind.value} pool parent {worker.index} did not start: {exc!r}") from exc
        worker.reader_task = asyncio.create_task(self._read_loop(worker, reader), name=f"zygote-{worker.kind.value}-{worker.index}")
        worker.ready.set()

    @staticmethod
    async def _read_frame(reader: asyncio.StreamReader) -> dict[str, Any]:
        header = await reader.readexactly(FRAME_HEADER)
        return decode_body(await reader.readexactly(int.from_bytes(header, "big")))

    async def _read_loop(self, worker: Worker, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                msg = await self._read_frame(reader)
                fut = worker.pending.pop(msg["id"], None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        # The pool parent is gone.
        worker.ready.clear()
        for fut in worker.pending.values():
            if not fut.done():
                fut.set_exception(WorkerCrashed(f"{worker.kind.value} pool parent {worker.index} died"))
        worker.pending.clear()
        if worker.writer is not None:
            worker.writer.close()
        if self._closing:
            return
        rc = await worker.proc.wait() if worker.proc else None
        metrics.WORKER_RESTARTS.labels(worker.kind.value).inc()
        log.error("pool_parent_died", kind=worker.kind.value, index=worker.index, returncode=rc)
        while not self._closing:
            try:
                await self._spawn(worker)
                return
            except Exception as exc:  # noqa: BLE001 - keep trying; calls wait on worker.ready
                log.error("pool_parent_restart_failed", kind=worker.kind.value, index=worker.index, error=repr(exc))
                await asyncio.sleep(1.0)

    async def close(self) -> None:
        """Closing a parent's socket makes it kill every process of its uids and exit; a
        parent that has not exited after `CLOSE_GRACE_S` is killed."""
        self._closing = True
        workers = [w for ws in self.workers.values() for w in ws]
        for w in workers:
            if w.writer is not None:
                w.writer.close()
        for w in workers:
            if w.proc is not None:
                try:
                    await asyncio.wait_for(w.proc.wait(), CLOSE_GRACE_S)
                except asyncio.TimeoutError:
                    w.proc.kill()
                    await w.proc.wait()
            if w.reader_task is not None:
                w.reader_task.cancel()

    # -- calls ---------------------------------------------------------------------------
    def kind_for(self, request: CallRequest) -> policy.Kind:
        text = request.code if not request.replay else "\n".join((*request.replay, request.code))
        return policy.choose_kind(text, self.heavy_re)

    def would_reject(self) -> bool:
        return self.waiting_single >= self.settings.queue_max

    async def execute(self, request: CallRequest, *, enqueued_at: float | None = None, admitted: bool = False) -> dict[str, Any]:
        """Run one call; returns the result dict (see runtime.ExecutionResult).
        `admitted`: a batch item, which waits without the single-call queue bound."""
        kind = self.kind_for(request)
        t0 = enqueued_at if enqueued_at is not None else time.monotonic()
        free = self.free[kind]
        if free.empty() or self.waiting[kind]:  # FIFO: never overtake a waiting call
            if not admitted and self.waiting_single >= self.settings.queue_max:
                return rejected_result("queue full", queue_ms=(time.monotonic() - t0) * 1000)
            self.waiting[kind] += 1
            self.waiting_single += 0 if admitted else 1
            metrics.QUEUE_DEPTH.labels(kind.value).set(self.waiting[kind])
            try:
                index = await free.get()
            finally:
                self.waiting[kind] -= 1
                self.waiting_single -= 0 if admitted else 1
                metrics.QUEUE_DEPTH.labels(kind.value).set(self.waiting[kind])
        else:
            index = free.get_nowait()
        queue_ms = (time.monotonic() - t0) * 1000
        worker = self.workers[kind][index]
        self.busy[kind] += 1
        metrics.BUSY_SLOTS.labels(kind.value).set(self.busy[kind])

        def release(_: Any = None) -> None:
            self.busy[kind] -= 1
            metrics.BUSY_SLOTS.labels(kind.value).set(self.busy[kind])
            free.put_nowait(index)

        try:
            if not worker.ready.is_set():
                await worker.ready.wait()
            call_id = next(self._ids)
            fut: asyncio.Future = asyncio.get_running_loop().create_future()
            fut.add_done_callback(release)
            worker.pending[call_id] = fut
            frame = encode_frame(
                {
                    "id": call_id,
                    "code": request.code,
                    "stdin": request.stdin,
                    "timeout_s": request.limits.timeout_s,
                    "memory_mb": request.limits.memory_mb,
                    "replay": list(request.replay),
                    "extra_time_s": request.extra_time_s,
                }
            )
            worker.writer.write(frame)
        except BaseException:
            release()
            raise
        try:
            result = await asyncio.shield(fut)
        except WorkerCrashed as exc:
            result = error_result(f"the sandbox's pool parent died during the call ({exc}); the call may be retried")
        result.pop("id", None)
        queue_ms += result.pop("waited_ms", 0.0)  # time held in the parent's own queue
        result["queue_ms"] = round(queue_ms, 3)
        result["kind"] = kind.value
        metrics.QUEUE_SECONDS.labels(kind.value).observe(queue_ms / 1000)
        metrics.CALL_SECONDS.labels(kind.value).observe(result["duration_ms"] / 1000)
        metrics.CALLS.labels(result["status"], kind.value).inc()
        return result

    def snapshot(self) -> dict[str, Any]:
        return {
            "busy": {k.value: v for k, v in self.busy.items()},
            "waiting": {k.value: v for k, v in self.waiting.items()},
            "slots": {k.value: len(ws) * self.settings.slots_per_worker for k, ws in self.workers.items()},
            "alive": {k.value: sum(1 for w in ws if w.ready.is_set()) for k, ws in self.workers.items()},
        }

    def all_alive(self) -> bool:
        return all(w.ready.is_set() and w.proc is not None and w.proc.returncode is None for ws in self.workers.values() for w in ws)


def _empty_result(status: str, stderr: str, queue_ms: float = 0.0) -> dict[str, Any]:
    return {
        "status": status,
        "stdout": "",
        "stderr": stderr,
        "stdout_truncated": False,
        "stderr_truncated": False,
        "exit_code": None,
        "signal": None,
        "duration_ms": 0.0,
        "queue_ms": round(queue_ms, 3),
    }


def rejected_result(why: str, queue_ms: float = 0.0) -> dict[str, Any]:
    return _empty_result(policy.Status.REJECTED.value, f"rejected: {why}; retry later or on another replica", queue_ms)


def error_result(why: str) -> dict[str, Any]:
    return _empty_result(policy.Status.ERROR.value, why)
