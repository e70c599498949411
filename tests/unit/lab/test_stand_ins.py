"""Qwen2, Qwen3 and Llama model directories (tiny random stand-ins around the real tokenizers):
the format renders and tokenises generated traces, the learner loads the model and steps on them,
and its checkpoint is again a model directory with the tokenizer and chat template."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def qwen2_model(qwen3_tokenizer_dir, tmp_path_factory):
    # Qwen2.5's vocabulary is Qwen3's (the same 151,643 BPE tokens and tool tags).
    from lab.stand_in import create_stand_in

    return create_stand_in(qwen3_tokenizer_dir, tmp_path_factory.mktemp("qwen2") / "model", family="qwen2")


@pytest.mark.parametrize("model_name,arch", [("qwen2_model", "Qwen2ForCausalLM"), ("qwen3_model", "Qwen3ForCausalLM"),
                                             ("llama3_model", "LlamaForCausalLM")])
def test_family_trains_through_its_format_and_checkpoints(model_name, arch, request, tmp_path):
    import torch

    from services.learner.checkpoints import CheckpointStore, LearnerState
    from services.learner.engine import pad_token_id
    from services.learner.packing import TrainSequence
    from services.learner.trainer import PolicyTrainer, TrainerConfig, load_model
    from shared.datasets import generate_problems, sft_traces
    from shared.formats import load_format

    model_dir = request.getfixturevalue(model_name)
    fmt = load_format(model_dir, "rstar2")
    assert fmt.model.architecture == arch
    rows = [sft_traces.render_trace(t, fmt) for t in sft_traces.make_traces(generate_problems(4, seed=0), seed=0)]
    seqs = [TrainSequence(r.prompt_token_ids, r.response_token_ids, r.loss_mask) for r in rows]
    assert all(max(s.prompt_ids + s.response_ids) < fmt.model.vocab_size for s in seqs)
    model = load_model(model_dir, torch.device("cpu"))
    trainer = PolicyTrainer(model, TrainerConfig(lr=1e-3, warmup_steps=0, micro_batch_tokens=4096),
                            pad_id=pad_token_id(model_dir))
    first = trainer.sft_step(seqs)["loss"]
    for _ in range(3):
        last = trainer.sft_step(seqs)["loss"]
    assert last < first  # the model learns its own format's traces
    store = CheckpointStore(tmp_path / "ckpt", model_dir)
    weights, _ = store.save(LearnerState(run_id="r", version=1, step=1), model, trainer.state_dict())
    assert load_format(weights, "rstar2").describe() == fmt.describe()  # tokenizer + template copied
