"""The multi-device command protocol without processes: what rank 0 sends, what followers do."""

import threading

import pytest

from services.learner.commands import (
    CommandDispatcher,
    GatherCheckpoint,
    Ping,
    ResetOptimizer,
    Stop,
    Train,
    follow,
)


class RecordingWorker:
    def __init__(self, fail_on=None):
        self.executed = []
        self.fail_on = fail_on

    def execute(self, command):
        self.executed.append(command)
        if self.fail_on is not None and isinstance(command, type(self.fail_on[0])):
            raise self.fail_on[1]
        return f"done {type(command).__name__}"


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_dispatcher_sends_each_command_before_executing_it_on_rank_zero():
    order = []
    worker = RecordingWorker()
    dispatch = CommandDispatcher(worker, send=lambda c: order.append(("send", c)))
    worker.execute = lambda c: order.append(("execute", c)) or "result"  # type: ignore[method-assign]
    train = Train(sequences=[])
    assert dispatch(ResetOptimizer()) == "result"
    dispatch(train)
    assert order == [("send", ResetOptimizer()), ("execute", ResetOptimizer()), ("send", train), ("execute", train)]


def test_single_device_dispatcher_only_executes():
    worker = RecordingWorker()
    dispatch = CommandDispatcher(worker)
    assert dispatch(GatherCheckpoint()) == "done GatherCheckpoint"
    assert not dispatch.has_followers
    assert dispatch.ping_if_idle(0.0) is False
    dispatch.stop_followers()  # nobody to stop
    assert worker.executed == [GatherCheckpoint()]


def test_ping_only_when_idle_and_nothing_after_stop():
    sent = []
    clock = FakeClock()
    dispatch = CommandDispatcher(RecordingWorker(), send=sent.append, clock=clock)
    clock.now = 5.0
    assert dispatch.ping_if_idle(10.0) is False
    clock.now = 10.0
    assert dispatch.ping_if_idle(10.0) is True
    assert dispatch.ping_if_idle(10.0) is False  # the ping counts as a command
    dispatch(Train(sequences=[]))
    dispatch.stop_followers()
    dispatch.stop_followers()  # once only
    clock.now = 100.0
    assert dispatch.ping_if_idle(10.0) is False
    assert sent == [Ping(), Train(sequences=[]), Stop()]
    with pytest.raises(RuntimeError, match="after Stop"):
        dispatch(Train(sequences=[]))


def test_commands_from_two_threads_are_never_interleaved():
    sent = []
    in_flight = threading.Lock()

    class SlowWorker:
        def execute(self, command):
            assert in_flight.acquire(blocking=False), "two commands executing at once"
            try:
                sent.append(("execute", command))
            finally:
                in_flight.release()

    dispatch = CommandDispatcher(SlowWorker(), send=lambda c: sent.append(("send", c)))
    threads = [threading.Thread(target=lambda: [dispatch(Ping()) for _ in range(200)]) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(sent) == 800
    assert all(a[0] == "send" and b[0] == "execute" for a, b in zip(sent[::2], sent[1::2]))


def test_follower_executes_in_order_until_stop():
    commands = iter([ResetOptimizer(), Train(sequences=[]), Ping(), GatherCheckpoint(), Stop(), Train(sequences=[])])
    worker = RecordingWorker()
    assert follow(lambda: next(commands), worker) == 4
    assert worker.executed == [ResetOptimizer(), Train(sequences=[]), Ping(), GatherCheckpoint()]
    assert next(commands) == Train(sequences=[])  # nothing read after Stop


def test_follower_survives_a_non_finite_step_like_rank_zero_but_not_other_errors():
    commands = iter([Train(sequences=[]), GatherCheckpoint(), Stop()])
    worker = RecordingWorker(fail_on=(Train(sequences=[]), FloatingPointError("non-finite gradient norm")))
    assert follow(lambda: next(commands), worker) == 2
    commands = iter([Train(sequences=[]), Stop()])
    with pytest.raises(MemoryError):
        follow(lambda: next(commands), RecordingWorker(fail_on=(Train(sequences=[]), MemoryError())))


def test_follower_rejects_what_is_not_a_command():
    commands = iter([{"train": []}])
    with pytest.raises(TypeError, match="not a learner command"):
        follow(lambda: next(commands), RecordingWorker())
