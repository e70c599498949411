"""Helpers of the vLLM integration tests: a scripted policy that still runs every token through a
real engine, and an independent scoring of a sequence by that engine.

How a random model is made to call a tool deterministically: ``ForcedEngine`` is a scripted
policy at the token level. For a scripted turn of tokens t1..tn it sends the context + t1..tn as
a prompt with ``prompt_logprobs`` (the engine's logprob of each forced token, computed by the
real model; at T = 1 the same number the engine reports for a sampled token) and discards the one
token it samples after them. The agent loop, the stop tokens, the tool executor and the
trajectory arrays are the real ones; only the policy's choice of tokens is scripted. (Sampling
the last token with ``allowed_token_ids`` would report log-prob 0 for it: the engine returns
processed log-probs, after that mask.)
"""

from __future__ import annotations

import uuid

from services.rollout.agent import Generation, GenerateRequest
from shared.formats import ConversationFormat


class ForcedEngine:
    """Scripted token-level policy run through the real engine (see module docstring)."""

    def __init__(self, engine, fmt: ConversationFormat, turns: list[str]):
        self.engine = engine
        self.index = engine.index
        self.tok = fmt
        self.turns = turns

    @property
    def version(self):
        return self.engine.version

    @property
    def capacity_tokens(self):
        return self.engine.capacity_tokens

    @property
    def used_tokens(self):
        return self.engine.used_tokens

    async def generate(self, req: GenerateRequest, *, temperature, top_p, stop_token_ids, stop_strings=None,
                       request_id=None, extra=None):
        from vllm import SamplingParams as VSP
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        forced = self.tok.encode(self.turns[req.turn - 1])[: req.max_new_tokens]
        prompt = list(req.token_ids) + forced
        params = VSP(max_tokens=1, temperature=temperature, top_p=top_p, prompt_logprobs=0, detokenize=False,
                     output_kind=RequestOutputKind.FINAL_ONLY)
        final = None
        async for out in self.engine.llm.generate(TokensPrompt(prompt_token_ids=prompt), params, request_id=request_id or uuid.uuid4().hex):
            final = out
        plp = final.prompt_logprobs[len(req.token_ids):]
        logprobs = [float(d[t].logprob) for d, t in zip(plp, forced)]
        return Generation(forced, logprobs, [self.engine.version] * len(forced))


async def score(engine, token_ids: list[int]) -> list[float | None]:
    """The engine's logprob of every token of ``token_ids`` given the tokens before it."""
    from vllm import SamplingParams as VSP
    from vllm.inputs import TokensPrompt

    params = VSP(max_tokens=1, prompt_logprobs=0, logprobs=0, detokenize=False)
    final = None
    async for out in engine.llm.generate(TokensPrompt(prompt_token_ids=token_ids), params, request_id=uuid.uuid4().hex):
        final = out
    return [None if d is None else float(d[t].logprob) for d, t in zip(final.prompt_logprobs, token_ids)]


