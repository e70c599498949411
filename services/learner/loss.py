"""GRPO-RoC policy loss: token-level PPO-clip with clip-higher and off-policy correction.

Pure tensor math, no I/O, no model: every function takes per-token tensors and returns a
scalar loss plus summed statistics. Notation per token t of a response (only tokens with
``loss_mask`` 1 — the model's own tokens — take part; tool-output tokens contribute nothing):

* ``logp``        log π_θ(t)      — the policy being trained (carries the gradient)
* ``logp_prox``   log π_prox(t)   — the *proximal* policy: the current weights before this
                                    step's update (no gradient)
* ``logp_behav``  log μ(t)        — the behaviour policy that generated the token at rollout
                                    time, possibly several versions old (recorded by vLLM)
* ``A``           the group-normalised advantage of the token's trajectory (GRPO)

Objectives (``LossConfig.objective``)
-------------------------------------
``decoupled`` (default) — the decoupled PPO objective (Hilton et al. 2021, "Batch
size-invariance for policy optimization"; AReaL). The PPO trust region is taken around the
proximal policy, and the behaviour mismatch is corrected by a separate, truncated importance
weight::

    r_t = π_θ / π_prox                      w_t = min(π_prox / μ, is_cap)   (no gradient)
    ℓ_t = − w_t · min(r_t·A, clip(r_t, 1 − ε_low, 1 + ε_high)·A)

``tis`` — plain truncated importance sampling, no proximal policy (saves the proximal
forward pass). The policy gradient is importance-weighted against the behaviour policy
with the weight truncated at ``is_cap``; there is no PPO clip in this mode::

    ρ_t = π_θ / μ                           ℓ_t = − min(ρ_t, is_cap)·A      (weight without gradient)
    ∇ℓ_t = − min(ρ_t, is_cap)·A·∇log π_θ

  (implemented as ``−sg(min(ρ, cap))·A·exp(logp − sg(logp))`` so the reported value is the
  truncated surrogate and the gradient is the truncated-IS policy gradient).

Clip-higher (DAPO): the upper clip bound ε_high (0.28) is wider than the lower ε_low (0.2), so
low-probability tokens with positive advantage can grow more per update, which keeps entropy
from collapsing. No KL penalty and no entropy bonus (rStar2-Agent, following DAPO).

Negative-advantage scale (``negative_advantage_scale``, default 1 = the paper's symmetric
GRPO): tokens of trajectories with A < 0 use ``s·A`` instead of ``A``. The update of a policy
gradient step is the sum of two parts, raising the rewarded samples ("positive sample
reinforcement") and lowering the unrewarded ones ("negative sample reinforcement"; Zhu et al.
2025, "The Surprising Effectiveness of Negative Reinforcement in LLM Reasoning"). With Adam,
the first part is small for a policy that already gives its correct samples high probability,
while pushing down a failed sample's improbable tokens is cheap and large, and shares
parameters with everything else. For a small policy this imbalance can dominate:
``bench/policy_update.py`` measures a 2M-parameter model whose pass rate on the trained batch's
problems falls after four steps with s = 1 and rises with s = 0 (docs/learner.md), and
``make demo``'s held-out pass@1 behaves alike over 40 steps (docs/orchestrator.md). Arnal et al.
2025 ("Asymmetric REINFORCE", arXiv 2506.20520) find the same for off-policy updates: a
baseline that weighs failures less is the stable one. s < 1 keeps the group-relative baseline
and only damps the push-down.

Token-mean: the loss of a step is Σ_t ℓ_t over every unmasked token of the *whole batch*
divided by the number of unmasked tokens of the whole batch — long responses weigh by their
token count, not 1/length per sequence. With gradient accumulation, each micro-batch passes
the step's total token count as ``num_tokens`` so the accumulated gradient is exactly the
gradient of the token-mean over the full batch.

Statistics are returned as sums (:class:`LossStats`) so micro-batches can be added up and
divided once per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Literal

import torch

Objective = Literal["decoupled", "tis"]

# Clip-higher bounds of DAPO / rStar2-Agent: ratio kept in [1 − 0.2, 1 + 0.28].
DEFAULT_CLIP_EPS_LOW = 0.2
DEFAULT_CLIP_EPS_HIGH = 0.28
# Truncation of the behaviour importance weight: 2.0 as in "truncated importance sampling"
# (Yao et al. 2025, FlashRL) — large enough to leave ordinary staleness uncorrected only in
# the tail, small enough that one badly off-policy token cannot dominate a batch.
DEFAULT_IS_CAP = 2.0


@dataclass(frozen=True)
class LossConfig:
    clip_eps_low: float = DEFAULT_CLIP_EPS_LOW
    clip_eps_high: float = DEFAULT_CLIP_EPS_HIGH
    objective: Objective = "decoupled"
    is_cap: float = DEFAULT_IS_CAP
    negative_advantage_scale: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.clip_eps_low < 1.0:
            raise ValueError(f"clip_eps_low must be in [0, 1), got {self.clip_eps_low}")
        if self.clip_eps_high < 0.0:
            raise ValueError(f"clip_eps_high must be ≥ 0, got {self.clip_eps_high}")
        if self.objective not in ("decoupled", "tis"):
            raise ValueError(f"objective must be 'decoupled' or 'tis', got {self.objective!r}")
        if self.is_cap <= 0.0:
            raise ValueError(f"is_cap must be > 0, got {self.is_cap}")
        if not 0.0 <= self.negative_advantage_scale <= 1.0:
            raise ValueError(f"negative_advantage_scale must be in [0, 1], got {self.negative_advantage_scale}")

    @property
    def needs_proximal(self) -> bool:
        return self.objective == "decoupled"

    def scaled_advantage(self, advantage: float | torch.Tensor) -> float | torch.Tensor:
        """The advantage the loss uses (one float, or a tensor of them): A < 0 multiplied by
        ``negative_advantage_scale``, A ≥ 0 as it is."""
        s = self.negative_advantage_scale
        if isinstance(advantage, torch.Tensor):
            return advantage if s == 1.0 else torch.where(advantage < 0, advantage * s, advantage)
        return advantage * s if advantage < 0 else advantage

    def carries_gradient(self, advantage: float) -> bool:
        """Whether a trajectory with this advantage contributes to the gradient at all.

        Every token's loss is a multiple of its scaled advantage, so a trajectory whose scaled
        advantage is 0 (A = 0, or A < 0 when ``negative_advantage_scale`` is 0) adds nothing but
        its tokens to the token-mean's denominator: the trainer counts them there and skips its
        forward and backward passes.
        """
        return self.scaled_advantage(advantage) != 0.0


@dataclass
class LossStats:
    """Per-token statistics, summed over the unmasked tokens seen so far.

    ``clip_low``/``clip_high``: tokens whose PPO clip is *binding* (the gradient of the token is
    zero because the ratio left the trust region in the direction the advantage pushes).
    ``is_weight_*``: the behaviour importance weight before truncation (decoupled: π_prox/μ,
    tis: π_θ/μ); ``is_truncated``: tokens where it exceeded the cap.
    ``kl_behav``: the k3 estimator of KL(μ ‖ π_θ) = E_μ[(ρ − 1) − log ρ], ρ = π_θ/μ.
    """

    tokens: float = 0.0
    loss_sum: float = 0.0
    clip_low: float = 0.0
    clip_high: float = 0.0
    is_weight_sum: float = 0.0
    is_weight_max: float = field(default=0.0, metadata={"reduce": "max"})
    is_truncated: float = 0.0
    kl_behav_sum: float = 0.0
    ratio_sum: float = 0.0

    def add(self, other: "LossStats") -> "LossStats":
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            setattr(self, f.name, max(mine, theirs) if f.metadata.get("reduce") == "max" else mine + theirs)
        return self

    def means(self) -> dict[str, float]:
        n = max(self.tokens, 1.0)
        return {
            "loss": self.loss_sum / n,
            "clip_frac_low": self.clip_low / n,
            "clip_frac_high": self.clip_high / n,
            "is_weight_mean": self.is_weight_sum / n,
            "is_weight_max": self.is_weight_max,
            "is_truncated_frac": self.is_truncated / n,
            "approx_kl_behav": self.kl_behav_sum / n,
            "ratio_mean": self.ratio_sum / n,
        }


def policy_loss(
    logp: torch.Tensor,
    logp_prox: torch.Tensor | None,
    logp_behav: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    config: LossConfig,
    num_tokens: float | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """The step's loss contribution of these tokens and their statistics.

    All tensors are 1-D over the same tokens (any subset of a batch). ``logp_prox`` may be
    None only for ``tis``. ``num_tokens`` is the number of unmasked tokens of the whole step
    (default: of these tokens), the token-mean denominator.
    """
    if not (logp.shape == logp_behav.shape == advantages.shape == loss_mask.shape):
        raise ValueError(
            f"shape mismatch: logp {tuple(logp.shape)}, behaviour {tuple(logp_behav.shape)}, "
            f"advantages {tuple(advantages.shape)}, mask {tuple(loss_mask.shape)}"
        )
    mask = loss_mask.to(torch.float32)
    n_here = float(mask.sum().item())
    denom = float(num_tokens) if num_tokens is not None else max(n_here, 1.0)
    if denom <= 0:
        raise ValueError(f"num_tokens must be > 0, got {num_tokens}")
    logp32 = logp.float()
    behav = logp_behav.float()
    adv = config.scaled_advantage(advantages.float())

    with torch.no_grad():
        log_rho = logp32.detach() - behav  # log π_θ/μ
        rho = torch.exp(log_rho)
        kl = torch.expm1(log_rho) - log_rho

    if config.objective == "decoupled":
        if logp_prox is None:
            raise ValueError("the decoupled objective needs the proximal logprobs")
        prox = logp_prox.float().detach()
        ratio = torch.exp(logp32 - prox)
        with torch.no_grad():
            raw_w = torch.exp(prox - behav)
            w = torch.clamp(raw_w, max=config.is_cap)
        surr_unclipped = ratio * adv
        surr_clipped = torch.clamp(ratio, 1.0 - config.clip_eps_low, 1.0 + config.clip_eps_high) * adv
        per_token = -w * torch.minimum(surr_unclipped, surr_clipped)
        with torch.no_grad():
            r = ratio.detach()
            clip_low = (adv < 0) & (r < 1.0 - config.clip_eps_low)
            clip_high = (adv > 0) & (r > 1.0 + config.clip_eps_high)
    elif config.objective == "tis":
        raw_w = rho
        w = torch.clamp(raw_w, max=config.is_cap)
        ratio = torch.exp(logp32 - logp32.detach())  # value 1, gradient ∇log π_θ
        per_token = -w * adv * ratio
        clip_low = clip_high = torch.zeros_like(mask, dtype=torch.bool)
        r = rho
    else:  # pragma: no cover - LossConfig validates
        raise ValueError(config.objective)

    loss = (per_token * mask).sum() / denom

    with torch.no_grad():
        on = mask > 0
        stats = LossStats(
            tokens=n_here,
            loss_sum=float((per_token.detach() * mask).sum().item()),
            clip_low=float((clip_low & on).sum().item()),
            clip_high=float((clip_high & on).sum().item()),
            is_weight_sum=float((raw_w * mask).sum().item()),
            is_weight_max=float(raw_w[on].max().item()) if n_here else 0.0,
            is_truncated=float(((raw_w > config.is_cap) & on).sum().item()),
            kl_behav_sum=float((kl * mask).sum().item()),
            ratio_sum=float((r * mask).sum().item()),
        )
    return loss, stats


def sft_loss(logp: torch.Tensor, loss_mask: torch.Tensor, *, num_tokens: float | None = None) -> tuple[torch.Tensor, float]:
    """Token-mean negative log-likelihood over unmasked tokens (stage-0 SFT); returns (loss, nll sum)."""
    mask = loss_mask.to(torch.float32)
    denom = float(num_tokens) if num_tokens is not None else max(float(mask.sum().item()), 1.0)
    nll = -(logp.float() * mask)
    return nll.sum() / denom, float(nll.detach().sum().item())
