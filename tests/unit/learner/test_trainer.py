"""Packing, chunked logprobs and the training step on a tiny Llama (CPU, fp32)."""

import copy

import pytest
import torch

from services.learner.logprobs import chunked_token_logprobs
from services.learner.loss import LossConfig
from services.learner.packing import TrainSequence, pack, plan_micro_batches
from services.learner.trainer import PolicyTrainer, TrainerConfig, lr_factor

from learner_helpers import random_sequences, tiny_llama


def test_chunked_logprobs_match_full_log_softmax_and_its_gradient():
    torch.manual_seed(0)
    h = torch.randn(37, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 50, (37,))
    g = torch.randn(37, dtype=torch.float64)
    logp, ent = chunked_token_logprobs(h.float(), w.float(), t, chunk_tokens=8)
    full = torch.log_softmax(h.float() @ w.float().T, -1)
    assert torch.allclose(logp, full.gather(1, t[:, None]).squeeze(1), atol=1e-5)
    assert torch.allclose(ent, -(full.exp() * full).sum(-1), atol=1e-5)
    assert torch.autograd.gradcheck(
        lambda a, b: chunked_token_logprobs(a, b, t[:9], chunk_tokens=4)[0], (h[:9].detach().clone().requires_grad_(), w)
    )
    (logp * g.float()).sum().backward()
    h2, w2 = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    (torch.log_softmax(h2.float() @ w2.float().T, -1).gather(1, t[:, None]).squeeze(1) * g.float()).sum().backward()
    assert torch.allclose(h.grad, h2.grad, atol=1e-5) and torch.allclose(w.grad, w2.grad, atol=1e-5)


def test_packing_respects_budget_and_indexes_loss_tokens():
    seqs = random_sequences(9, seed=3)
    plan = plan_micro_batches([len(s) for s in seqs], 40)
    seen = sorted(i for mb in plan for row in mb for i in row)
    assert seen == list(range(9))
    for mb in plan:
        total = sum(len(seqs[i]) for row in mb for i in row)
        assert total <= 40 or len(mb[0]) == 1
    for mb in pack(seqs, 40, pad_id=0):
        rows, width = mb.shape
        assert rows == 1 and mb.n_tokens == width  # no padding in the single-row layout
        flat = [t for r in mb.input_ids for t in r]
        for idx, target in zip(mb.pred_index, mb.targets):
            assert flat[idx + 1] == target
    assert sum(mb.n_loss_tokens for mb in pack(seqs, 40, 0)) == sum(s.n_loss_tokens for s in seqs)
    two_d = pack(seqs, 64, pad_id=0, row_tokens=32)
    assert all(mb.shape[0] <= 2 for mb in two_d)
    assert sum(mb.n_loss_tokens for mb in two_d) == sum(s.n_loss_tokens for s in seqs)


def test_packed_forward_equals_each_sequence_alone():
    model = tiny_llama()
    trainer = PolicyTrainer(model, TrainerConfig(micro_batch_tokens=4096))
    seqs = random_sequences(6, seed=1)
    packed = trainer.sequence_logprobs(seqs)
    alone = PolicyTrainer(model, TrainerConfig(micro_batch_tokens=1))  # one sequence per micro-batch
    single = alone.sequence_logprobs(seqs)
    rows = PolicyTrainer(model, TrainerConfig(micro_batch_tokens=64, row_tokens=32)).sequence_logprobs(seqs)
    for a, b, c in zip(packed, single, rows):
        assert a == pytest.approx(b, abs=1e-5) and c == pytest.approx(b, abs=1e-5)


def test_gradient_accumulation_gives_the_same_update_as_one_large_batch():
    seqs = random_sequences(8, seed=2)
    base = tiny_llama(seed=5)
    results = []
    for budget in (4096, 24):
        model = copy.deepcopy(base)
        trainer = PolicyTrainer(model, TrainerConfig(lr=1e-2, warmup_steps=0, micro_batch_tokens=budget))
        res = trainer.train_step(seqs)
        # AdamW's first update is ~lr·sign(g), which amplifies rounding noise in near-zero
        # gradient entries, so compare the accumulated (clipped) gradients it stored as well
        grads = [trainer.optimizer.state[p]["exp_avg"].clone() for p in model.parameters()]
        results.append((res.metrics, {k: v.detach().clone() for k, v in model.state_dict().items()}, grads))
    (m_big, w_big, g_big), (m_small, w_small, g_small) = results
    for a, b in zip(g_big, g_small):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-9)
    assert m_small["micro_batches"] > 1 and m_big["micro_batches"] == 1
    assert m_small["loss"] == pytest.approx(m_big["loss"], abs=1e-6)
    assert m_small["grad_norm"] == pytest.approx(m_big["grad_norm"], rel=1e-4)
    changed = 0
    for k in w_big:
        assert torch.allclose(w_big[k], w_small[k], atol=1e-4), k
        changed += int(not torch.equal(w_big[k], base.state_dict()[k]))
    assert changed > 0


@pytest.mark.parametrize("objective", ["decoupled", "tis"])
def test_a_few_steps_reduce_the_loss_on_a_fixed_batch(objective):
    torch.manual_seed(0)
    model = tiny_llama(seed=1)
    seqs = random_sequences(8, seed=4)
    trainer = PolicyTrainer(model, TrainerConfig(lr=3e-3, warmup_steps=0, micro_batch_tokens=64,
                                                 loss=LossConfig(objective=objective)))
    # behaviour = the initial policy, so the GRPO surrogate starts at −mean(A·w) and must fall
    init = trainer.sequence_logprobs(seqs)
    for s, lp in zip(seqs, init):
        it = iter(lp)
        s.behaviour_logprobs = [next(it) if (m and (len(s.prompt_ids) + j) >= 1) else 0.0
                                for j, m in enumerate(s.loss_mask)]
    def surrogate() -> float:
        # −token-mean of A·π/μ: what the updates push down, evaluated without updating
        lps = trainer.sequence_logprobs(seqs)
        num = sum(-s.advantage * torch.exp(torch.tensor(lp) - torch.tensor([b for b, m in zip(s.behaviour_logprobs, s.loss_mask) if m])).sum().item()
                  for s, lp in zip(seqs, lps))
        return num / sum(s.n_loss_tokens for s in seqs)
    before = surrogate()
    for _ in range(5):
        m = trainer.train_step(seqs).metrics
        assert m["approx_kl_behav"] >= 0
    after = surrogate()
    assert after < before - 0.05


def test_updates_per_step_uses_a_proximal_pass_and_reports_clipping():
    model = tiny_llama(seed=2)
    seqs = random_sequences(8, seed=6)
    trainer = PolicyTrainer(model, TrainerConfig(lr=5e-2, warmup_steps=0, updates_per_step=4, micro_batch_tokens=64))
    m = trainer.train_step(seqs).metrics
    assert m["updates"] == 4 and m["proximal_pass_seconds"] > 0
    m2 = trainer.train_step(seqs).metrics
    assert m2["ratio_mean"] != pytest.approx(1.0, abs=1e-6)  # later updates move away from the proximal policy


def test_the_clip_binds_only_with_more_than_one_mini_batch():
    """One update per step: the proximal policy is the current weights, every ratio is exactly 1 and
    neither clip can bind (clip fractions exactly 0). Four mini-batches against the step's fixed
    proximal policy: later mini-batches have moved, and both clips bind on some tokens."""
    seqs = random_sequences(16, seed=6)
    one = PolicyTrainer(tiny_llama(seed=2), TrainerConfig(lr=5e-2, warmup_steps=0, updates_per_step=1,
                                                          micro_batch_tokens=64))
    for _ in range(3):
        m = one.train_step(seqs).metrics
        assert m["clip_frac_low"] == 0.0 and m["clip_frac_high"] == 0.0
    four = PolicyTrainer(tiny_llama(seed=2), TrainerConfig(lr=5e-2, warmup_steps=0, updates_per_step=4,
                                                           micro_batch_tokens=64))
    fracs = [four.train_step(seqs).metrics for _ in range(3)]
    assert any(m["clip_frac_high"] > 0 for m in fracs) and any(m["clip_frac_low"] > 0 for m in fracs)


def test_warmup_and_optimizer_reset():
    cfg = TrainerConfig(lr=1.0, warmup_steps=4)
    assert [lr_factor(s, cfg) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    cos = TrainerConfig(lr=1.0, warmup_steps=0, schedule="cosine", total_steps=10, min_lr_ratio=0.0)
    assert lr_factor(0, cos) == pytest.approx(1.0) and lr_factor(10, cos) == pytest.approx(0.0)
    trainer = PolicyTrainer(tiny_llama(), TrainerConfig(lr=1e-3, warmup_steps=2, micro_batch_tokens=4096))
    trainer.train_step(random_sequences(2))
    trainer.train_step(random_sequences(2))
    assert trainer.current_lr() == pytest.approx(1e-3) and trainer.optimizer.state
    trainer.reset_optimizer()
    assert not trainer.optimizer.state and trainer.current_lr() == pytest.approx(5e-4)
    assert trainer.optimizer_resets == 1


def test_sft_step_reduces_nll():
    model = tiny_llama(seed=3)
    seqs = random_sequences(6, seed=8, rl=False)
    trainer = PolicyTrainer(model, TrainerConfig(lr=1e-2, warmup_steps=0, micro_batch_tokens=64, row_tokens=32))
    first = trainer.sft_step(seqs)["loss"]
    for _ in range(10):
        last = trainer.sft_step(seqs)["loss"]
    assert last < first - 0.5


def test_recipe_settings_reach_the_optimizer_and_the_loss():
    from services.learner.config import Settings

    cfg = Settings(lr=2e-4, adam_eps=1e-4, negative_advantage_scale=0.0).trainer_config()
    assert cfg.eps == 1e-4 and cfg.loss.negative_advantage_scale == 0.0
    trainer = PolicyTrainer(tiny_llama(), cfg)
    assert trainer.optimizer.param_groups[0]["eps"] == 1e-4
    defaults = Settings().trainer_config()
    assert defaults.eps == 1e-8 and defaults.loss.negative_advantage_scale == 1.0  # the paper's recipe


def test_sequences_without_gradient_are_skipped_but_counted_in_the_token_mean():
    """With negative_advantage_scale 0 the failed samples (and A = 0 ones) are not run, and the
    gradient is exactly the token-mean over the whole batch: the positives' gradient scaled by
    (positive loss tokens / all loss tokens)."""
    seqs = random_sequences(10, seed=8)
    seqs[0].advantage = 0.0
    positives = [s for s in seqs if s.advantage > 0]
    assert 0 < len(positives) < len(seqs) - 1
    base = tiny_llama(seed=3)
    exp_avg = {}
    for name, batch in (("mixed", seqs), ("positives", positives)):
        model = copy.deepcopy(base)
        trainer = PolicyTrainer(model, TrainerConfig(lr=1e-3, warmup_steps=0, micro_batch_tokens=48, grad_clip=1e6,
                                                     loss=LossConfig(negative_advantage_scale=0.0)))
        m = trainer.train_step(batch).metrics
        exp_avg[name] = [trainer.optimizer.state[p]["exp_avg"].clone() for p in model.parameters()]
        if name == "mixed":
            assert m["skipped_sequences"] == len(seqs) - len(positives)
            assert m["loss_tokens"] == sum(s.n_loss_tokens for s in positives)
    share = sum(s.n_loss_tokens for s in positives) / sum(s.n_loss_tokens for s in seqs)
    for a, b in zip(exp_avg["mixed"], exp_avg["positives"]):
        assert torch.allclose(a, b * share, rtol=1e-4, atol=1e-10)
    # with the paper's symmetric advantages only the A = 0 sequence is skipped
    m = PolicyTrainer(copy.deepcopy(base), TrainerConfig(warmup_steps=0)).train_step(seqs).metrics
    assert m["skipped_sequences"] == 1
    # a batch with no gradient at all still makes a (no-op) step
    m = PolicyTrainer(copy.deepcopy(base), TrainerConfig(warmup_steps=0, loss=LossConfig(negative_advantage_scale=0.0))
                      ).train_step([s for s in seqs if s.advantage <= 0]).metrics
    assert m["micro_batches"] == 0 and m["loss_tokens"] == 0
