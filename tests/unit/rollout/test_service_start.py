"""The rollout service checks its model directory and preset before any engine starts: an unusable
directory fails at once with every reason, and no engine is created."""

from __future__ import annotations

import asyncio
import shutil

import pytest

from services.rollout.config import Settings
from services.rollout.runtime import RolloutService
from shared.formats import ModelDirError


def test_an_unusable_model_directory_fails_before_any_engine(qwen3_model, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(qwen3_model, broken)
    (broken / "tokenizer.json").unlink()
    for weights in broken.glob("*.safetensors"):
        weights.unlink()
    service = RolloutService(Settings(model_path=broken, state_dir=tmp_path))
    with pytest.raises(ModelDirError) as info:
        asyncio.run(service.start(ctx=None))
    assert "no tokenizer.json" in str(info.value) and "no weights" in str(info.value)
    assert service.engines == []  # nothing was built, let alone started


def test_a_preset_the_template_cannot_carry_is_refused_before_any_engine(qwen3_model, tmp_path):
    broken = tmp_path / "no-tool-role"
    shutil.copytree(qwen3_model, broken)
    # a template that renders no 'tool' message: the format cannot append tool results
    (broken / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m.role != 'tool' %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
        "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    service = RolloutService(Settings(model_path=broken, state_dir=tmp_path))
    with pytest.raises(ModelDirError, match="does not render a 'tool' message"):
        asyncio.run(service.start(ctx=None))
    assert service.engines == []
