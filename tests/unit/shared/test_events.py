"""Event contracts: envelope, compact arrays, schema-version rejection (pure, no broker)."""

import orjson
import pytest

from shared.codec import pack, unpack
from shared.events import EventDecodeError, Trajectory, WeightVersion, decode, encode
from shared.testing import sample_group, sample_scored, sample_task, sample_trajectory, sample_weights


@pytest.mark.parametrize("make", [sample_task, sample_group, sample_scored, sample_weights])
def test_every_event_round_trips_byte_exact(make):
    ev = make()
    raw = encode(ev)
    env = decode(raw)
    assert env.payload == ev
    assert env.type == type(ev).__name__ and env.schema_version == 1
    assert encode(env) == raw


def test_arrays_are_packed_compactly_and_floats_are_float32():
    t = sample_trajectory(1000)
    wire = orjson.loads(encode(sample_group(n=1, n_tokens=1000)))["payload"]["trajectories"][0]
    assert wire["response_token_ids"].startswith("i4:") and wire["loss_mask"].startswith("u1:")
    assert wire["logprobs"].startswith("f4:")
    # 4 bytes per token id as base64 (~5.3 chars), far below a JSON list of numbers.
    assert len(wire["response_token_ids"]) < 1000 * 6
    assert t.logprobs[0] == float(__import__("numpy").float32(t.logprobs[0]))


def test_plain_lists_are_accepted_and_validated():
    t = Trajectory(traj_id="x", prompt_token_ids=[1], response_token_ids=[1, 2], loss_mask=[1, 0],
                   logprobs=[-0.5, 0.0], token_versions=[0, 0], turns=1, finish_reason="eos", response_text="")
    assert t.response_token_ids == [1, 2]
    with pytest.raises(ValueError, match="loss_mask has 1 entries"):
        Trajectory(traj_id="x", prompt_token_ids=[1], response_token_ids=[1, 2], loss_mask=[1],
                   logprobs=[-0.5, 0.0], token_versions=[0, 0], turns=1, finish_reason="eos", response_text="")
    with pytest.raises(ValueError, match="expected integers"):
        unpack([1.5], "i4")
    with pytest.raises(ValueError, match="prefix"):
        unpack(pack([1], "f4"), "i4")


@pytest.mark.parametrize(
    "mutate, reason",
    [
        (lambda d: d.update(schema_version=2), "unsupported schema_version 2"),
        (lambda d: d.pop("schema_version"), "unsupported schema_version None"),
        (lambda d: d.update(type="Nope"), "unknown event type 'Nope'"),
        (lambda d: d["payload"].update(version=-1), "invalid WeightVersion"),
        (lambda d: d["payload"].update(sha256="xyz"), "invalid WeightVersion"),
    ],
)
def test_bad_envelopes_are_rejected_with_a_reason(mutate, reason):
    d = orjson.loads(encode(sample_weights()))
    mutate(d)
    with pytest.raises(EventDecodeError, match=reason):
        decode(orjson.dumps(d))


def test_decode_rejects_non_json_and_wrong_type():
    with pytest.raises(EventDecodeError, match="not JSON"):
        decode(b"\xff\x00")
    with pytest.raises(EventDecodeError, match="expected a RolloutTask, got WeightVersion"):
        from shared.events import RolloutTask
        decode(encode(sample_weights()), RolloutTask)


def test_policy_version_range():
    g = sample_group(n=2)
    g.trajectories[1].token_versions = [3] * len(g.trajectories[1].token_versions)
    assert g.policy_version_range == (0, 3)
    assert isinstance(decode(encode(sample_weights())).payload, WeightVersion)
