"""Every recipe under configs/recipes validates against a tiny stand-in of its model family (real
tokenizer and chat template, random weights): the run config, the conversation format its preset
needs, its datasets in the recipe's schema, and each service's settings."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

REPO = Path(__file__).resolve().parents[3]
RECIPES = sorted((REPO / "configs" / "recipes").glob("*.yaml"))
DAPO_INSTRUCTION = ("Solve the following math problem step by step. The last line of your response should be of the "
                    "form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n")


def _dapo(path: Path) -> Path:
    rows = [{"data_source": "math_dapo", "ability": "MATH",
             "prompt": [{"role": "user", "content": DAPO_INSTRUCTION + q + '\n\nRemember to put your answer on its own line after "Answer:".'}],
             "reward_model": {"ground_truth": a, "style": "rule-lighteval/MATH_v2"}, "extra_info": {"index": f"id-{i}"}}
            for i, (q, a) in enumerate([("What is 6*7?", "42"), ("Simplify 6/8.", "\\frac{3}{4}")] * 3)]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _aime(path: Path) -> Path:
    rows = [{"ID": "2024-I-1", "Problem": "Find 2+2.", "Solution": "4", "Answer": 4}]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_there_are_recipes():
    assert {p.name for p in RECIPES} >= {"rstar2-agent-qwen3-14b.yaml", "one-gpu-qwen3-1.7b.yaml"}


@pytest.mark.parametrize("recipe", RECIPES, ids=[p.stem for p in RECIPES])
def test_recipe_validates_on_a_stand_in_of_its_family(recipe, request, tmp_path):
    from services.cli import settings_class
    from services.orchestrator.run_config import load_run_config
    from services.orchestrator.runtime import dataset_for
    from shared.formats import load_format

    text = recipe.read_text()
    family = re.search(r"^# stand-in: (\w+)", text, re.M)
    assert family, f"{recipe.name} must say which stand-in family validates it ('# stand-in: qwen3')"
    model = request.getfixturevalue({"qwen3": "qwen3_model", "llama": "llama3_model"}[family.group(1)])
    data = yaml.safe_load(text)
    assert data["dataset"]["kind"] == "file"  # recipes train on real data files
    data["model"] = str(model)
    data["dataset"]["paths"] = [str(_dapo(tmp_path / "dapo.parquet"))]
    data["dataset"]["eval_paths"] = [str(_aime(tmp_path / "aime.parquet"))]
    path = tmp_path / recipe.name
    path.write_text(yaml.safe_dump(data))

    cfg = load_run_config(path)
    train, evals = dataset_for(cfg)
    assert len(train) == 2 and {p.answer for p in train} == {"42", "\\frac{3}{4}"}  # deduplicated, non-integer kept
    assert all("Answer:" not in p.prompt for p in train)  # DAPO's own instruction is stripped
    assert [p.answer for p in evals] == ["4"]
    fmt = load_format(model, cfg.format.preset)
    longest = max(s.max_tokens for s in cfg.stages)
    for name, section in cfg.service_settings().items():
        settings = settings_class(name).model_validate(section)
        if name == "rollout":
            assert settings.max_model_len >= longest + len(fmt.prompt_ids(train[0].prompt))
    assert cfg.n_samples >= cfg.group_size and cfg.total_steps > 0
    json.dumps(cfg.model_dump())  # a run's config is stored as JSON
