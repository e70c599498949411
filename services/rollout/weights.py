"""Live weight updates: validate a published checkpoint, load it into every engine, track the
policy version, let tasks wait for a minimum version.

Every rollout instance reads every ``WeightVersion`` (no consumer group). The handler only
*announces* a version; one loader task loads the newest announced version, so a backlog of
versions (a restart replays the topic) loads once, not once per version.

A version is loaded only after it passed, in this order:

1. the URI is a local directory (``file://``; other schemes are reported, not loaded);
2. its content hash equals ``WeightVersion.sha256`` (``shared.checkpoint.verify_checkpoint``,
   the definition the learner writes with);
3. its safetensors headers name the same tensors with the same dtypes and shapes as the model
   the engines serve (a reload that fails half-way leaves a half-written model, so nothing
   that can fail is handed to the engines).

A version that fails is reported (log + ``rstar_rollout_weight_loads_total{outcome}``) and
the engines keep serving the previous one. Should an engine's reload still fail, the engine is
restarted from the last good checkpoint.
"""

from __future__ import annotations

import asyncio
import json
import struct
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

from prometheus_client import Counter, Gauge, Histogram

from shared.checkpoint import CheckpointError, path_from_uri, verify_checkpoint
from shared.events import WeightVersion
from shared.logging import get_logger

log = get_logger("rollout.weights")

WEIGHT_LOADS = Counter("rstar_rollout_weight_loads_total", "Weight versions handled", ["outcome"])
POLICY_VERSION = Gauge("rstar_rollout_policy_version", "Policy version the engines serve")
WEIGHT_LOAD_SECONDS = Histogram("rstar_rollout_weight_load_seconds", "Validation + reload time of a version",
                                buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))

# A safetensors header is an 8-byte little-endian length then that many bytes of JSON; real
# headers are kilobytes to a few MB. Anything larger is not a safetensors file.
_MAX_HEADER_BYTES = 100 * 1024 * 1024


class WeightRejected(ValueError):
    """The checkpoint must not be loaded (bad URI, hash mismatch, wrong tensors)."""


def tensor_index(directory: str | Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (dtype, shape) of every tensor in the directory's ``*.safetensors`` files."""
    root = path_from_uri(directory)
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise WeightRejected(f"no *.safetensors in {root}")
    index: dict[str, tuple[str, tuple[int, ...]]] = {}
    for f in files:
        with open(f, "rb") as fh:
            head = fh.read(8)
            if len(head) != 8:
                raise WeightRejected(f"{f.name}: truncated safetensors file")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER_BYTES or n > f.stat().st_size - 8:
                raise WeightRejected(f"{f.name}: not a safetensors file (header length {n})")
            try:
                header = json.loads(fh.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise WeightRejected(f"{f.name}: unreadable safetensors header: {exc}") from exc
        data_bytes = f.stat().st_size - 8 - n
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            start, end = meta["data_offsets"]
            if not 0 <= start <= end <= data_bytes:
                raise WeightRejected(f"{f.name}: tensor {name} lies outside the file")
            index[name] = (meta["dtype"], tuple(meta["shape"]))
    return index


def validate_checkpoint(wv: WeightVersion, reference: dict[str, tuple[str, tuple[int, ...]]]) -> Path:
    """Run checks 1-3 of the module docstring; return the local directory."""
    try:
        path = path_from_uri(wv.uri)
    except CheckpointError as exc:
        raise WeightRejected(str(exc)) from exc
    try:
        verify_checkpoint(path, wv.sha256)
    except CheckpointError as exc:
        raise WeightRejected(str(exc)) from exc
    index = tensor_index(path)
    if index != reference:
        missing = sorted(reference.keys() - index.keys())[:3]
        extra = sorted(index.keys() - reference.keys())[:3]
        changed = sorted(k for k in reference.keys() & index.keys() if reference[k] != index[k])[:3]
        raise WeightRejected(
            f"checkpoint tensors differ from the served model: missing {missing}, unexpected {extra}, changed {changed}"
        )
    return path


class WeightUpdater:
    """Announce → validate → load into every engine → version visible to waiting tasks.

    ``engines`` need ``load_weights(path, version)``, ``restart(path, version)`` and
    ``version``; ``reference`` is the tensor index of the served model.
    """

    def __init__(self, engines: Sequence, reference: dict[str, tuple[str, tuple[int, ...]]], version: int,
                 on_loaded: Callable[[int], Awaitable[None] | None] | None = None, *, run_id: str = "") -> None:
        self.engines = list(engines)
        self.reference = reference
        self.version = version
        # The run whose versions are served ("": any run's). The topic keeps every run's
        # versions; without the filter a rollout started for a new run loaded the newest
        # version of the previous one.
        self.serves_run = run_id
        self.run_id: str | None = run_id or None
        self.last_error: str | None = None
        # Announcements not tried yet, and those rejected, by identity (version, uri, sha256) and
        # not by number: a bogus announcement of version N (a missing checkpoint) must not hide
        # the learner's real version N.
        self._pending: dict[tuple[int, str, str], tuple[int, WeightVersion]] = {}
        self._rejected: set[tuple[int, str, str]] = set()
        self._announcements = 0
        self._wake = asyncio.Event()
        self._changed = asyncio.Condition()
        self._on_loaded = on_loaded
        POLICY_VERSION.set(version)

    @staticmethod
    def _identity(wv: WeightVersion) -> tuple[int, str, str]:
        return (wv.version, wv.uri, wv.sha256)

    def announce(self, wv: WeightVersion) -> None:
        """A version was published. Another run's, not newer than what is served, or this very
        announcement already rejected or pending: ignored."""
        if self.serves_run and wv.run_id != self.serves_run:
            WEIGHT_LOADS.labels("other_run").inc()
            return
        key = self._identity(wv)
        if wv.version <= self.version or key in self._rejected or key in self._pending:
            WEIGHT_LOADS.labels("stale").inc()
            return
        self._announcements += 1
        self._pending[key] = (self._announcements, wv)
        self._wake.set()

    def _next_candidate(self) -> WeightVersion | None:
        """The newest pending announcement newer than what is served (of one version number,
        the latest announced), taken off the pending set; older ones are forgotten."""
        self._pending = {k: (n, w) for k, (n, w) in self._pending.items() if w.version > self.version}
        if not self._pending:
            return None
        key, (_, wv) = max(self._pending.items(), key=lambda item: (item[1][1].version, item[1][0]))
        del self._pending[key]
        return wv

    async def run(self, stopping: asyncio.Event) -> None:
        """The loader: load the newest announced version whenever there is one; when it is
        rejected, the next candidate (another announcement of that number, or an older version
        still newer than the served one)."""
        while not stopping.is_set():
            waiter = asyncio.ensure_future(self._wake.wait())
            stop = asyncio.ensure_future(stopping.wait())
            await asyncio.wait({waiter, stop}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            stop.cancel()
            self._wake.clear()
            while not stopping.is_set() and (wv := self._next_candidate()) is not None:
                await self.load(wv)

    async def load(self, wv: WeightVersion) -> bool:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        try:
            path = await asyncio.to_thread(validate_checkpoint, wv, self.reference)
        except WeightRejected as exc:
            self._rejected.add(self._identity(wv))
            self.last_error = f"version {wv.version} rejected: {exc}"
            WEIGHT_LOADS.labels("rejected").inc()
            log.error("weights_rejected", version=wv.version, uri=wv.uri, error=str(exc), serving=self.version)
            return False
        previous = [(e.weights_path, e.version) for e in self.engines]
        failed = []
        for engine in self.engines:
            try:
                await engine.load_weights(path, wv.version)
            except Exception as exc:  # noqa: BLE001 - the engine is reported and restarted below
                failed.append((engine, exc))
        if failed:
            self._rejected.add(self._identity(wv))
            self.last_error = f"version {wv.version} failed to load: {failed[0][1]}"
            WEIGHT_LOADS.labels("failed").inc()
            log.error("weights_load_failed", version=wv.version, error=str(failed[0][1]))
            # Every engine goes back to the last good weights: the failed ones by a restart
            # (their model may be half-written), the others by a reload.
            for engine, (old_path, old_version) in zip(self.engines, previous):
                if any(engine is f for f, _ in failed):
                    await engine.restart(old_path, old_version)
                elif engine.version != old_version:
                    await engine.load_weights(old_path, old_version)
            return False
        self.version = wv.version
        self.run_id = wv.run_id
        self.last_error = None
        WEIGHT_LOADS.labels("loaded").inc()
        POLICY_VERSION.set(wv.version)
        WEIGHT_LOAD_SECONDS.observe(loop.time() - t0)
        log.info("weights_loaded", version=wv.version, step=wv.step, seconds=round(loop.time() - t0, 3))
        async with self._changed:
            self._changed.notify_all()
        if self._on_loaded is not None:
            res = self._on_loaded(wv.version)
            if asyncio.iscoroutine(res):
                await res
        return True

    async def wait_for(self, version: int, timeout_s: float | None) -> bool:
        """Wait until ``version`` (or newer) is served; False on timeout."""
        async def _wait() -> None:
            async with self._changed:
                await self._changed.wait_for(lambda: self.version >= version)

        if self.version >= version:
            return True
        try:
            await asyncio.wait_for(_wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False
