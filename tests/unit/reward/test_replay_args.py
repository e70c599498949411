"""Replay refuses, before touching the broker, any destination that would write into the
original run or the live scored topic."""

from __future__ import annotations

import pytest

from services.reward.config import Settings
from services.reward.replay import ReplayError, rescore
from shared.settings import load_settings


@pytest.fixture
def settings() -> Settings:
    # an unreachable broker: every case below must fail before connecting
    return load_settings(Settings, kafka_bootstrap="127.0.0.1:1", topic_prefix="x.")


@pytest.mark.parametrize(
    "kwargs,reason",
    [
        ({"to_run": "a"}, "differ from from_run"),
        ({}, "give to_run"),
        ({"to_topic": "x.rstar.scored"}, "live scored topic"),
        ({"to_run": "b", "to_topic": "x.rstar.trajectories"}, "differ from the source"),
        ({"to_run": "b", "roc_mode": "paper"}, "unknown roc mode"),
    ],
)
async def test_bad_destinations_are_refused(settings, kwargs, reason):
    with pytest.raises(ReplayError, match=reason):
        await rescore(settings, from_run="a", **kwargs)
