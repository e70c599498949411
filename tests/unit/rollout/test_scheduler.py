"""The cache-aware scheduler against a simulated engine: capacity is never exceeded, finished
work frees capacity at once, FIFO admission starves nobody, static mode deals equal shares."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.rollout.scheduler import RolloutScheduler, SchedulerMode


def _reserved_fits(s: RolloutScheduler) -> None:
    for e in s.engines.values():
        assert e.reserved_tokens == sum(e.rollouts.values())
        assert e.reserved_tokens <= e.capacity_tokens, f"engine {e.engine_id} over-reserved"


def test_admits_while_budget_fits_then_waits():
    s = RolloutScheduler({0: 1000, 1: 1000}, block_size=10)
    for i in range(10):
        s.submit(f"r{i}", 300)
    admitted = s.admit()
    # 3 x 300 fit in each 1000-token engine, the 4th does not
    assert len(admitted) == 6
    assert {a.engine_id for a in admitted} == {0, 1}
    assert s.waiting == 4
    _reserved_fits(s)
    assert s.admit() == []  # nothing changed, nothing more fits


def test_finish_frees_capacity_and_next_is_admitted_at_once():
    s = RolloutScheduler({0: 1000}, block_size=10)
    for i in range(5):
        s.submit(f"r{i}", 400)
    assert [a.rollout_id for a in s.admit()] == ["r0", "r1"]
    assert s.finish("r0") == 0
    assert s.engines[0].reserved_tokens == 400
    nxt = s.admit()
    assert [a.rollout_id for a in nxt] == ["r2"]
    assert nxt[0].engine_id == 0


def test_reservations_round_up_to_blocks():
    s = RolloutScheduler({0: 64}, block_size=32)
    s.submit("a", 33)
    s.submit("b", 1)
    adm = s.admit()
    assert [a.reserved_tokens for a in adm] == [64]
    assert s.waiting == 1


def test_places_on_engine_with_most_free_kv():
    s = RolloutScheduler({0: 1000, 1: 2000}, block_size=1)
    s.submit("a", 500)
    s.submit("b", 500)
    s.submit("c", 500)
    placed = {a.rollout_id: a.engine_id for a in s.admit()}
    assert placed == {"a": 1, "b": 1, "c": 0}  # 2000 free > 1000; then 1500 > 1000; then 1000 == 1000, fewer rollouts


def test_fifo_head_is_never_overtaken():
    s = RolloutScheduler({0: 1000}, block_size=1)
    s.submit("small0", 600)
    s.submit("big", 900)
    s.submit("small1", 100)
    assert [a.rollout_id for a in s.admit()] == ["small0"]
    # small1 would fit (600 + 100 <= 1000) but big is ahead of it
    assert s.is_waiting("big") and s.is_waiting("small1")
    s.finish("small0")
    assert [a.rollout_id for a in s.admit()] == ["big", "small1"]


def test_budget_larger_than_any_engine_is_rejected():
    s = RolloutScheduler({0: 1000, 1: 500}, block_size=1)
    with pytest.raises(ValueError, match="more than any engine holds"):
        s.submit("huge", 1001)
    with pytest.raises(ValueError):
        s.submit("zero", 0)
    s.submit("x", 10)
    with pytest.raises(ValueError, match="already scheduled"):
        s.submit("x", 10)


def test_observed_kv_usage_limits_admission():
    s = RolloutScheduler({0: 1000}, block_size=1)
    s.observe(0, used_tokens=800)  # something else holds 800 tokens
    s.submit("a", 300)
    assert s.admit() == []
    s.observe(0, used_tokens=100)
    assert [a.rollout_id for a in s.admit()] == ["a"]


def test_cancel_waiting_rollout():
    s = RolloutScheduler({0: 100}, block_size=1)
    s.submit("a", 100)
    s.submit("b", 100)
    s.admit()
    assert s.cancel("b") is True
    assert s.cancel("a") is False  # running, not waiting
    s.finish("a")
    assert s.admit() == []


def test_static_mode_deals_groups_round_robin_without_limit():
    s = RolloutScheduler({0: 100, 1: 100}, mode="static", block_size=1)
    for g in range(4):
        for k in range(3):
            s.submit(f"g{g}-{k}", 90, group=f"g{g}")
    adm = s.admit()
    assert len(adm) == 12  # static admits everything: the engine's own scheduler copes
    by_group = {}
    for a in adm:
        by_group.setdefault(a.rollout_id.split("-")[0], set()).add(a.engine_id)
    assert by_group == {"g0": {0}, "g1": {1}, "g2": {0}, "g3": {1}}


def test_adaptive_reservation_uses_quantile_and_promotes_the_tail():
    s = RolloutScheduler({0: 10_000}, block_size=1, reserve_quantile=0.5, quantile_min_samples=4)
    # cold start: full budget
    s.submit("w0", 1100, prompt_tokens=100)
    assert s.admit()[0].reserved_tokens == 1100
    s.finish("w0", response_tokens=200)
    for i in range(1, 4):
        s.submit(f"w{i}", 1100, prompt_tokens=100)
        s.admit()
        s.finish(f"w{i}", response_tokens=200)
    s.submit("a", 1100, prompt_tokens=100)
    adm = s.admit()
    assert adm[0].reserved_tokens == 300  # prompt + median response
    s.progress("a", 250)  # within the estimate: reservation unchanged
    assert s.engines[0].rollouts["a"] == 300
    s.progress("a", 350)  # outgrew the estimate: promoted to the full budget
    assert s.engines[0].rollouts["a"] == 1100
    assert s.promotions >= 1


class SimEngine:
    """A minimal engine: each admitted rollout grows one token per tick up to its final length
    (never beyond its budget) and KV usage is the sum of the lengths."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.lengths: dict[str, int] = {}

    def usage(self) -> int:
        return sum(self.lengths.values())


@settings(max_examples=40, deadline=None)
@given(
    capacities=st.lists(st.integers(208, 3000), min_size=1, max_size=5),
    budgets=st.lists(st.integers(1, 200), min_size=1, max_size=120),
    seed=st.integers(0, 10_000),
)
def test_simulated_engines_never_overflow_and_all_finish(capacities, budgets, seed):
    rng = random.Random(seed)
    s = RolloutScheduler(dict(enumerate(capacities)), block_size=16)
    engines = {i: SimEngine(c) for i, c in enumerate(capacities)}
    final = {}
    for i, b in enumerate(budgets):
        s.submit(f"r{i}", b)
        final[f"r{i}"] = rng.randint(1, b)  # actual length <= budget
    where: dict[str, int] = {}
    admitted_order: list[str] = []
    finished = set()
    for _tick in range(10_000):
        for a in s.admit():
            where[a.rollout_id] = a.engine_id
            admitted_order.append(a.rollout_id)
            engines[a.engine_id].lengths[a.rollout_id] = 0
        _reserved_fits(s)
        for eid, e in engines.items():
            for rid in list(e.lengths):
                e.lengths[rid] += 1
                if e.lengths[rid] >= final[rid]:
                    del e.lengths[rid]
                    s.finish(rid)
                    finished.add(rid)
            assert e.usage() <= e.capacity  # no KV overflow, ever
        if len(finished) == len(budgets):
            break
    assert len(finished) == len(budgets), "some rollout starved"
    assert admitted_order == [f"r{i}" for i in range(len(budgets))]  # strict FIFO admission
