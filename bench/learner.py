"""Learner throughput: training tokens per second (and MFU on GPUs).

What is measured (each after warm-up steps that are not timed):

* ``fwd_bwd``  — the learner's forward + backward + AdamW step on a GRPO batch: packed rows,
  chunked output-layer log-probabilities on the response tokens only, the GRPO-RoC loss
  (``PolicyTrainer.train_step`` with one update per step: the proximal log-probabilities come
  from the same forward);
* ``grpo_step`` — the whole GRPO step *with* a separate no-grad proximal log-prob pass first
  (``force_proximal_pass``: what a step with more than one update per step costs);
* ``hf_baseline`` — a plain Hugging Face loop on the same tokens: ``model(input_ids,
  labels=...)`` (full-vocabulary logits, HF's cross-entropy), gradient checkpointing on GPUs,
  AdamW (fused on GPUs) — the reference the learner is compared against.

Tokens are all tokens fed through the model (prompt + response) per second of wall time.
MFU = tokens/s × FLOPs per token / peak FLOP/s, with FLOPs per token = 6·N (N = parameters
taking part in matmuls, incl. the output layer) + 6·L·H·S (causal attention, forward + backward,
S = sequence length); peak = 989 TFLOP/s (H100/H200 SXM dense bf16) unless --peak-tflops.

Default (CPU): ``lab.tiny_model``'s default tiny Llama (~1.9M parameters, 512 vocabulary), fp32,
sequences of ~512 tokens. ``--gpu``: random-initialised Qwen2-0.5B- and 1.5B-shaped models
(bf16 autocast, sdpa) at 4K and 8K tokens per sequence on CUDA/ROCm; needs only torch and
transformers (no vLLM). ``--gpu-dry-run`` runs the GPU code path on the CPU with toy shapes (to
check the script without a GPU).

The last line of output is one JSON object with the headline figures:
``cpu_tiny_tokens_per_s`` (learner fwd+bwd+step, tiny model, CPU) and, with ``--gpu``,
``gpu_0p5b_4k_tokens_per_s``, ``gpu_1p5b_4k_tokens_per_s`` (+ ``_mfu``, ``_hf_baseline``,
``_grpo_step`` and the 8K figures).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from services.learner.loss import LossConfig  # noqa: E402
from services.learner.packing import TrainSequence  # noqa: E402
from services.learner.trainer import PolicyTrainer, TrainerConfig  # noqa: E402

H200_PEAK_TFLOPS = 989.0

QWEN2_SHAPES = {
    # Qwen2-0.5B / Qwen2-1.5B architecture (random weights): hidden, layers, heads, kv heads, MLP
    "0p5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True),
    "1p5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                 intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True),
}
TOY_SHAPES = {
    "0p5b": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=1000, tie_word_embeddings=True),
    "1p5b": dict(hidden_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=192, vocab_size=1000, tie_word_embeddings=True),
}


def grpo_batch(n_seqs: int, seq_len: int, vocab: int, prompt_frac: float = 0.25, seed: int = 0) -> list[TrainSequence]:
    """Sequences of exactly ``seq_len`` tokens: a prompt, then a response with a tool span (mask 0)."""
    rng = random.Random(seed)
    out = []
    for i in range(n_seqs):
        p = max(1, int(seq_len * prompt_frac))
        r = seq_len - p
        mask = [0 if (r // 3) <= j < (r // 3 + r // 10) else 1 for j in range(r)]
        out.append(TrainSequence(
            prompt_ids=[rng.randrange(vocab) for _ in range(p)],
            response_ids=[rng.randrange(vocab) for _ in range(r)],
            loss_mask=mask,
            behaviour_logprobs=[-rng.uniform(1.0, 12.0) * m for m in mask],
            advantage=1.0 if i % 2 else -1.0,
        ))
    return out


def matmul_params(model: torch.nn.Module) -> int:
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    total = sum(p.numel() for p in model.parameters())
    # The input embedding is a lookup; a tied output layer is the same tensor, counted once above.
    return total if head.data_ptr() == emb.data_ptr() else total - emb.numel()


def flops_per_token(model: torch.nn.Module, seq_len: int) -> float:
    cfg = model.config
    return 6.0 * matmul_params(model) + 6.0 * cfg.num_hidden_layers * cfg.hidden_size * seq_len


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_steps(fn, device: torch.device, warmup: int, steps: int) -> float:
    for _ in range(warmup):
        fn()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    _sync(device)
    return (time.perf_counter() - t0) / steps


def bench_learner(model, seqs, device, *, micro_batch_tokens, row_tokens, proximal: bool, warmup: int, steps: int,
                  chunk: int = 1024, gradient_checkpointing: bool = False) -> float:
    cfg = TrainerConfig(lr=1e-6, warmup_steps=0, micro_batch_tokens=micro_batch_tokens, row_tokens=row_tokens,
                        logits_chunk_tokens=chunk, force_proximal_pass=proximal,
                        gradient_checkpointing=gradient_checkpointing, loss=LossConfig())
    trainer = PolicyTrainer(model, cfg)
    tokens = sum(len(s) for s in seqs)
    per_step = time_steps(lambda: trainer.train_step(seqs), device, warmup, steps)
    del trainer
    return tokens / per_step


def bench_hf_baseline(model, seqs, device, *, rows_per_micro_batch: int, warmup: int, steps: int,
                      gradient_checkpointing: bool) -> float:
    """Plain HF: padded [rows, len] batches, labels with -100 on prompt/tool tokens, model's own loss."""
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    kwargs = {"fused": True} if device.type == "cuda" else {}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, **kwargs)
    batches = []
    for i in range(0, len(seqs), rows_per_micro_batch):
        chunk = seqs[i : i + rows_per_micro_batch]
        width = max(len(s) for s in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        labels = torch.full((len(chunk), width), -100, dtype=torch.long)
        for r, s in enumerate(chunk):
            toks = s.prompt_ids + s.response_ids
            ids[r, : len(toks)] = torch.tensor(toks)
            p = len(s.prompt_ids)
            for j, m in enumerate(s.loss_mask):
                if m:
                    labels[r, p + j] = s.response_ids[j]
        batches.append((ids.to(device), labels.to(device)))
    autocast = torch.autocast(device_type="cuda", dtype=torch.bfloat16) if device.type == "cuda" else None

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        for ids, labels in batches:
            if autocast is not None:
                with autocast:
                    loss = model(input_ids=ids, labels=labels, use_cache=False).loss
            else:
                loss = model(input_ids=ids, labels=labels, use_cache=False).loss
            (loss / len(batches)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    tokens = sum(len(s) for s in seqs)
    per_step = time_steps(step, device, warmup, steps)
    if gradient_checkpointing:
        model.gradient_checkpointing_disable()
    del opt
    return tokens / per_step


def cpu_tiny(args) -> dict[str, float]:
    import tempfile

    from lab.tiny_model import create_random_model

    from transformers import AutoModelForCausalLM

    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = create_random_model(Path(tempfile.mkdtemp(prefix="bench-learner-")) / "tiny", seed=0)
    device = torch.device("cpu")
    seqs = grpo_batch(args.cpu_seqs, args.cpu_seq_len, vocab=512)

    def fresh():
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="sdpa")

    # The CPU is shared (other jobs come and go): the three measurements are interleaved over
    # several rounds and each keeps its best round, so a busy moment does not pick the winner.
    rows = max(1, args.cpu_micro_batch_tokens // args.cpu_seq_len)
    runs = {
        "cpu_tiny_tokens_per_s": lambda: bench_learner(
            fresh(), seqs, device, micro_batch_tokens=args.cpu_micro_batch_tokens, row_tokens=args.cpu_seq_len,
            proximal=False, warmup=args.warmup, steps=args.steps),
        "cpu_tiny_grpo_step_tokens_per_s": lambda: bench_learner(
            fresh(), seqs, device, micro_batch_tokens=args.cpu_micro_batch_tokens, row_tokens=args.cpu_seq_len,
            proximal=True, warmup=args.warmup, steps=args.steps),
        "cpu_tiny_hf_baseline_tokens_per_s": lambda: bench_hf_baseline(
            fresh(), seqs, device, rows_per_micro_batch=rows, warmup=args.warmup, steps=args.steps,
            gradient_checkpointing=False),
    }
    out: dict[str, float] = {}
    for _ in range(args.rounds):
        for key, run in runs.items():
            out[key] = max(out.get(key, 0.0), run())
    print(f"CPU tiny model ({sum(p.numel() for p in fresh().parameters()) / 1e6:.2f}M params, "
          f"{args.cpu_seqs} x {args.cpu_seq_len} tokens/step, {torch.get_num_threads()} threads): "
          f"learner {out['cpu_tiny_tokens_per_s']:.0f} tok/s, with proximal pass "
          f"{out['cpu_tiny_grpo_step_tokens_per_s']:.0f} tok/s, plain HF {out['cpu_tiny_hf_baseline_tokens_per_s']:.0f} tok/s")
    return out


def gpu(args, dry_run: bool) -> dict[str, float]:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    device = torch.device("cpu" if dry_run else "cuda")
    shapes = TOY_SHAPES if dry_run else QWEN2_SHAPES
    lengths = [128] if dry_run else args.seq_lens
    tokens_per_step = 512 if dry_run else args.gpu_tokens_per_step
    micro = 256 if dry_run else args.gpu_micro_batch_tokens
    out: dict[str, float] = {}
    for name in args.models:
        for seq_len in lengths:
            n_seqs = max(1, tokens_per_step // seq_len)
            seqs = grpo_batch(n_seqs, seq_len, vocab=shapes[name]["vocab_size"])
            tag = f"gpu_{name}_{seq_len // 1024 if not dry_run else seq_len}{'k' if not dry_run else ''}"
            cfg = Qwen2Config(**shapes[name], max_position_embeddings=max(32768, seq_len),
                              attn_implementation=args.attn, use_cache=False)

            def fresh():
                torch.manual_seed(0)
                with torch.device(device):
                    m = Qwen2ForCausalLM(cfg)
                return m.to(torch.float32)

            model = fresh()
            fpt = flops_per_token(model, seq_len)
            peak = args.peak_tflops * 1e12
            mb = max(micro, seq_len)
            try:
                res = bench_learner(model, seqs, device, micro_batch_tokens=mb, row_tokens=seq_len, proximal=False,
                                    warmup=args.warmup, steps=args.steps, chunk=args.chunk,
                                    gradient_checkpointing=args.gradient_checkpointing)
                out[f"{tag}_grpo_step_tokens_per_s"] = bench_learner(
                    model, seqs, device, micro_batch_tokens=mb, row_tokens=seq_len, proximal=True, warmup=1,
                    steps=args.steps, chunk=args.chunk, gradient_checkpointing=args.gradient_checkpointing)
            except torch.OutOfMemoryError as exc:  # report it and go on with the next configuration
                print(f"{tag}: learner out of memory at {mb} tokens per micro-batch "
                      f"(try --gpu-micro-batch-tokens {mb // 2} or --gradient-checkpointing): {exc}", flush=True)
                res = float("nan")
                out[f"{tag}_grpo_step_tokens_per_s"] = float("nan")
            out[f"{tag}_tokens_per_s"] = res
            out[f"{tag}_mfu"] = res * fpt / peak
            del model
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            try:
                base = bench_hf_baseline(fresh(), seqs, device, rows_per_micro_batch=max(1, mb // seq_len),
                                         warmup=args.warmup, steps=args.steps, gradient_checkpointing=True)
                out[f"{tag}_hf_baseline_tokens_per_s"] = base
                out[f"{tag}_speedup_vs_hf"] = res / base
            except torch.OutOfMemoryError:  # the baseline's full logits may not fit; say so
                out[f"{tag}_hf_baseline_tokens_per_s"] = float("nan")
                out[f"{tag}_speedup_vs_hf"] = float("nan")
            gc.collect()
            if device.type == "cuda":
                out[f"{tag}_peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
                torch.cuda.reset_peak_memory_stats()
                torch.cuda.empty_cache()
            print(f"{tag}: learner {res:.0f} tok/s (MFU {out[f'{tag}_mfu']:.1%}), whole GRPO step with proximal pass "
                  f"{out[f'{tag}_grpo_step_tokens_per_s']:.0f} tok/s, plain HF {out[f'{tag}_hf_baseline_tokens_per_s']:.0f} tok/s",
                  flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpu", action="store_true", help="benchmark Qwen2-0.5B/1.5B shapes on the GPU")
    ap.add_argument("--gpu-dry-run", action="store_true", help="run the --gpu code path on the CPU with toy shapes")
    ap.add_argument("--no-cpu", action="store_true", help="skip the CPU tiny-model benchmark")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=2, help="CPU: interleaved rounds, best kept")
    ap.add_argument("--cpu-seqs", type=int, default=16)
    ap.add_argument("--cpu-seq-len", type=int, default=512)
    ap.add_argument("--cpu-micro-batch-tokens", type=int, default=4096)
    ap.add_argument("--models", nargs="+", default=["0p5b", "1p5b"], choices=list(QWEN2_SHAPES))
    ap.add_argument("--seq-lens", nargs="+", type=int, default=[4096, 8192])
    ap.add_argument("--gpu-tokens-per-step", type=int, default=65536)
    ap.add_argument("--gpu-micro-batch-tokens", type=int, default=16384)
    ap.add_argument("--chunk", type=int, default=2048, help="logit rows per chunk")
    ap.add_argument("--attn", default="sdpa")
    ap.add_argument("--gradient-checkpointing", action="store_true", help="learner with activation recomputation")
    ap.add_argument("--peak-tflops", type=float, default=H200_PEAK_TFLOPS)
    args = ap.parse_args()

    result: dict[str, float] = {}
    if not args.no_cpu:
        result.update(cpu_tiny(args))
    if args.gpu or args.gpu_dry_run:
        if args.gpu and not torch.cuda.is_available():
            raise SystemExit("--gpu: torch sees no GPU (use --gpu-dry-run to check the code path on the CPU)")
        result.update(gpu(args, dry_run=not args.gpu))
        if args.gpu:
            result["gpu_name"] = torch.cuda.get_device_name(0)  # type: ignore[assignment]
    print("Headline figures (tokens/s = prompt+response tokens trained per second; mfu = fraction of peak bf16):")
    def fmt(v):
        if not isinstance(v, float):
            return v
        if v != v:  # NaN (out of memory) → null in JSON
            return None
        return round(v, 4) if v < 10 else round(v, 1)

    print(json.dumps({k: fmt(v) for k, v in result.items()}))


if __name__ == "__main__":
    main()
