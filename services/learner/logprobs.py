"""Token log-probabilities from hidden states, computed in chunks of tokens.

The output layer of a 150K-vocabulary model turns 8K tokens into 8K × 150K fp32 logits
(~5 GB) — more than the rest of the step's activations. :func:`chunked_token_logprobs`
never holds more than ``chunk_tokens`` rows of logits: the forward keeps only the selected
log-probability (and the entropy, for metrics) of each token, and the backward recomputes each
chunk's logits and forms its gradient in place, ``∂log p(y)/∂z = onehot(y) − softmax(z)``, so
autograd never stores logits at all. The matmuls run in the hidden states' dtype (bf16 under
autocast on GPUs); log-softmax runs in fp32. The weight's gradient is accumulated in fp32.
"""

from __future__ import annotations

import torch

# Rows of logits materialised at once: 1024 × 152K vocab × 4 B ≈ 0.6 GB per buffer (the
# backward holds ~3 such buffers); for a 512-token vocabulary it is negligible.
DEFAULT_CHUNK_TOKENS = 1024


class _ChunkedLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int):  # type: ignore[override]
        n = hidden.shape[0]
        acc = torch.promote_types(hidden.dtype, torch.float32)  # fp32, or fp64 for gradcheck
        logp = torch.empty(n, dtype=acc, device=hidden.device)
        entropy = torch.empty(n, dtype=acc, device=hidden.device)
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            w = weight.to(hidden.dtype)
            for s in range(0, n, chunk):
                e = min(s + chunk, n)
                logits = (hidden[s:e] @ w.T).to(acc)
                lse = torch.logsumexp(logits, dim=-1)
                logp[s:e] = logits.gather(1, targets[s:e, None]).squeeze(1) - lse
                probs = torch.exp(logits - lse[:, None])
                entropy[s:e] = lse - (probs * logits).sum(-1)
                del logits, probs
        ctx.save_for_backward(hidden, weight, targets)
        ctx.chunk = chunk
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: torch.Tensor, _grad_entropy: torch.Tensor):  # type: ignore[override]
        hidden, weight, targets = ctx.saved_tensors
        chunk = ctx.chunk
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        acc = torch.promote_types(hidden.dtype, torch.float32)
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        n = hidden.shape[0]
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            w = weight.to(hidden.dtype)
            for s in range(0, n, chunk):
                e = min(s + chunk, n)
                h = hidden[s:e]
                logits = (h @ w.T).to(acc)
                g = grad_logp[s:e].to(acc)
                grad_logits = torch.softmax(logits, dim=-1).mul_(-g[:, None])
                del logits
                grad_logits.scatter_add_(1, targets[s:e, None], g[:, None])
                gl = grad_logits.to(hidden.dtype)
                del grad_logits
                if need_h:
                    grad_h[s:e] = gl @ w
                if need_w:
                    grad_w += (gl.T @ h).to(acc)
        return grad_h, (grad_w.to(weight.dtype) if need_w else None), None, None


def chunked_token_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_tokens: int = DEFAULT_CHUNK_TOKENS
) -> tuple[torch.Tensor, torch.Tensor]:
    """log softmax(hidden @ weightᵀ)[target] per row (fp32, differentiable) and the entropy (no grad).

    ``hidden`` [N, H], ``weight`` [V, H] (the output embedding, no bias), ``targets`` [N] int64.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"bad shapes: hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets {tuple(targets.shape)} do not match hidden {tuple(hidden.shape)}")
    if chunk_tokens <= 0:
        raise ValueError("chunk_tokens must be > 0")
    return _ChunkedLogprob.apply(hidden, weight, targets.long(), int(chunk_tokens))
