"""Helpers for the learner unit tests: a tiny Llama and random RL/SFT sequences."""

import random

import torch

from services.learner.packing import TrainSequence


def tiny_llama(seed: int = 0, vocab: int = 64, tie: bool = True):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=tie, attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg)
    model.config.use_cache = False
    return model


def random_sequences(n: int, seed: int = 0, vocab: int = 64, rl: bool = True) -> list[TrainSequence]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p, r = rng.randint(1, 12), rng.randint(1, 20)
        mask = [1 if rng.random() > 0.25 else 0 for _ in range(r)]
        out.append(TrainSequence(
            prompt_ids=[rng.randrange(vocab) for _ in range(p)],
            response_ids=[rng.randrange(vocab) for _ in range(r)],
            loss_mask=mask,
            behaviour_logprobs=[-rng.uniform(2.0, 6.0) * m for m in mask] if rl else None,
            advantage=rng.choice([-1.0, 1.0]) * rng.uniform(0.5, 1.5) if rl else 0.0,  # SFT examples: none
        ))
    return out


def save_tiny_model(path, seed: int = 0, vocab: int = 64):
    """An HF model directory (config.json + model.safetensors) of the tiny Llama."""
    model = tiny_llama(seed=seed, vocab=vocab)
    model.save_pretrained(str(path))
    return path


def scored_group(group_id: str, *, run_id: str = "run-a", stage: int = 1, version: int = 0, n: int = 4,
                 seed: int = 0, vocab: int = 64, advantages=None):
    from shared.events import RocStats, ScoredGroup, ScoredTrajectory, ToolCallRecord, Trajectory

    rng = random.Random(f"{group_id}-{seed}")
    advantages = advantages if advantages is not None else [1.0, -1.0] * (n // 2) + [0.0] * (n % 2)
    selected = []
    for i in range(n):
        r = rng.randint(4, 16)
        mask = [0 if 2 <= j < 4 else 1 for j in range(r)]
        correct = advantages[i] > 0
        selected.append(ScoredTrajectory(
            trajectory=Trajectory(
                traj_id=f"{group_id}-{i}",
                prompt_token_ids=[rng.randrange(vocab) for _ in range(rng.randint(2, 8))],
                response_token_ids=[rng.randrange(vocab) for _ in range(r)],
                loss_mask=mask,
                logprobs=[-rng.uniform(3.0, 5.0) * m for m in mask],
                token_versions=[version] * r,
                turns=1,
                tool_calls=[ToolCallRecord(code="print(1)", status="ok" if i % 3 else "error", duration_ms=1.0)],
                finish_reason="answer",
                response_text="x",
            ),
            reward=1.0 if correct else 0.0,
            advantage=advantages[i],
            correct=correct,
            p_err=0.0,
            p_format=0.0,
        ))
    return ScoredGroup(group_id=group_id, run_id=run_id, stage=stage, problem_id=f"p-{group_id}",
                       min_policy_version=version, max_policy_version=version, pass_rate=0.5, n_total=2 * n,
                       roc_mode="roc", all_equal=False, selected=selected, roc=RocStats())
