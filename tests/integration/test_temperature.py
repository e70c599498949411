"""Sampling at T != 1 is exact: the rollout's logprobs are vLLM's processed (temperature-scaled)
ones, and the learner's log-probability of the same tokens, with its logits divided by T, is the
same number. Without the division (T = 1 in the learner) the two disagree."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

T = 0.7


async def test_learner_logprobs_at_temperature_equal_vllms_processed_logprobs(tmp_path):
    import torch

    from lab.tiny_model import create_random_model
    from services.learner.engine import pad_token_id
    from services.learner.packing import TrainSequence
    from services.learner.trainer import PolicyTrainer, TrainerConfig, load_model
    from services.rollout.agent import GenerateRequest
    from services.rollout.engine import RolloutEngine
    from shared.formats import load_format

    model_dir = create_random_model(tmp_path / "tiny", seed=0, hidden=128, layers=2, heads=4, intermediate=256)
    fmt = load_format(model_dir, "compact")
    prompt = fmt.prompt_ids("Compute 12 * 34 + 5.")
    engine = RolloutEngine(0, model=model_dir, max_model_len=1024, kv_cache_gib=0.25, max_num_seqs=8,
                           enforce_eager=True, seed=1)
    await engine.start()
    try:
        gens = [await engine.generate(GenerateRequest(prompt, 64, 1), temperature=T, top_p=1.0, stop_token_ids=[],
                                      request_id=f"t{i}") for i in range(3)]
    finally:
        engine.shutdown()
    seqs = [TrainSequence(prompt, g.token_ids, [1] * len(g.token_ids)) for g in gens]
    model = load_model(model_dir, torch.device("cpu"))
    at_t = PolicyTrainer(model, TrainerConfig(temperature=T), pad_id=pad_token_id(model_dir)).sequence_logprobs(seqs)
    at_1 = PolicyTrainer(model, TrainerConfig(), pad_id=pad_token_id(model_dir)).sequence_logprobs(seqs)
    vllm = [lp for g in gens for lp in g.logprobs]
    learner_t = [lp for s in at_t for lp in s]
    learner_1 = [lp for s in at_1 for lp in s]
    assert len(vllm) == len(learner_t) == 3 * 64
    assert max(abs(a - b) for a, b in zip(vllm, learner_t)) < 2e-3
    # the raw (T = 1) log-probs are another policy: the check above would fail without the division
    assert sum(abs(a - b) for a, b in zip(vllm, learner_1)) / len(vllm) > 0.05
