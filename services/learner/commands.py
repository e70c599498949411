"""What rank 0 of a multi-device learner tells the other ranks to do.

Rank 0 runs the service (Kafka, PostgreSQL, HTTP) and the engine; every other rank holds only
its shard of the model and the optimizer, and must enter every collective rank 0 enters. So each
engine operation that touches the model is a *command*: rank 0 broadcasts it
(:class:`CommandDispatcher`), then every rank — rank 0 included — executes the same command with
the same code (:class:`RankWorker`). The other ranks do nothing else (:func:`follow`). On one
device there is nobody to tell and the dispatcher just executes.

The commands, in the order a training step sends them:

* :class:`ResetOptimizer` — curriculum stage 3: drop the AdamW moments, restart the warm-up;
* :class:`Train` — one GRPO step on all of the step's sequences; each rank trains on its share
  (:func:`~services.learner.distributed.split_for_ranks`, deterministic, so every rank computes
  the same split);
* :class:`GatherCheckpoint` — gather the full weights and optimizer state on rank 0, which then
  writes the checkpoint alone;
* :class:`Ping` — nothing: sent while rank 0 is idle so that no rank waits for a command longer
  than the process group's timeout (that timeout is how a rank notices that rank 0 died);
* :class:`Stop` — leave the follower loop (rank 0 is shutting down).

Errors: a non-finite gradient norm is global (all-reduced), so every rank raises the same
``FloatingPointError`` on the same step; rank 0 gives the batch up and the others carry on.
Any other error on a follower ends its process; the collective rank 0 is in then fails (or
times out) and rank 0 stops too — the restart resumes from the last checkpoint.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, Union

from services.learner.packing import TrainSequence

if TYPE_CHECKING:
    import torch

    from services.learner.distributed import DataParallel
    from services.learner.trainer import PolicyTrainer, StepResult


@dataclass(frozen=True)
class ResetOptimizer:
    pass


@dataclass(frozen=True)
class Train:
    sequences: list[TrainSequence]


@dataclass(frozen=True)
class GatherCheckpoint:
    pass


@dataclass(frozen=True)
class Ping:
    pass


@dataclass(frozen=True)
class Stop:
    pass


Command = Union[ResetOptimizer, Train, GatherCheckpoint, Ping, Stop]
COMMANDS = (ResetOptimizer, Train, GatherCheckpoint, Ping, Stop)


@dataclass
class CheckpointParts:
    """What :class:`GatherCheckpoint` returns on rank 0 (empty elsewhere)."""

    trainer_state: dict[str, Any]
    weights: dict[str, "torch.Tensor"] | None = None  # None: the (unsharded) model's own state dict


class Worker(Protocol):
    def execute(self, command: Command) -> Any: ...


class RankWorker:
    """Executes a command on this rank: the one place where commands meet the trainer."""

    def __init__(self, trainer: "PolicyTrainer", dp: "DataParallel | None" = None):
        self.trainer = trainer
        self.dp = dp

    def execute(self, command: Command) -> "StepResult | CheckpointParts | None":
        if isinstance(command, ResetOptimizer):
            self.trainer.reset_optimizer()
            return None
        if isinstance(command, Train):
            return self.trainer.train_step(self._my_share(command.sequences))
        if isinstance(command, GatherCheckpoint):
            weights = self.dp.full_state_dict(self.trainer.model) if self.dp is not None else None
            return CheckpointParts(trainer_state=self.trainer.state_dict(), weights=weights)
        if isinstance(command, (Ping, Stop)):
            return None
        raise TypeError(f"unknown learner command {command!r}")

    def _my_share(self, sequences: list[TrainSequence]) -> list[TrainSequence]:
        if self.dp is None:
            return sequences
        from services.learner.distributed import split_for_ranks

        return split_for_ranks(sequences, self.dp.world_size)[self.dp.rank]


@dataclass
class CommandDispatcher:
    """Rank 0's side (or the only device's): send the command to the other ranks, then execute it.

    ``send`` is None on one device. A lock keeps commands whole and in order: rank 0 sends them
    from more than one thread (the step's worker thread, the keep-alive thread), and the ranks'
    collectives must happen in the same order everywhere.
    """

    worker: Worker
    send: Callable[[Command], None] | None = None
    clock: Callable[[], float] = time.monotonic
    last_sent: float = field(init=False)
    stopped: bool = field(init=False, default=False)
    _lock: threading.Lock = field(init=False, default_factory=threading.Lock)
    _closing: threading.Event = field(init=False, default_factory=threading.Event)
    _keep_alive: threading.Thread | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.last_sent = self.clock()

    @property
    def has_followers(self) -> bool:
        return self.send is not None

    def __call__(self, command: Command) -> Any:
        with self._lock:
            return self._dispatch(command)

    def _dispatch(self, command: Command) -> Any:
        if self.stopped:
            raise RuntimeError(f"{type(command).__name__} after Stop: the other ranks have left")
        if self.send is not None:
            self.send(command)
            self.last_sent = self.clock()
        if isinstance(command, Stop):
            self.stopped = True
        return self.worker.execute(command)

    def ping_if_idle(self, idle_s: float) -> bool:
        """Send a :class:`Ping` when no command went out for ``idle_s``; True if one was sent."""
        with self._lock:
            if self.send is None or self.stopped or self.clock() - self.last_sent < idle_s:
                return False
            self._dispatch(Ping())
            return True

    def keep_alive(self, idle_s: float) -> threading.Thread | None:
        """Ping the other ranks from a background thread whenever no command went out for
        ``idle_s`` (rank 0 may wait for scored groups, or write a checkpoint, for far longer than
        the process group's timeout). Ends with :meth:`stop_followers`."""
        if self.send is None:
            return None

        def loop() -> None:
            while not self._closing.wait(idle_s / 2):
                self.ping_if_idle(idle_s)

        self._keep_alive = threading.Thread(target=loop, name="learner-keep-alive", daemon=True)
        self._keep_alive.start()
        return self._keep_alive

    def stop_followers(self) -> None:
        """Send :class:`Stop` once (later calls do nothing); no command may follow it."""
        self._closing.set()
        if self._keep_alive is not None and self._keep_alive is not threading.current_thread():
            # joined, not left to die with the interpreter: a daemon thread ended inside a
            # collective's C++ code aborts the process
            self._keep_alive.join()
        with self._lock:
            if self.send is not None and not self.stopped:
                self._dispatch(Stop())


def follow(receive: Callable[[], Command], worker: Worker) -> int:
    """A follower rank's whole life after loading: execute rank 0's commands until :class:`Stop`.

    Returns how many commands it executed (Stop excluded).
    """
    executed = 0
    while True:
        command = receive()
        if isinstance(command, Stop):
            return executed
        if not isinstance(command, COMMANDS):
            raise TypeError(f"rank 0 sent {command!r}, which is not a learner command")
        try:
            worker.execute(command)
        except FloatingPointError:
            pass  # the global gradient norm was not finite: rank 0 gives this batch up as well
        executed += 1
