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
            advantage=rng.choice([-1.0, 1.0]) * rng.uniform(0.5, 1.5),
        ))
    return out
