import pytest
from pydantic import ValidationError

from services.tool_executor.config import UID_BASE_AUTO, UIDS_PER_REPLICA, Settings


def test_uid_ranges_follow_the_port_unless_set():
    a = Settings(port=8102, workers=2, slots_per_worker=4)
    b = Settings(port=8103, workers=2, slots_per_worker=4)
    assert a.effective_uid_base >= UID_BASE_AUTO
    # Replicas on one host (different ports) get disjoint ranges of UIDS_PER_REPLICA uids.
    assert abs(a.effective_uid_base - b.effective_uid_base) >= UIDS_PER_REPLICA
    assert Settings(port=8102, uid_base=300_000).effective_uid_base == 300_000


def test_settings_are_checked():
    with pytest.raises(ValidationError, match="at most"):
        Settings(workers=200, slots_per_worker=8)
    with pytest.raises(ValidationError, match="default_timeout_s exceeds"):
        Settings(default_timeout_s=100, max_timeout_s=60)
    with pytest.raises(ValidationError, match="uid_base"):
        Settings(uid_base=500)


def test_env_prefix(monkeypatch):
    monkeypatch.setenv("RSTAR_TOOL_EXECUTOR_WORKERS", "3")
    monkeypatch.setenv("RSTAR_TOOL_EXECUTOR_INSECURE", "true")
    s = Settings()
    assert s.workers == 3 and s.insecure is True and s.http_port == 8102
