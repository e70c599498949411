"""Bootstrap the embedded default policy: a tiny Llama trained by stage-0 SFT, cached on disk.

``bootstrap_tiny_model(cache_dir, minutes=8, seed=0)`` returns the directory of an HF model
that already writes the tool-use format (and gets some problems right), so RL has something
to improve. Steps:

1. ``lab.tiny_model.create_random_model`` → ``cache_dir/tiny-random-<hash>/`` (reused);
2. ``n_traces`` fresh generated training problems (``data.generate_problems(seed, "train")``:
   never an eval-partition problem) turned into traces and tokenised segment by segment
   (``sft_traces``) into a JSONL file — the contract with the learner;
3. supervised training by the learner's ``services.learner.sft.train_sft`` (token-mean NLL on
   loss-mask-1 tokens only, packed rows with per-sequence position ids, AdamW, linear warm-up
   then cosine decay on elapsed time — or over ``steps`` when given);
4. ``bootstrap.json`` (settings, training figures, loss curve, optional greedy eval) is added
   and the directory is renamed to ``cache_dir/tiny-sft-<hash>/`` (atomic: a reader never sees
   a partial model under the final name).

Caching: ``<hash>`` is a digest of every setting that changes the result (including the
system prompt and ``FORMAT_VERSION``). A present directory is returned without training; a
file lock makes concurrent bootstraps of the same settings train once. Caveat: with a time
budget (``steps=None``) the number of steps depends on this machine's speed (and on whatever
else runs on it). ``steps`` makes training bit-for-bit reproducible on one machine, not across
machines: most likely another CPU's floating-point kernels differ in the last bits, and this
training amplifies that near the step where digit copying forms (the demo's settings sampled
pass@1 0.62 on one machine and 0.21 on another, docs/data.md). Another machine gets the same
*kind* of model, not the same bytes.

Scale (docs/data.md): 0.92M parameters (PLATFORM.md's experiment used 1.87M), 4096-token
steps in rows of 256 (a prompt with the system prompt is ~165 tokens, a response ~125), lr
2e-3; the loss plateaus near 0.5-0.7 (format learned, digits random) before digit copying starts
to work, between steps ~450 and ~650 of the demo's 700 since the generated problems draw short
copies as often as long ones (~600 to ~1000 of 1100 steps before that).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.formats import ConversationFormat, ToolResult, get_preset, load_format
from shared.checkpoint import TMP_PREFIX, CheckpointError, fsync_tree
from lab.tiny_model import create_random_model

# The tiny model's prompt preset (shared/formats/presets.py): a one-sentence system prompt.
PRESET = "compact"

from shared.datasets import generated as data, sft_traces
from lab.evaluate_metrics import SampleResult, summarize

# Bump when the trace format or the training recipe changes in a way the settings don't show:
# cached models of an older version are then not reused.
FORMAT_VERSION = 6
BOOTSTRAP_INFO = "bootstrap.json"


@dataclass(frozen=True)
class BootstrapSettings:
    seed: int = 0
    minutes: float = 8.0
    steps: int | None = None  # fixed step count instead of a time budget (reproducible)
    # Model shape (lab/tiny_model.py; heads of 32, a head size vLLM's CPU backend has).
    # 0.92M parameters: 128 wide with 4 layers reached the same loss (0.06) and sampled pass@1
    # (0.19) after 1100 steps as 192 wide with 6 heads and intermediate 512 (1.87M), in 58 % of
    # the time (0.86 against 1.43 s a step on two AVX2 cores; docs/data.md).
    hidden: int = 128
    layers: int = 4
    heads: int = 4
    intermediate: int = 384
    max_position: int = 4096
    # Optimisation (PLATFORM.md's experiment: AdamW lr 2e-3, warm-up + cosine).
    lr: float = 2e-3
    min_lr_ratio: float = 0.05
    # Warm-up in steps (the cosine runs on elapsed time): short, a 12-minute budget is ~600 steps.
    warmup_steps: int = 10
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    # Tokens per optimizer step (~16 traces + 16 drills). Measured on 2 cores (docs/data.md):
    # 4096-token steps learned copying faster per minute than 8192 (half the steps) and than
    # 1024 (per-step overhead, noisier).
    batch_tokens: int = 4096
    # Rows of 256 tokens: a trace (~200 tokens with the short system prompt) or a few drills per
    # row; short rows keep attention cheap on the CPU. One micro-batch per step.
    row_tokens: int = 256
    micro_batch_tokens: int = 4096
    # Distinct training traces (the learner shuffles them per epoch): 16k traces are ~4.6M
    # tokens, more than an 18-minute run at 3k tokens/s sees, so a default run is < 1 epoch.
    n_traces: int = 16_000
    # Copy drills mixed in (sft_traces.make_copy_drill): 1.5 per trace, ~1/6 of the tokens.
    # Without them digit copying had not formed after 12-30 minutes (0% solved); with 16k
    # single-number drills answer copying formed but copying into code lagged; 24k drills, half
    # of them expressions, got both (docs/data.md).
    copy_drills: int = 24_000
    threads: int = 0  # torch intra-op threads; 0 = leave torch's default

    def __post_init__(self) -> None:
        if self.steps is None and not self.minutes > 0:
            raise ValueError("minutes must be > 0 (or give steps)")
        if self.steps is not None and self.steps < 1:
            raise ValueError("steps must be >= 1")
        if self.copy_drills < 0:
            raise ValueError("copy_drills must be >= 0")
        if self.n_traces < 1 or self.batch_tokens < 1 or self.row_tokens < 1 or self.micro_batch_tokens < self.row_tokens:
            raise ValueError("n_traces, batch_tokens, row_tokens must be >= 1 and micro_batch_tokens >= row_tokens")

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
        fields["system_prompt"] = get_preset(PRESET).system
        fields["buggy_fraction"] = sft_traces.BUGGY_FRACTION
        blob = json.dumps(fields, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def random_model_dir(cache_dir: Path, s: BootstrapSettings) -> Path:
    from lab.tiny_model import CHAT_TEMPLATE

    # The template is part of the key: a cached model from before it had one is not reused.
    blob = json.dumps({**s.model_kwargs(), "chat_template": CHAT_TEMPLATE}, sort_keys=True).encode()
    return cache_dir / f"tiny-random-{hashlib.sha256(blob).hexdigest()[:12]}"


def sft_model_dir(cache_dir: Path, s: BootstrapSettings) -> Path:
    return cache_dir / f"tiny-sft-{s.digest()}"


# --------------------------------------------------------------------------- data


def write_training_traces(path: Path, s: BootstrapSettings, fmt: ConversationFormat) -> Path:
    """``s.n_traces`` tokenised traces of fresh train-partition problems and ``s.copy_drills``
    copy drills, as learner JSONL rows (the learner shuffles them together)."""
    problems = data.generate_problems(s.n_traces, seed=s.seed, split="train")
    traces = sft_traces.make_traces(problems, seed=s.seed) + sft_traces.make_copy_drills(s.copy_drills, seed=s.seed)
    return sft_traces.write_traces_jsonl(traces, fmt, path)


# --------------------------------------------------------------------------- training


def train(base: Path, traces: Path, out: Path, s: BootstrapSettings,
          log: Callable[[dict[str, float]], None] | None = None):
    """Run the learner's SFT on ``traces`` from ``base``; the model is written to ``out``."""
    from services.learner.sft import train_sft

    return train_sft(
        base, traces, out,
        steps=s.steps, time_budget_s=None if s.steps is not None else s.minutes * 60.0,
        lr=s.lr, warmup_steps=s.warmup_steps, min_lr_ratio=s.min_lr_ratio,
        batch_tokens=s.batch_tokens, row_tokens=s.row_tokens, micro_batch_tokens=s.micro_batch_tokens,
        weight_decay=s.weight_decay, grad_clip=s.grad_clip, seed=s.seed, device="cpu",
        threads=s.threads, log=log,
    )


# --------------------------------------------------------------------------- evaluation

# Limits for running the model's own code during bootstrap evaluation (a subprocess, not the
# sandboxed tool executor: only our freshly trained tiny model writes this code).
EVAL_CODE_TIMEOUT_S = 5.0
EVAL_CODE_MEMORY_BYTES = 1 << 30


def _child_limits(timeout_s: float) -> Callable[[], None]:
    cpu_s = math.ceil(timeout_s) + 1  # backstop; the wall-clock timeout normally fires first

    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (EVAL_CODE_MEMORY_BYTES, EVAL_CODE_MEMORY_BYTES))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))

    return apply


# The child reads the cell from stdin and reports errors like the tool executor's zygote
# (``<cell>`` file name, source lines in the traceback, traceback from the cell's frame).
_CELL_RUNNER = (
    "import linecache, sys, traceback\n"
    "code = sys.stdin.read()\n"
    "linecache.cache['<cell>'] = (len(code), None, code.splitlines(True), '<cell>')\n"
    "try:\n"
    "    exec(compile(code, '<cell>', 'exec'), {'__name__': '__main__'})\n"
    "except BaseException as exc:\n"
    "    traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next)\n"
    "    sys.exit(1)\n"
)


def run_model_code(code: str, timeout_s: float = EVAL_CODE_TIMEOUT_S) -> ToolResult:
    """Run model-written code in an isolated child interpreter with CPU/memory/time limits."""
    with tempfile.TemporaryDirectory(prefix="rstar-eval-") as cwd:
        try:
            proc = subprocess.run([sys.executable, "-I", "-c", _CELL_RUNNER], input=code, cwd=cwd,
                                  capture_output=True, text=True, timeout=timeout_s,
                                  preexec_fn=_child_limits(timeout_s), env={"PATH": os.environ.get("PATH", "")})
        except subprocess.TimeoutExpired:
            return ToolResult("timeout", detail=f"{timeout_s:g} s")
    return ToolResult("ok" if proc.returncode == 0 else "error", proc.stdout, proc.stderr)


def extract_int_answer(text: str) -> str | None:
    """The integer in the last ``\\boxed{}`` of an ``<answer>`` (the reward's extraction), else None."""
    from services.reward.answers import canonical_integer, extract_answer

    found = extract_answer(text)
    return canonical_integer(found.text) if found is not None and found.source == "answer_tag" else None


def hf_agent_rollout(model, fmt: ConversationFormat, problem: data.Problem, *, sample: bool = False,
                     max_tokens: int = 320, max_turns: int = 4):
    """One trajectory of ``problem`` with HF ``generate`` (greedy, or sampled at T = 1 with no
    top-k/top-p), driven by the rollout's agent state machine so turns, tool calls and budgets
    follow the RL rollouts exactly; model-written code runs in :func:`run_model_code`."""
    import asyncio
    import time

    import torch

    from services.rollout.agent import AgentConfig, AgentLoop, Generation, GenerateRequest, ToolOutcome, run_agent

    config = AgentConfig(max_tokens=max_tokens, max_turns=max_turns,
                         max_model_len=int(model.config.max_position_embeddings))
    pad_id = model.config.pad_token_id
    sampling = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0) if sample else dict(do_sample=False)
    model.eval()

    async def generate(req: GenerateRequest) -> Generation:
        with torch.no_grad():
            out = model.generate(torch.tensor([req.token_ids]), max_new_tokens=req.max_new_tokens, **sampling,
                                 eos_token_id=fmt.stop_token_ids, pad_token_id=pad_id,
                                 use_cache=True)
        new = out[0, len(req.token_ids):].tolist()
        return Generation(new, [0.0] * len(new), [0] * len(new))

    async def run_tool(call) -> ToolOutcome:
        t0 = time.monotonic()
        return ToolOutcome(run_model_code(call.code), (time.monotonic() - t0) * 1000)

    if fmt.stop_strings:
        raise ValueError("the HF generate evaluation needs a single-token tool-call end (the tiny model has one)")
    loop = AgentLoop(problem.problem_id, fmt.prompt_ids(problem.prompt), config, fmt)
    return asyncio.run(run_agent(loop, generate, run_tool))


def evaluate_greedy(model, fmt: ConversationFormat, problems: list[data.Problem], *, max_tokens: int = 320,
                    max_turns: int = 4) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Greedy evaluation with HF ``generate`` (one problem at a time, :func:`hf_agent_rollout`)."""
    results, samples = [], []
    for problem in problems:
        traj = hf_agent_rollout(model, fmt, problem, max_tokens=max_tokens, max_turns=max_turns)
        text = traj.response_text
        predicted = extract_int_answer(text)
        calls = len(traj.tool_calls)
        good = sum(c.status != "parse_error" for c in traj.tool_calls)
        results.append(SampleResult(problem.problem_id, predicted == problem.answer, len(traj.response_token_ids),
                                    calls, good, answered=fmt.has_answer(text)))
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
    cache = Path(cache_dir)
    s = BootstrapSettings(seed=seed, minutes=minutes, steps=steps, **overrides)
    final = sft_model_dir(cache, s)
    if (final / BOOTSTRAP_INFO).is_file():
        return final
    with _file_lock(cache / f".{final.name}.lock"):
        if (final / BOOTSTRAP_INFO).is_file():  # another process finished it meanwhile
            return final
        if final.exists():
            raise CheckpointError(f"{final} exists without {BOOTSTRAP_INFO}: not written by bootstrap; remove it")
        for leftover in cache.glob(f"{TMP_PREFIX}{final.name}-*"):  # ours; we hold the lock
            shutil.rmtree(leftover, ignore_errors=True)
        base_dir = random_model_dir(cache, s)
        with _file_lock(cache / f".{base_dir.name}.lock"):
            base = create_random_model(base_dir, **s.model_kwargs())
        fmt = load_format(base, PRESET)
        stage = cache / f"{TMP_PREFIX}{final.name}-{uuid.uuid4().hex[:8]}"
        stage.mkdir()
        try:
            traces = write_training_traces(stage / "traces.jsonl", s, fmt)
            model_dir = stage / "model"
            summary = train(base, traces, model_dir, s, log=log)
            info: dict[str, Any] = {
                "settings": dataclasses.asdict(s), "digest": s.digest(), "format_version": FORMAT_VERSION,
                "base_model": str(base),
                # Not out_dir/sha256: they describe the staging directory before this file.
                "train": {k: v for k, v in dataclasses.asdict(summary).items()
                          if k not in ("loss_curve", "settings", "out_dir", "sha256")},
                "loss_curve": summary.loss_curve,
            }
            if eval_problems > 0:
                from transformers import AutoModelForCausalLM

                model = AutoModelForCausalLM.from_pretrained(str(model_dir))
                problems = data.generate_problems(eval_problems, seed=seed, split="eval")
                metrics, samples = evaluate_greedy(model, fmt, problems)
                info["eval_greedy"] = metrics
                info["eval_examples"] = samples[:5]
            # The random init's build record would make create_random_model() mistake this
            # trained directory for a random model of the same shape.
            (model_dir / "tiny_model.json").unlink(missing_ok=True)
            (model_dir / BOOTSTRAP_INFO).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
            fsync_tree(model_dir)
            os.rename(model_dir, final)
        finally:
            shutil.rmtree(stage, ignore_errors=True)
    return final


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description="Train (or reuse) the stage-0 SFT tiny model.")
    parser.add_argument("cache_dir")
    parser.add_argument("--minutes", type=float, default=BootstrapSettings.minutes)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--min-lr-ratio", type=float, default=BootstrapSettings.min_lr_ratio,
                        help="where the cosine ends, as a fraction of lr (the demo: 0.3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-problems", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args(argv)

    def log(r: dict[str, float]) -> None:
        if int(r["step"]) % 10 == 0 or int(r["step"]) <= 3:
            print(json.dumps({k: round(v, 4) for k, v in r.items() if k in
                              ("step", "elapsed_s", "loss", "lr", "tokens_per_s", "grad_norm")}), flush=True)

    path = bootstrap_tiny_model(args.cache_dir, minutes=args.minutes, seed=args.seed, steps=args.steps,
                                eval_problems=args.eval_problems, threads=args.threads,
                                min_lr_ratio=args.min_lr_ratio, log=log)
    info = json.loads((path / BOOTSTRAP_INFO).read_text())
    print(json.dumps({"model_dir": str(path), "train": info["train"], "eval_greedy": info.get("eval_greedy")}))


if __name__ == "__main__":
    main()

