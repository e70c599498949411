"""Topic registry: every Kafka topic of the pipeline, its key and its sizing.

Consumers and producers name topics through this module only, so a deployment can prefix them
(``RSTAR_TOPIC_PREFIX``, e.g. per environment) in one place.
"""

from __future__ import annotations

from dataclasses import dataclass

MiB = 1024 * 1024


@dataclass(frozen=True)
class TopicSpec:
    name: str
    key: str
    event: str
    partitions: int
    retention_ms: int
    max_message_bytes: int

    @property
    def dlq(self) -> str:
        return dlq_name(self.name)


DAY_MS = 24 * 3600 * 1000

ROLLOUT_TASKS = TopicSpec("rstar.rollout.tasks", "problem_id", "RolloutTask", 8, 7 * DAY_MS, 1 * MiB)
# A group of 32 trajectories of 12K tokens is ~5 MB packed before compression.
TRAJECTORIES = TopicSpec("rstar.trajectories", "group_id", "TrajectoryGroup", 8, 30 * DAY_MS, 32 * MiB)
SCORED = TopicSpec("rstar.scored", "group_id", "ScoredGroup", 8, 30 * DAY_MS, 32 * MiB)
# One partition: versions are totally ordered and every reader reads them all.
WEIGHTS = TopicSpec("rstar.weights", "run_id", "WeightVersion", 1, 30 * DAY_MS, 1 * MiB)

ALL: tuple[TopicSpec, ...] = (ROLLOUT_TASKS, TRAJECTORIES, SCORED, WEIGHTS)
MAX_MESSAGE_BYTES = max(t.max_message_bytes for t in ALL)


def dlq_name(topic: str) -> str:
    return f"{topic}.dlq"


def by_name(name: str) -> TopicSpec:
    for spec in ALL:
        if spec.name == name:
            return spec
    raise KeyError(f"unknown topic {name!r}; known: {[t.name for t in ALL]}")
