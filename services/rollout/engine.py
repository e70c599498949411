"""vLLM engines in this process: token-in/token-out generation with per-token logprobs and
policy versions, KV statistics, and in-place weight reloads.

One :class:`RolloutEngine` wraps one ``AsyncLLM`` (its own engine-core process; on GPUs,
tensor parallel over ``tensor_parallel_size`` devices). Generation takes token ids and returns
token ids (``detokenize=False``; stops are token ids): the agent loop owns the text.

Policy versions: vLLM labels every engine step with the engine's weight version
(``update_weight_version``) and returns, per finished request, the spans of output tokens each
version produced (``CompletionOutput.weight_versions``), so a turn that straddles a weight
update is attributed token by token.

Weight update (``load_weights``): pause the scheduler keeping the requests
(``pause_generation(mode="keep")``), ``collective_rpc("reload_checkpoint", dir)`` of the
``shared.checkpoint.VllmCheckpointReload`` worker extension (vLLM's ``reload_weights`` in place,
no restart, plus a refresh of a tied output layer that a plain reload leaves stale), set the new version label, reset the prefix cache including the
running requests' blocks (their KV was computed with the old weights: they are recomputed
with the new ones), resume. A reload that fails part-way can leave the model half-written,
so the caller validates a checkpoint before it gets here (``weights.py``), and a failed
reload marks the engine unhealthy instead of serving from an undefined model.
"""

from __future__ import annotations

import asyncio
import itertools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.rollout.agent import Generation, GenerateRequest

GiB = 1024**3


@dataclass
class EngineStats:
    """Latest scheduler statistics of one engine (updated every engine step)."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0  # fraction of KV blocks held by requests (cached-but-free blocks excluded)
    preemptions: int = 0  # cumulative
    prefix_queries: int = 0  # cumulative tokens looked up in the prefix cache
    prefix_hits: int = 0  # cumulative tokens found there
    generated_tokens: int = 0  # cumulative


def _stat_logger_factory(sink: EngineStats):
    from vllm.v1.metrics.loggers import StatLoggerBase

    class _Sink(StatLoggerBase):
        def __init__(self, vllm_config, engine_index: int = 0):  # noqa: D401 - vLLM's signature
            self.sink = sink

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
            if scheduler_stats is not None:
                self.sink.running = scheduler_stats.num_running_reqs
                self.sink.waiting = scheduler_stats.num_waiting_reqs
                self.sink.kv_usage = scheduler_stats.kv_cache_usage
                pcs = scheduler_stats.prefix_cache_stats
                if pcs is not None:
                    self.sink.prefix_queries += pcs.queries
                    self.sink.prefix_hits += pcs.hits
            if iteration_stats is not None:
                self.sink.preemptions += iteration_stats.num_preempted_reqs
                self.sink.generated_tokens += iteration_stats.num_generation_tokens

        def log_engine_initialized(self):
            pass

    return _Sink


class EngineUnhealthy(RuntimeError):
    """The engine failed a weight reload and must not serve (its model may be half-written)."""


class RolloutEngine:
    def __init__(self, index: int, *, model: str | Path, dtype: str = "float32", block_size: int = 32,
                 max_model_len: int = 4096, kv_cache_gib: float = 1.0, max_num_seqs: int = 256,
                 tensor_parallel_size: int = 1, seed: int = 0, enforce_eager: bool = False,
                 version: int = 0) -> None:
        self.index = index
        self.model = str(model)
        self._args: dict[str, Any] = dict(
            model=str(model), dtype=dtype, block_size=block_size, max_model_len=max_model_len,
            enable_prefix_caching=True, max_num_seqs=max_num_seqs, tensor_parallel_size=tensor_parallel_size,
            seed=seed, enforce_eager=enforce_eager, disable_log_stats=False,
            # The log-prob of each sampled token under the distribution it was sampled from (after
            # temperature), which is what the learner's importance ratios compare against.
            logprobs_mode="processed_logprobs",
            kv_cache_memory_bytes=int(kv_cache_gib * GiB),
            # A plain collective_rpc("reload_weights") leaves a tied output layer (tiny model,
            # Qwen2-0.5B/1.5B) holding the old weights on vLLM CPU; this extension's
            # reload_checkpoint refreshes it too.
            worker_extension_cls="shared.checkpoint.VllmCheckpointReload",
        )
        self.stats = EngineStats()
        self.version = version
        self.weights_path = str(model)
        self.healthy = False
        self._llm = None
        self._ids = itertools.count()
        self._update_lock = asyncio.Lock()

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self._llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**self._args), stat_loggers=[_stat_logger_factory(self.stats)])
        await self._llm.update_weight_version(str(self.version))
        self.healthy = True

    async def restart(self, weights_path: str | Path, version: int) -> None:
        """Start afresh from a checkpoint directory (after a failed reload)."""
        self.shutdown()
        self._args["model"] = str(weights_path)
        self.weights_path = str(weights_path)
        self.version = version
        await self.start()

    def shutdown(self) -> None:
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None
        self.healthy = False

    @property
    def llm(self):
        if self._llm is None:
            raise RuntimeError(f"engine {self.index} is not started")
        return self._llm

    @property
    def block_size(self) -> int:
        return int(self.llm.vllm_config.cache_config.block_size)

    @property
    def capacity_tokens(self) -> int:
        cache = self.llm.vllm_config.cache_config
        return int(cache.num_gpu_blocks) * int(cache.block_size)

    @property
    def used_tokens(self) -> int:
        return int(math.ceil(self.stats.kv_usage * self.capacity_tokens))

    # ------------------------------------------------------------------ generation

    async def generate(self, req: GenerateRequest, *, temperature: float, top_p: float,
                       stop_token_ids: list[int], stop_strings: list[str] | None = None,
                       request_id: str | None = None, extra: dict[str, Any] | None = None) -> Generation:
        """Continue ``req.token_ids`` by at most ``req.max_new_tokens`` sampled tokens.

        ``stop_strings`` (a tool call's closing tag where the vocabulary has no single token for
        it) need detokenisation; vLLM then ends the request on the token that completes the
        string and keeps that token, so the ids stay exactly what was sampled."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        if not self.healthy:
            raise EngineUnhealthy(f"engine {self.index} is not serving")
        text_stops = dict(stop=list(stop_strings), include_stop_str_in_output=True) if stop_strings else {}
        params = SamplingParams(
            max_tokens=req.max_new_tokens, temperature=temperature, top_p=top_p, logprobs=0,
            detokenize=bool(stop_strings), stop_token_ids=list(stop_token_ids), skip_special_tokens=False,
            output_kind=RequestOutputKind.FINAL_ONLY, **text_stops, **(extra or {}),
        )
        rid = request_id or f"e{self.index}-{next(self._ids)}"
        final = None
        async for out in self.llm.generate(TokensPrompt(prompt_token_ids=list(req.token_ids)), params, request_id=rid):
            final = out
        if final is None:
            raise RuntimeError(f"engine {self.index}: no output for request {rid}")
        comp = final.outputs[0]
        ids = list(comp.token_ids)
        logprobs = [_sampled_logprob(entry, tid) for entry, tid in zip(comp.logprobs or [], ids)]
        if len(logprobs) != len(ids):
            raise RuntimeError(f"engine {self.index}: {len(ids)} tokens but {len(logprobs)} logprobs")
        return Generation(ids, logprobs, _token_versions(getattr(comp, "weight_versions", None), len(ids), self.version))

    # ------------------------------------------------------------------ weights

    async def load_weights(self, weights_path: str | Path, version: int) -> float:
        """Reload the weights in place and label later tokens ``version``; returns seconds."""
        loop = asyncio.get_running_loop()
        async with self._update_lock:
            t0 = loop.time()
            llm = self.llm
            await llm.pause_generation(mode="keep", clear_cache=False)
            try:
                try:
                    await llm.collective_rpc("reload_checkpoint", args=(str(weights_path),))
                except Exception as exc:
                    self.healthy = False
                    raise EngineUnhealthy(f"engine {self.index}: reload of {weights_path} failed: {exc}") from exc
                await llm.update_weight_version(str(version))
                self.version = version
                self.weights_path = str(weights_path)
                await llm.reset_prefix_cache(reset_running_requests=True)
            finally:
                if self.healthy:  # a failed engine is restarted by the caller, not resumed
                    await llm.resume_generation()
            return loop.time() - t0


def _sampled_logprob(entry: Any, token_id: int) -> float:
    """The logprob of the sampled token from vLLM's per-position dict (logprobs=0 keeps just it)."""
    if entry is None:
        raise RuntimeError("vLLM returned no logprob for a sampled token")
    lp = entry.get(token_id) if hasattr(entry, "get") else None
    if lp is None:
        raise RuntimeError(f"sampled token {token_id} missing from its logprob entry")
    return float(lp.logprob)


def _token_versions(spans: Any, n_tokens: int, current: int) -> list[int]:
    """Per-token policy versions from vLLM's weight-version spans."""
    if not spans:
        return [current] * n_tokens
    versions = [current] * n_tokens
    for span in spans:
        for i in range(max(0, span.start), min(n_tokens, span.end)):
            versions[i] = int(span.version)
    return versions
