import pytest

from services.tool_executor.sessions import REPLAY_TIME_FACTOR, SessionFull, SessionStore


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def store(clock, **kw):
    base = dict(ttl_s=100, max_cells=3, max_code_chars=1000, max_sessions=2, clock=clock)
    return SessionStore(**{**base, **kw})


def test_replay_plan_holds_earlier_cells_in_order_and_extends_the_deadline():
    s = store(Clock())
    assert s.plan("a", "x = 1").cells == ()
    s.record("a", "x = 1", 100)
    s.record("a", "y = x + 1", 300)
    plan = s.plan("a", "print(y)")
    assert plan.cells == ("x = 1", "y = x + 1")
    assert plan.replayed_ms == 400
    assert plan.extra_time_s == pytest.approx(0.4 * REPLAY_TIME_FACTOR)


def test_sessions_expire_after_ttl_since_last_use():
    clock = Clock()
    s = store(clock)
    s.record("a", "x = 1", 1)
    clock.now = 90
    assert s.plan("a", "x").cells == ("x = 1",)  # use refreshes
    clock.now = 180
    assert s.plan("a", "x").cells == ("x = 1",)
    clock.now = 281
    assert s.plan("a", "x").cells == ()
    assert len(s) == 0


def test_full_session_refuses_new_cells():
    s = store(Clock(), max_cells=2)
    s.record("a", "1", 1)
    s.record("a", "2", 1)
    with pytest.raises(SessionFull, match="maximum of 2 cells"):
        s.plan("a", "3")
    s2 = store(Clock(), max_code_chars=10)
    s2.record("b", "x" * 8, 1)
    with pytest.raises(SessionFull, match="10 characters"):
        s2.plan("b", "yyy")


def test_least_recently_used_sessions_are_dropped_beyond_max_sessions():
    clock = Clock()
    s = store(clock, max_sessions=2)
    s.record("a", "1", 1)
    clock.now = 1
    s.record("b", "1", 1)
    clock.now = 2
    s.plan("a", "2")  # a is now the most recent
    s.record("c", "1", 1)
    assert s.cells("b") == [] and s.cells("a") == ["1"] and s.cells("c") == ["1"]


def test_drop():
    s = store(Clock())
    s.record("a", "1", 1)
    assert s.drop("a") and not s.drop("a")
