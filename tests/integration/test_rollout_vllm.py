"""The rollout service on a real vLLM CPU engine (a tiny random Llama built by the test), the
real tool executor, and the real broker.

ONE engine (module fixture, ~30 s to start) serves every test here.

How a random model is made to call a tool deterministically: ``ForcedEngine`` is a scripted
policy at the token level that still runs every token through the real engine. For a scripted
turn of tokens t1..tn it sends the context + t1..t(n-1) as a prompt continuation with
``prompt_logprobs`` (the engine's logprob of each forced token, computed by the real model) and
samples the last token with ``allowed_token_ids=[tn]`` (a real sampled token with its logprob).
The agent loop, the stop tokens, the tool executor and the trajectory arrays are the real
ones; only the policy's choice of tokens is scripted. The logprobs are then checked against an
independent scoring of the whole sequence by the same engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import socket
import uuid
from datetime import timedelta
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from aiokafka import AIOKafkaConsumer  # noqa: E402

from vllm_helpers import ForcedEngine, score  # noqa: E402
from services.rollout.config import Settings  # noqa: E402
from services.rollout.rollouts import AdmissionGate, RolloutRunner  # noqa: E402
from services.rollout.scheduler import RolloutScheduler  # noqa: E402
from services.rollout.weights import WeightUpdater, tensor_index  # noqa: E402
from shared import topics  # noqa: E402
from shared.checkpoint import checkpoint_sha256, uri_for  # noqa: E402
from shared.events import RolloutTask, SamplingParams, TrajectoryGroup, WeightVersion, decode, utcnow  # noqa: E402
from shared.formats import ConversationFormat, ToolResult, load_format  # noqa: E402
from shared.kafka import EventProducer, ensure_topics  # noqa: E402
from shared.runtime import run_service  # noqa: E402
from shared.settings import load_settings  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

MAX_MODEL_LEN = 2048


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model_root(tmp_path_factory) -> Path:
    from lab.tiny_model import create_random_model

    root = tmp_path_factory.mktemp("rollout-models")
    create_random_model(root / "v0", seed=0)
    create_random_model(root / "v1", seed=1)
    return root


@pytest.fixture(scope="module")
async def engine(model_root):
    from services.rollout.engine import RolloutEngine

    eng = RolloutEngine(0, model=model_root / "v0", max_model_len=MAX_MODEL_LEN, kv_cache_gib=1.0, max_num_seqs=64)
    await eng.start()
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def tokenizer(model_root) -> ConversationFormat:
    """The tiny model's conversation format (its chat template, the compact preset)."""
    return load_format(model_root / "v0", "compact", tool_response_max_chars=256)


@pytest.fixture(scope="module")
def tool_server():
    from services.tool_executor.testing import running_server

    with running_server({"RSTAR_TOOL_EXECUTOR_WORKERS": "1", "RSTAR_TOOL_EXECUTOR_UID_BASE": "350000"}) as srv:
        yield srv


def make_task(n: int = 2, max_tokens: int = 400, max_turns: int = 5, **kw) -> RolloutTask:
    base = dict(task_id=uuid.uuid4().hex, run_id="run-rollout-test", stage=1, problem_id="p-42",
                prompt="What is 6 times 7?", answer="42", n_samples=n,
                sampling=SamplingParams(temperature=1.0, max_tokens=max_tokens, max_turns=max_turns),
                deadline=utcnow() + timedelta(minutes=10))
    base.update(kw)
    return RolloutTask(**base)


def runner_for(engines, tokenizer, urls, *, tool_timeout_s=5.0, max_attempts=3) -> RolloutRunner:
    from services.tool_executor.client import ToolExecutorClient

    sched = RolloutScheduler({e.index: e.capacity_tokens for e in engines}, block_size=32)
    client = ToolExecutorClient(urls, max_attempts=max_attempts, backoff_initial_s=0.01, backoff_max_s=0.05)
    return RolloutRunner(engines, AdmissionGate(sched), tokenizer, client, max_model_len=MAX_MODEL_LEN,
                         tool_timeout_s=tool_timeout_s)


# --------------------------------------------------------------------------- agent loop


async def test_multi_turn_tool_call_round_trip(engine, tokenizer, tool_server):
    turn1 = "I will compute this." + tokenizer.tool_call_text("print(6 * 7)")
    turn2 = "The tool says 42. " + tokenizer.answer_text("42") + tokenizer.end_of_turn_text
    runner = runner_for([ForcedEngine(engine, tokenizer, [turn1, turn2])], tokenizer, [tool_server.url])
    task = make_task(n=2)
    group = await runner.run_task(task)
    await runner.tools.aclose()

    assert group.group_id == task.task_id and len(group.trajectories) == 2
    for traj in group.trajectories:
        assert traj.finish_reason == "answer" and traj.turns == 2
        assert [(t.status, t.code) for t in traj.tool_calls] == [("ok", "print(6 * 7)")]
        assert traj.tool_calls[0].output.strip() == "42"
        t1 = tokenizer.encode(turn1)
        block = tokenizer.tool_response_ids(ToolResult("ok", "42\n"))
        t2 = tokenizer.encode(turn2)
        assert traj.response_token_ids == t1 + block + t2
        assert traj.loss_mask == [1] * len(t1) + [0] * len(block) + [1] * len(t2)
        assert all(lp == 0.0 for lp, m in zip(traj.logprobs, traj.loss_mask) if m == 0)
        assert all(lp < 0.0 for lp, m in zip(traj.logprobs, traj.loss_mask) if m == 1)
        assert set(traj.token_versions) == {engine.version}
        assert traj.response_text.endswith(tokenizer.answer_text("42") + tokenizer.end_of_turn_text)
        # logprobs are aligned with the model tokens: an independent scoring of the whole
        # sequence by the same engine gives the same numbers at the same positions
        full = traj.prompt_token_ids + traj.response_token_ids
        ref = (await score(engine, full))[len(traj.prompt_token_ids):]
        for lp, r, m in zip(traj.logprobs, ref, traj.loss_mask):
            if m:
                assert lp == pytest.approx(r, abs=2e-3)


async def test_malformed_call_timeout_and_unreachable_executor_are_recorded(engine, tokenizer, tool_server):
    turns = [
        '<tool_call>{"name": "python", "arguments": {"code": "print(1)"</tool_call>',  # malformed JSON
        tokenizer.tool_call_text("import time\ntime.sleep(30)"),  # exceeds the 1 s tool limit
        tokenizer.tool_call_text("print(1/0)"),
        tokenizer.answer_text("7") + tokenizer.end_of_turn_text,
    ]
    runner = runner_for([ForcedEngine(engine, tokenizer, turns)], tokenizer, [tool_server.url], tool_timeout_s=1.0)
    group = await runner.run_task(make_task(n=1))
    await runner.tools.aclose()
    traj = group.trajectories[0]
    assert [t.status for t in traj.tool_calls] == ["parse_error", "timeout", "error"]
    assert "not valid JSON" in traj.tool_calls[0].output
    assert "ZeroDivisionError" in traj.tool_calls[2].output
    assert traj.finish_reason == "answer" and traj.turns == 4

    dead = f"http://127.0.0.1:{free_port()}"
    runner = runner_for([ForcedEngine(engine, tokenizer, [tokenizer.tool_call_text("print(2)")])], tokenizer, [dead],
                        max_attempts=2)
    group = await runner.run_task(make_task(n=1))
    await runner.tools.aclose()
    traj = group.trajectories[0]
    assert traj.finish_reason == "tool_failure"
    assert [t.status for t in traj.tool_calls] == ["error"]
    assert "unavailable" in traj.tool_calls[0].output


# --------------------------------------------------------------------------- weights


def weight_version(path: Path, version: int, sha: str | None = None) -> WeightVersion:
    return WeightVersion(run_id="run-rollout-test", version=version, step=version, stage=1, uri=uri_for(path),
                         sha256=sha or checkpoint_sha256(path))


async def test_weight_update_mid_generation_and_corrupt_checkpoints(engine, tokenizer, model_root, tmp_path):
    from services.rollout.agent import GenerateRequest as GR
    from lab.tiny_model import create_random_model

    updater = WeightUpdater([engine], tensor_index(model_root / "v0"), engine.version)
    base = engine.version
    prompt = tokenizer.prompt_ids("count")
    # a long generation that cannot stop early: the update lands in the middle of it
    no_stop = {"logit_bias": {i: -100.0 for i in tokenizer.stop_token_ids}}
    gen_task = asyncio.create_task(engine.generate(GR(prompt, 1500, 1), temperature=1.0, top_p=1.0,
                                                   stop_token_ids=[], extra=no_stop))
    await asyncio.sleep(1.0)
    assert not gen_task.done()
    assert await updater.load(weight_version(model_root / "v1", base + 1))
    gen = await gen_task
    assert engine.version == base + 1 and updater.version == base + 1
    assert len(gen.token_ids) == 1500
    assert gen.versions[0] == base and gen.versions[-1] == base + 1
    assert gen.versions == sorted(gen.versions)  # older tokens, then newer ones

    # a checkpoint whose bytes do not match the published hash is rejected before loading
    corrupt = tmp_path / "corrupt"
    shutil.copytree(model_root / "v1", corrupt)
    good_sha = checkpoint_sha256(corrupt)
    with open(corrupt / "model.safetensors", "r+b") as fh:
        fh.seek(200)
        fh.write(b"\xff" * 64)
    assert not await updater.load(weight_version(corrupt, base + 2, sha=good_sha))
    assert "rejected" in updater.last_error and engine.version == base + 1

    # a well-hashed checkpoint of another shape is rejected too (a failed in-place reload
    # would leave the engine with a half-written model)
    other = create_random_model(tmp_path / "other", seed=2, hidden=128, heads=4)
    assert not await updater.load(weight_version(other, base + 3))
    assert "differ" in updater.last_error

    # serving continues on the last good version
    after = await engine.generate(GR(prompt, 16, 1), temperature=1.0, top_p=1.0, stop_token_ids=[])
    assert len(after.token_ids) >= 1 and set(after.versions) == {base + 1}


# --------------------------------------------------------------------------- service


@contextlib.asynccontextmanager
async def running_rollout(settings: Settings, engines):
    from services.rollout.runtime import RolloutService

    service = RolloutService(settings, engines=engines)
    task = asyncio.create_task(run_service(service, settings, install_signals=False))
    try:
        for _ in range(600):
            if service.tasks_loop is not None and service.tasks_loop.started.is_set():
                break
            if task.done():
                task.result()
            await asyncio.sleep(0.05)
        else:
            raise TimeoutError("rollout service did not start")
        yield service
    finally:
        service.request_stop()
        await asyncio.wait_for(task, 60)


async def produce(bootstrap: str, topic_name: str, events: list, key: str = "k") -> None:
    producer = EventProducer(bootstrap)
    await producer.start()
    try:
        for ev in events:
            await producer.send(topic_name, ev, key=key)
    finally:
        await producer.stop()


async def read_groups(bootstrap: str, topic_name: str, expect: int, timeout_s: float = 240.0) -> list[TrajectoryGroup]:
    consumer = AIOKafkaConsumer(topic_name, bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                                max_partition_fetch_bytes=64 * 1024 * 1024, fetch_max_bytes=128 * 1024 * 1024)
    await consumer.start()
    out: list[TrajectoryGroup] = []
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while loop.time() < deadline and len(out) < expect:
            batches = await consumer.getmany(timeout_ms=300)
            for recs in batches.values():
                out.extend(decode(r.value, expect=TrajectoryGroup).payload for r in recs)
    finally:
        await consumer.stop()
    return out


async def test_service_consumes_tasks_publishes_groups_and_follows_weights(
        stack, topic_prefix, tmp_path, engine, model_root, tool_server):
    settings = load_settings(
        Settings, kafka_bootstrap=stack.kafka_bootstrap, database_url=stack.database_url,
        topic_prefix=topic_prefix, state_dir=tmp_path, port=free_port(), model_path=str(model_root / "v0"),
        max_model_len=MAX_MODEL_LEN, tool_executor_urls=[tool_server.url], max_concurrent_tasks=4,
        stats_interval_s=0.2, prompt_preset="compact",
    )
    await ensure_topics(stack.kafka_bootstrap, topic_prefix)
    tasks_topic = settings.topic(topics.ROLLOUT_TASKS)
    traj_topic = settings.topic(topics.TRAJECTORIES)
    weights_topic = settings.topic(topics.WEIGHTS)
    # v1 was loaded into this shared engine by the weights test when it ran first: publish the
    # next versions from whatever the engine serves now
    base = engine.version
    v_next = tmp_path / "next"
    shutil.copytree(model_root / ("v0" if base % 2 else "v1"), v_next)

    async with running_rollout(settings, [engine]) as service:
        sp = SamplingParams(temperature=1.0, max_tokens=48, max_turns=3)
        late = make_task(n=2, sampling=sp, deadline=utcnow() - timedelta(seconds=1))
        first = [make_task(n=3, sampling=sp) for _ in range(3)]
        await produce(stack.kafka_bootstrap, tasks_topic, [late, *first])
        groups = await read_groups(stack.kafka_bootstrap, traj_topic, expect=3)
        assert sorted(g.group_id for g in groups) == sorted(t.task_id for t in first)  # the late task was skipped
        for g in groups:
            assert len(g.trajectories) == 3 and g.rollout_instance == settings.instance_id
            for t in g.trajectories:
                assert len(t.response_token_ids) <= 48 and set(t.token_versions) == {base}

        # a task that needs a version not yet published waits for it
        waiting = make_task(n=2, sampling=sp, min_policy_version=base + 1)
        await produce(stack.kafka_bootstrap, tasks_topic, [waiting])
        await asyncio.sleep(1.0)
        assert len(await read_groups(stack.kafka_bootstrap, traj_topic, expect=4, timeout_s=2.0)) == 3
        corrupt = weight_version(v_next, base + 2, sha="0" * 64)
        await produce(stack.kafka_bootstrap, weights_topic, [weight_version(v_next, base + 1)], key="run")
        groups = await read_groups(stack.kafka_bootstrap, traj_topic, expect=4)
        done = {g.group_id: g for g in groups}[waiting.task_id]
        assert all(set(t.token_versions) == {base + 1} for t in done.trajectories)
        assert engine.version == base + 1

        # a corrupt version is rejected; the service keeps serving the last good one
        await produce(stack.kafka_bootstrap, weights_topic, [corrupt], key="run")
        for _ in range(100):
            if service.weights.last_error:
                break
            await asyncio.sleep(0.1)
        assert "rejected" in service.weights.last_error
        after = make_task(n=2, sampling=sp)
        await produce(stack.kafka_bootstrap, tasks_topic, [after])
        groups = await read_groups(stack.kafka_bootstrap, traj_topic, expect=5)
        g = {g.group_id: g for g in groups}[after.task_id]
        assert all(set(t.token_versions) == {base + 1} for t in g.trajectories)
        assert (await service.ready()) == {"engines": True}
