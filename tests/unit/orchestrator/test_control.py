"""The orchestrator's pure control logic: admission keeps staleness within η, leases,
stages, the stage-3 entry probe."""

from datetime import datetime, timedelta, timezone

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.orchestrator import control
from services.orchestrator.control import Lease, ProbeResult, Progress

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def test_admission_budget_formula():
    # (η + v + 1)·B groups may be live; already live ones count against it.
    assert control.admission_budget(Progress(0, 0, 0, 0), batch_groups=4, max_staleness=0) == 4
    assert control.admission_budget(Progress(0, 0, 4, 0), batch_groups=4, max_staleness=0) == 0
    assert control.admission_budget(Progress(1, 1, 4, 0), batch_groups=4, max_staleness=0) == 4
    assert control.admission_budget(Progress(0, 0, 0, 0), batch_groups=4, max_staleness=2) == 12
    # dropped groups never reach the learner: they free their place
    assert control.admission_budget(Progress(0, 0, 4, 3), batch_groups=4, max_staleness=0) == 3
    assert control.admission_budget(Progress(0, 0, 50, 0), batch_groups=4, max_staleness=0) == 0  # never negative


def test_admission_stops_eta_steps_of_groups_past_the_last_step():
    # 3 steps of B=2, η=1: at most (3 + 1)·2 = 8 groups are ever live, whatever the version.
    assert control.admission_budget(Progress(2, 2, 6, 0), batch_groups=2, max_staleness=1, total_steps=3) == 2
    assert control.admission_budget(Progress(3, 3, 8, 0), batch_groups=2, max_staleness=1) == 2
    assert control.admission_budget(Progress(3, 3, 8, 0), batch_groups=2, max_staleness=1, total_steps=3) == 0
    # a dropped group is replaced even at the end
    assert control.admission_budget(Progress(3, 3, 8, 1), batch_groups=2, max_staleness=1, total_steps=3) == 1
    # synchronous: exactly the run's groups
    assert control.admission_budget(Progress(3, 3, 6, 0), batch_groups=2, max_staleness=0, total_steps=3) == 0


@settings(max_examples=200, deadline=None)
@given(
    batch=st.integers(1, 6),
    eta=st.integers(0, 3),
    total_steps=st.integers(1, 20),
    events=st.lists(st.sampled_from(["tick", "score", "drop"]), min_size=1, max_size=200),
)
def test_simulated_run_never_exceeds_staleness(batch, eta, total_steps, events):
    """Simulate an async run: the orchestrator admits by the budget, groups finish in order,
    some are dropped, the learner steps every B trainable groups. Every trained group's
    staleness (training version − admission version) stays within η, and the learner never
    steps past the run's last step."""
    version, dispatched, dropped = 0, 0, 0
    queue: list[int] = []  # admission versions of admitted, unfinished groups (FIFO)
    ready: list[int] = []  # scored, waiting for the learner
    for ev in events:
        if ev == "tick":
            n = control.admission_budget(Progress(version, version, dispatched, dropped),
                                         batch_groups=batch, max_staleness=eta, total_steps=total_steps)
            queue.extend([version] * n)
            dispatched += n
        elif queue:
            v = queue.pop(0)
            if ev == "drop":
                dropped += 1
            else:
                ready.append(v)
        while len(ready) >= batch and version < total_steps:  # the learner stops at the last step
            step_groups, ready = ready[:batch], ready[batch:]
            assert all(version - v <= eta for v in step_groups), (version, step_groups)
            version += 1
        assert dispatched - dropped <= (total_steps + eta) * batch


def test_a_new_task_belongs_to_the_stage_of_the_step_that_trains_it():
    stages = [2, 1]  # stage A: steps 0-1, stage B: step 2
    got = [control.stage_of_new_task(live, batch_groups=2, stage_steps=stages) for live in range(8)]
    assert got == [0, 0, 0, 0, 1, 1, 1, 1]  # the groups beyond the last step: the last stage


def test_staleness_bound_checker():
    assert control.staleness_bound_holds([0, 0, 0, 0, 1, 1], batch_groups=2, max_staleness=1)
    assert not control.staleness_bound_holds([0, 0, 0, 0, 0], batch_groups=2, max_staleness=1)


def test_expired_leases_redispatch_then_give_up():
    leases = [Lease("a", T0 - timedelta(seconds=1), 1), Lease("b", T0 + timedelta(seconds=5), 1),
              Lease("c", T0, 3)]
    d = control.expired_leases(leases, T0, max_attempts=3)
    assert [x.task_id for x in d.redispatch] == ["a"]
    assert [x.task_id for x in d.give_up] == ["c"]
    assert control.new_deadline(T0, 30) == T0 + timedelta(seconds=30)


def test_a_lease_lost_to_tool_failures_is_redispatched_before_its_deadline():
    later = T0 + timedelta(seconds=60)
    leases = [Lease("lost", later, 1), Lease("fine", later, 1), Lease("lost-last", later, 3)]
    d = control.expired_leases(leases, T0, max_attempts=3, faulted=frozenset({"lost", "lost-last"}))
    assert [x.task_id for x in d.redispatch] == ["lost"]
    assert [x.task_id for x in d.give_up] == ["lost-last"]


def test_stage_position():
    steps = [3, 2, 4]
    assert [control.stage_position(i, steps).index for i in range(9)] == [0, 0, 0, 1, 1, 2, 2, 2, 2]
    assert control.stage_position(9, steps).finished
    assert not control.stage_position(8, steps).finished


def test_probe_drops_exactly_the_problems_solved_k_of_k():
    results = [
        ProbeResult("solved", 8, 8),      # 8/8 -> dropped
        ProbeResult("almost", 8, 7),      # 7/8 -> kept
        ProbeResult("short", 7, 7),       # 7/7: one rollout lost to a tool failure, not "8/8" -> kept
        ProbeResult("never", 8, 0),
    ]
    ids = ["never", "solved", "unprobed", "almost", "short"]
    out = control.probe_outcome(ids, results, samples=8)
    assert out.kept == ["never", "unprobed", "almost", "short"] and out.solved == ["solved"]
    assert out.missing == 1 and not out.all_solved
    everything = control.probe_outcome(["a", "b"], [ProbeResult("a", 8, 8), ProbeResult("b", 8, 8)], samples=8)
    assert everything.kept == ["a", "b"] and everything.all_solved  # nothing is hard: keep training on all


def test_probe_finishes_when_every_candidate_settled_or_at_the_timeout():
    ids = ["a", "b", "c"]
    assert not control.probe_finished(ids, {"a", "b"}, started=T0, now=T0 + timedelta(seconds=5), timeout_s=60)
    assert control.probe_finished(ids, {"a", "b", "c"}, started=T0, now=T0, timeout_s=60)
    assert control.probe_finished(ids, {"a"}, started=T0, now=T0 + timedelta(seconds=60), timeout_s=60)


def test_probe_candidates_are_all_problems_or_a_seeded_sample_in_order():
    ids = [f"p{i:02d}" for i in range(40)]
    assert control.probe_candidates(ids, max_problems=0, seed=1) == ids
    assert control.probe_candidates(ids, max_problems=99, seed=1) == ids
    some = control.probe_candidates(ids, max_problems=10, seed=1)
    assert len(some) == 10 and some == sorted(some) and set(some) <= set(ids)
    assert some == control.probe_candidates(ids, max_problems=10, seed=1)
    assert some != control.probe_candidates(ids, max_problems=10, seed=2)


def test_problem_feed_is_a_deterministic_epoch_permutation():
    ids = [f"p{i}" for i in range(7)]
    first_epoch = [control.problem_at(i, ids, seed=3) for i in range(7)]
    assert sorted(first_epoch) == ids  # every problem once per epoch
    assert first_epoch == [control.problem_at(i, ids, seed=3) for i in range(7)]
    assert sorted(control.problem_at(i, ids, seed=3) for i in range(7, 14)) == ids
    with pytest.raises(ValueError):
        control.problem_at(0, [], seed=0)


def test_a_run_is_fed_only_while_a_live_learner_trains_it():
    beat = control.LearnerBeat
    now = T0 + timedelta(minutes=10)
    fresh, old = now - timedelta(seconds=5), now - timedelta(seconds=61)
    present = lambda beats: control.learner_present(beats, "run-a", now, timeout_s=60)  # noqa: E731
    assert not present([])
    assert present([beat("run-a", fresh)])
    assert not present([beat("run-a", old)])  # killed without a clean stop: its heartbeats ended
    assert not present([beat("run-b", fresh)])  # another run's learner does not train this one
    assert present([beat("", fresh)])  # still loading, or adopting the first run it is sent
    assert present([beat("run-b", fresh), beat("run-a", now - timedelta(seconds=60))])  # at the boundary
