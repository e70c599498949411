"""What one GRPO update does to the tiny SFT policy: the learner's step, variant by variant.

The recipe question behind ``negative_advantage_scale`` and ``adam_eps`` (docs/learner.md):
does a policy-gradient step on a batch of the policy's own samples raise its correct samples
and its pass rate, or does it mostly push the failed ones down?

1. Sample a batch: ``--problems`` training problems × ``--samples`` trajectories from the model
   (HF ``generate`` at T = 1 through the rollout's agent loop, model-written code run in a
   child interpreter: ``bootstrap.hf_agent_rollout``), score them by exact integer answer, and
   keep the groups with a GRPO signal, advantages as the reward service computes them
   (``roc.advantages``). The behaviour log-probabilities are the model's own (on-policy).
2. For each variant ``lr:negative_advantage_scale[:adam_eps]``, start from the same weights
   with a fresh optimizer (as an RL run does), take ``--steps`` learner steps
   (``PolicyTrainer.train_step``, no warm-up) on that batch, then report the mean change of the
   summed log-probability of the correct and of the failed samples and, unless
   ``--no-resample``, the pass rate of ``--samples`` fresh samples of the same problems.

It measures the update on the problems it was computed from; whether a recipe carries over to
held-out problems is what ``make demo`` measures. The sampling and the re-sampling are noisy
(96 samples: ±5 points); run with another ``--seed`` before trusting a difference.

Last line: one JSON object, ``{"pass_before": …, "variants": {VARIANT: {"dlogp_pos", "dlogp_neg",
"pass_after"}}}``. Default model: the demo's SFT model under ``.rstar/models`` (bootstrapped and
cached first, ~13-18.5 minutes by machine, when it is not there yet).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="HF model directory (default: the demo's SFT model, bootstrapped if missing)")
    ap.add_argument("--problems", type=int, default=12)
    ap.add_argument("--samples", type=int, default=8, help="samples per problem (the group size)")
    ap.add_argument("--steps", type=int, default=4, help="learner steps on the batch per variant")
    ap.add_argument("--variants", default="1e-4:1,3e-5:1,1e-4:0.25,1e-4:0",
                    help="comma-separated lr:negative_advantage_scale[:adam_eps]")
    ap.add_argument("--seed", type=int, default=5, help="seed of the training problems")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-resample", action="store_true", help="skip the pass rate after each variant")
    args = ap.parse_args()

    import torch

    from services.learner.loss import LossConfig
    from services.learner.packing import TrainSequence
    from services.learner.trainer import PolicyTrainer, TrainerConfig, load_model
    from shared.datasets import generated as data
    from lab.bootstrap import extract_int_answer, hf_agent_rollout
    from lab.demo import bootstrap_demo_model, demo_state_dir
    from services.reward.roc import advantages
    from lab.bootstrap import PRESET
    from shared.formats import load_format

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model_dir = args.model or bootstrap_demo_model(demo_state_dir())
    fmt = load_format(model_dir, PRESET)
    problems = data.make_splits(args.problems, 1, seed=args.seed)[0][: args.problems]

    def sample_group(model, p) -> tuple[list, list[float]]:
        trajs = [hf_agent_rollout(model, fmt, p, sample=True, max_tokens=512) for _ in range(args.samples)]
        return trajs, [1.0 if extract_int_answer(t.response_text) == p.answer else 0.0 for t in trajs]

    def pass_rate(model) -> float:
        wins = [r for p in problems for r in sample_group(model, p)[1]]
        return sum(wins) / len(wins)

    t0 = time.monotonic()
    model = load_model(model_dir, torch.device("cpu"))
    sequences: list[TrainSequence] = []
    wins = []
    for p in problems:
        trajs, rewards = sample_group(model, p)
        wins += rewards
        if len(set(rewards)) < 2:
            continue  # no GRPO signal
        for t, a in zip(trajs, advantages(rewards)):
            sequences.append(TrainSequence(list(t.prompt_token_ids), list(t.response_token_ids), list(t.loss_mask),
                                           None, a))
    pass_before = sum(wins) / len(wins)
    if not sequences:
        raise SystemExit("no group with both correct and failed samples: nothing to train on")
    from services.learner.engine import pad_token_id

    pad_id = pad_token_id(model_dir)
    before = PolicyTrainer(model, TrainerConfig(), pad_id=pad_id).sequence_logprobs(sequences)
    for seq, logps in zip(sequences, before):  # on-policy: the behaviour log-probs are the model's own
        behaviour = [0.0] * len(seq.response_ids)
        for i, lp in zip((i for i, m in enumerate(seq.loss_mask) if m), logps):
            behaviour[i] = lp
        seq.behaviour_logprobs = behaviour
    n_pos = sum(s.advantage > 0 for s in sequences)
    print(f"batch: {len(problems)} problems x {args.samples}, pass rate {pass_before:.3f}, {len(sequences)} samples in "
          f"groups with a signal ({n_pos} correct), sampled in {time.monotonic() - t0:.0f} s", flush=True)

    results = {}
    for variant in args.variants.split(","):
        parts = [float(x) for x in variant.split(":")]
        lr, scale, eps = parts[0], parts[1], parts[2] if len(parts) > 2 else TrainerConfig().eps
        policy = load_model(model_dir, torch.device("cpu"))
        trainer = PolicyTrainer(policy, TrainerConfig(lr=lr, warmup_steps=0, eps=eps,
                                                      loss=LossConfig(negative_advantage_scale=scale)), pad_id=pad_id)
        for _ in range(args.steps):
            trainer.train_step(sequences)
        after = trainer.sequence_logprobs(sequences)
        delta = [sum(b) - sum(a) for a, b in zip(before, after)]
        pos = [d for d, s in zip(delta, sequences) if s.advantage > 0]
        neg = [d for d, s in zip(delta, sequences) if s.advantage < 0]
        row = {"dlogp_pos": round(sum(pos) / len(pos), 3), "dlogp_neg": round(sum(neg) / len(neg), 3)}
        if not args.no_resample:
            row["pass_after"] = round(pass_rate(policy), 3)
        results[variant] = row
        print(f"lr {lr:g}, negative_advantage_scale {scale:g}, adam_eps {eps:g}, {args.steps} step(s): "
              + ", ".join(f"{k} {v}" for k, v in row.items()), flush=True)
    print(json.dumps({"pass_before": round(pass_before, 3), "steps": args.steps, "variants": results}))


if __name__ == "__main__":
    main()
