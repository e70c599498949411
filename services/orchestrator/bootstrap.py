"""Bootstrap the embedded default policy: a tiny Llama trained by stage-0 SFT, cached on disk.

``bootstrap_tiny_model(cache_dir, minutes=8, seed=0)`` returns the directory of an HF model
that already writes the tool-use format (and gets some problems right), so RL has something
to improve. Steps, each deterministic given the settings:

1. ``shared.tiny_model.create_random_model`` → ``cache_dir/tiny-random-<hash>/`` (reused);
2. a stream of fresh generated training problems (``data.problem_stream(seed, "train")``: never
   an eval-partition problem) turned into traces and tokenised segment by segment
   (``sft_traces``) — every step trains on new problems, nothing is repeated;
3. supervised training through the learner's trainer (``services.learner.trainer.PolicyTrainer
   .sft_step``: token-mean NLL on loss-mask-1 tokens only, packed rows with per-sequence
   position ids, AdamW, linear warm-up then cosine decay);
4. the weights + the random model's config/tokenizer + ``bootstrap.json`` (settings, step
   metrics, optional eval) are written atomically to ``cache_dir/tiny-sft-<hash>/``.

Caching: ``<hash>`` is a digest of every setting that changes the result (including the
system prompt and ``FORMAT_VERSION``). A present directory is returned without training; a
file lock makes concurrent bootstraps of the same settings train once. Caveat: with a time
budget (``steps=None``) the number of steps comes from measuring the first steps on this
machine, so the same settings give the same *kind* of model on another machine, not the same
bytes; pass ``steps`` for bit-for-bit reproducible training.

Training time: ``minutes`` is the budget for the optimisation loop. The first
``CALIBRATION_STEPS`` steps are timed and fix ``total_steps`` (so the cosine schedule ends when
the budget does); warm-up is longer than the calibration, so the LR path is the same as if the
step count had been known in advance.

Scale (docs/data.md; PLATFORM.md's experiment): ~1.9M parameters, rows of 512 tokens (a
prompt with the system prompt is ~165 tokens, a response ~125), lr 2e-3; the loss plateaus
near 0.7 (format learned, digits random) before digit copying starts to work.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import random
import re
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared import chat_format as cf
from shared.checkpoint import atomic_directory, copy_model_files, save_weights
from shared.tiny_model import create_random_model, load_tokenizer

from services.orchestrator import data, sft_traces
from services.orchestrator.evaluate_metrics import SampleResult, summarize

# Bump when the trace format or the training recipe changes in a way the settings don't show:
# cached models of an older version are then not reused.
FORMAT_VERSION = 1
# Steps timed to size the cosine schedule to the time budget (fewer than warm-up steps).
CALIBRATION_STEPS = 3
BOOTSTRAP_INFO = "bootstrap.json"


@dataclass(frozen=True)
class BootstrapSettings:
    seed: int = 0
    minutes: float = 8.0
    steps: int | None = None  # fixed step count instead of a time budget (reproducible)
    # Model shape (shared/tiny_model.py; 6 heads of 32 because vLLM CPU has no head size 48).
    hidden: int = 192
    layers: int = 4
    heads: int = 6
    intermediate: int = 512
    max_position: int = 4096
    # Optimisation (PLATFORM.md's experiment: AdamW lr 2e-3, warm-up + cosine).
    lr: float = 2e-3
    min_lr_ratio: float = 0.05
    warmup_steps: int = 20
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    batch_sequences: int = 32  # traces per optimizer step (~9k tokens)
    row_tokens: int = 512  # packed row length: one prompt+response is ~290 tokens
    micro_batch_tokens: int = 4096
    threads: int = 0  # torch intra-op threads; 0 = leave torch's default

    def __post_init__(self) -> None:
        if self.steps is None and not self.minutes > 0:
            raise ValueError("minutes must be > 0 (or give steps)")
        if self.steps is not None and self.steps < 1:
            raise ValueError("steps must be >= 1")
        if self.batch_sequences < 1 or self.row_tokens < 1 or self.micro_batch_tokens < self.row_tokens:
            raise ValueError("batch_sequences, row_tokens must be >= 1 and micro_batch_tokens >= row_tokens")

    def model_kwargs(self) -> dict[str, int]:
        return dict(seed=self.seed, hidden=self.hidden, layers=self.layers, heads=self.heads,
                    intermediate=self.intermediate, max_position=self.max_position)

    def digest(self) -> str:
        """Hash of everything that determines the trained model (not ``threads``)."""
        fields = dataclasses.asdict(self)
        fields.pop("threads")
        if fields["steps"] is not None:
            fields.pop("minutes")  # a fixed step count makes the time budget irrelevant
        fields["format_version"] = FORMAT_VERSION
        fields["system_prompt"] = cf.SYSTEM_PROMPT
        fields["buggy_fraction"] = sft_traces.BUGGY_FRACTION
        blob = json.dumps(fields, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def random_model_dir(cache_dir: Path, s: BootstrapSettings) -> Path:
    blob = json.dumps(s.model_kwargs(), sort_keys=True).encode()
    return cache_dir / f"tiny-random-{hashlib.sha256(blob).hexdigest()[:12]}"


def sft_model_dir(cache_dir: Path, s: BootstrapSettings) -> Path:
    return cache_dir / f"tiny-sft-{s.digest()}"


# --------------------------------------------------------------------------- data


def training_sequences(seed: int, tokenizer) -> Iterator[Any]:
    """Endless ``TrainSequence`` stream from fresh train-partition problems."""
    from services.learner.packing import TrainSequence

    problems = data.problem_stream(seed, split="train")
    rng = random.Random(f"bootstrap-traces:{seed}")
    for problem in problems:
        tok = sft_traces.tokenize_trace(sft_traces.make_trace(problem, rng), tokenizer)
        yield TrainSequence(prompt_ids=tok.prompt_token_ids, response_ids=tok.response_token_ids,
                            loss_mask=tok.loss_mask)


# --------------------------------------------------------------------------- training


@dataclass
class TrainReport:
    steps: int
    seconds: float
    tokens: int
    loss_tokens: int
    first_loss: float
    final_loss: float  # mean over the last 10 steps
    tokens_per_s: float
    history: list[dict[str, float]]


def train_sft(model_dir: Path, s: BootstrapSettings, *, log: Callable[[dict[str, float]], None] | None = None):
    """Train from ``model_dir`` with the learner's trainer; returns (model, report)."""
    import torch

    from services.learner.trainer import PolicyTrainer, TrainerConfig, load_model

    if s.threads:
        torch.set_num_threads(s.threads)
    torch.manual_seed(s.seed)
    tokenizer = load_tokenizer(model_dir)
    model = load_model(model_dir, torch.device("cpu"))
    planned = s.steps if s.steps is not None else 10**9  # fixed after calibration
    cfg = TrainerConfig(lr=s.lr, warmup_steps=s.warmup_steps, schedule="cosine", total_steps=planned,
                        min_lr_ratio=s.min_lr_ratio, weight_decay=s.weight_decay, grad_clip=s.grad_clip,
                        micro_batch_tokens=s.micro_batch_tokens, row_tokens=s.row_tokens)
    trainer = PolicyTrainer(model, cfg, pad_id=tokenizer.pad_token_id)
    stream = training_sequences(s.seed, tokenizer)
    budget_s = s.minutes * 60.0
    history: list[dict[str, float]] = []
    t0 = time.perf_counter()
    step = 0
    while step < planned:
        batch = [next(stream) for _ in range(s.batch_sequences)]
        metrics = trainer.sft_step(batch)
        step += 1
        elapsed = time.perf_counter() - t0
        record = {"step": float(step), "elapsed_s": elapsed, **metrics}
        history.append(record)
        if log:
            log(record)
        if s.steps is None and step == CALIBRATION_STEPS:
            per_step = elapsed / step
            planned = max(step + 1, int(budget_s / per_step))
            # The schedule reads cfg.total_steps; until now only warm-up was used, which does
            # not depend on it (CALIBRATION_STEPS < warmup_steps keeps the LR path unchanged).
            trainer.cfg = dataclasses.replace(cfg, total_steps=planned)
        if s.steps is None and step >= CALIBRATION_STEPS and elapsed > budget_s * 1.25:
            break  # the machine got slower than calibrated (shared cores): respect the budget
    seconds = time.perf_counter() - t0
    tokens = int(sum(h["tokens"] for h in history))
    tail = history[-10:]
    report = TrainReport(
        steps=step, seconds=seconds, tokens=tokens,
        loss_tokens=int(sum(h["loss_tokens"] for h in history)),
        first_loss=history[0]["loss"], final_loss=sum(h["loss"] for h in tail) / len(tail),
        tokens_per_s=tokens / seconds if seconds > 0 else 0.0, history=history,
    )
    return model, report


# --------------------------------------------------------------------------- evaluation

_BOXED_INT = re.compile(r"\\boxed\{\s*(-?\d+)\s*\}")
# Limits for running the model's own code during bootstrap evaluation (a subprocess, not the
# sandboxed tool executor: only our freshly trained tiny model writes this code).
EVAL_CODE_TIMEOUT_S = 5.0
EVAL_CODE_MEMORY_BYTES = 1 << 30


def _limit_child() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (EVAL_CODE_MEMORY_BYTES, EVAL_CODE_MEMORY_BYTES))
    resource.setrlimit(resource.RLIMIT_CPU, (int(EVAL_CODE_TIMEOUT_S) + 1, int(EVAL_CODE_TIMEOUT_S) + 1))


def run_model_code(code: str) -> tuple[bool, str]:
    """Run model-written code in an isolated child interpreter with CPU/memory/time limits."""
    with tempfile.TemporaryDirectory(prefix="rstar-eval-") as cwd:
        try:
            proc = subprocess.run([sys.executable, "-I", "-c", code], cwd=cwd, capture_output=True,
                                  text=True, timeout=EVAL_CODE_TIMEOUT_S, preexec_fn=_limit_child,
                                  env={"PATH": os.environ.get("PATH", "")})
        except subprocess.TimeoutExpired:
            return False, f"TimeoutError: execution exceeded {EVAL_CODE_TIMEOUT_S:g} s"
    return proc.returncode == 0, sft_traces.tool_output_text(proc.stdout, proc.stderr)


def extract_int_answer(text: str) -> str | None:
    start = text.rfind(cf.ANSWER_START)
    if start < 0:
        return None
    found = _BOXED_INT.findall(text[start:])
    return str(int(found[-1])) if found else None


def evaluate_greedy(model, tokenizer, problems: list[data.Problem], *, max_tokens: int = 320,
                    max_turns: int = 4) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Greedy agent loop with HF ``generate`` (one problem at a time): metrics and samples."""
    import torch

    stop_ids = [tokenizer.convert_tokens_to_ids(cf.TOOL_CALL_END), tokenizer.eos_token_id]
    model.eval()
    results, samples = [], []
    for problem in problems:
        prompt = tokenizer.encode(cf.render_prompt(problem.prompt), add_special_tokens=False)
        response: list[int] = []
        text, calls, good = "", 0, 0
        for _ in range(max_turns):
            budget = max_tokens - len(response)
            if budget <= 0:
                break
            with torch.no_grad():
                out = model.generate(torch.tensor([prompt + response]), max_new_tokens=budget, do_sample=False,
                                     eos_token_id=stop_ids, pad_token_id=tokenizer.pad_token_id,
                                     use_cache=True)
            new = out[0, len(prompt) + len(response):].tolist()
            response += new
            piece = tokenizer.decode(new)
            text += piece
            if not new or new[-1] != stop_ids[0]:
                break  # <|im_end|> or budget exhausted
            calls += 1
            parsed = cf.parse_tool_call(piece)
            if parsed.ok:
                good += 1
                _, output = run_model_code(parsed.code)
            else:
                output = f"Error: {parsed.error}"
            tool = cf.format_tool_response(output)
            response += tokenizer.encode(tool, add_special_tokens=False)
            text += tool
        predicted = extract_int_answer(text)
        results.append(SampleResult(problem.problem_id, predicted == problem.answer, len(response), calls, good,
                                    answered=cf.ANSWER_START in text))
        samples.append({"problem_id": problem.problem_id, "answer": problem.answer, "predicted": predicted,
                        "response": text})
    return summarize(results), samples


# --------------------------------------------------------------------------- the entry point


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def bootstrap_tiny_model(cache_dir: str | Path, *, minutes: float = 8.0, seed: int = 0,
                         steps: int | None = None, eval_problems: int = 0,
                         log: Callable[[dict[str, float]], None] | None = None,
                         **overrides: Any) -> Path:
    """The stage-0 SFT model for these settings: from the cache, or trained now and cached.

    ``overrides`` are further :class:`BootstrapSettings` fields. ``eval_problems`` > 0 also
    runs a greedy evaluation on that many held-out (eval-partition) problems after training
    and records it in ``bootstrap.json`` (not part of the cache key).
    """
    import torch

    from services.learner.checkpoints import weights_state_dict

    cache = Path(cache_dir)
    s = BootstrapSettings(seed=seed, minutes=minutes, steps=steps, **overrides)
    final = sft_model_dir(cache, s)
    if (final / BOOTSTRAP_INFO).is_file():
        return final
    with _file_lock(cache / f".{final.name}.lock"):
        if (final / BOOTSTRAP_INFO).is_file():  # another process finished it meanwhile
            return final
        base = create_random_model(random_model_dir(cache, s), **s.model_kwargs())
        model, report = train_sft(base, s, log=log)
        info: dict[str, Any] = {
            "settings": dataclasses.asdict(s), "digest": s.digest(), "format_version": FORMAT_VERSION,
            "base_model": str(base),
            "train": {k: v for k, v in dataclasses.asdict(report).items() if k != "history"},
            "loss_curve": [(int(h["step"]), round(h["loss"], 4)) for h in report.history],
        }
        if eval_problems > 0:
            tokenizer = load_tokenizer(base)
            problems = data.generate_problems(eval_problems, seed=seed, split="eval")
            metrics, samples = evaluate_greedy(model, tokenizer, problems)
            info["eval_greedy"] = metrics
            info["eval_examples"] = samples[:5]
        with atomic_directory(final) as tmp:
            copy_model_files(base, tmp)
            (tmp / "tiny_model.json").unlink(missing_ok=True)  # describes the random init, not this
            with torch.no_grad():
                save_weights(weights_state_dict(model), tmp)
            (tmp / BOOTSTRAP_INFO).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
    return final


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description="Train (or reuse) the stage-0 SFT tiny model.")
    parser.add_argument("cache_dir")
    parser.add_argument("--minutes", type=float, default=8.0)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-problems", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args(argv)

    def log(r: dict[str, float]) -> None:
        if int(r["step"]) % 10 == 0 or int(r["step"]) <= 3:
            print(json.dumps({k: round(v, 4) for k, v in r.items() if k in
                              ("step", "elapsed_s", "loss", "lr", "tokens_per_s", "grad_norm")}), flush=True)

    path = bootstrap_tiny_model(args.cache_dir, minutes=args.minutes, seed=args.seed, steps=args.steps,
                                eval_problems=args.eval_problems, threads=args.threads, log=log)
    info = json.loads((path / BOOTSTRAP_INFO).read_text())
    print(json.dumps({"model_dir": str(path), "train": info["train"], "eval_greedy": info.get("eval_greedy")}))


if __name__ == "__main__":
    main()

