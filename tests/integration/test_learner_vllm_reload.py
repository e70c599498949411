"""A learner checkpoint is what vLLM's in-place weight reload expects: same tensor names as HF
save_pretrained, tied output layer omitted. vLLM (CPU) starts on the initial tiny model, reloads
the learner's version-1 weights with collective_rpc("reload_weights"), and then its logprobs
are those of the trained weights as computed by transformers — after
the reload_checkpoint worker extension of shared.checkpoint (a plain reload_weights leaves a
tied output layer stale on vLLM CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

SCRIPT = textwrap.dedent('''
    import json, sys

    def main(initial, new):
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
        llm = LLM(model=initial, dtype="float32", block_size=32, max_model_len=512, enable_prefix_caching=True,
                  worker_extension_cls="shared.checkpoint.VllmCheckpointReload")
        prompt = TokensPrompt(prompt_token_ids=[5, 17, 42, 99, 7, 8])
        sp = SamplingParams(temperature=0.0, max_tokens=8, logprobs=0, detokenize=False)
        def gen():
            out = llm.generate([prompt], sp)[0].outputs[0]
            return list(out.token_ids), [float(lp[t].logprob) for t, lp in zip(out.token_ids, out.logprobs)]
        ids0, lp0 = gen()
        assert llm.collective_rpc("reload_checkpoint", args=(new,)) == [True]
        llm.reset_prefix_cache()
        ids1, lp1 = gen()
        print("RESULT " + json.dumps({"ids0": ids0, "lp0": lp0, "ids1": ids1, "lp1": lp1}))

    if __name__ == "__main__":
        main(sys.argv[1], sys.argv[2])
''')


def test_vllm_reloads_a_learner_checkpoint(tmp_path):
    pytest.importorskip("vllm")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "learner"))
    from learner_helpers import scored_group

    from services.learner.engine import EngineConfig, LearnerEngine
    from services.learner.trainer import TrainerConfig
    from shared.checkpoint import verify_checkpoint
    from lab.tiny_model import create_random_model

    initial = create_random_model(tmp_path / "tiny", seed=0)
    engine = LearnerEngine.open(EngineConfig(model_dir=initial, checkpoint_dir=tmp_path / "ckpt", device="cpu",
                                             groups_per_step=2, trainer=TrainerConfig(lr=5e-2, warmup_steps=0)))
    for g in ("x", "y"):
        engine.offer(scored_group(g, vocab=512, run_id="r"))
    out = engine.train_step()
    verify_checkpoint(out.weights_dir, out.sha256)

    script = tmp_path / "reload.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.run([sys.executable, str(script), str(initial), str(out.weights_dir)], capture_output=True,
                          text=True, timeout=280, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    res = json.loads(lines[-1][len("RESULT "):])
    assert res["lp0"] != pytest.approx(res["lp1"], abs=1e-2)  # the reload changed the policy

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(out.weights_dir), dtype=torch.float32)
    ids = torch.tensor([[5, 17, 42, 99, 7, 8] + res["ids1"]])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
    hf = [logp[5 + i, t].item() for i, t in enumerate(res["ids1"])]
    assert hf == pytest.approx(res["lp1"], abs=1e-3)
