"""The committed stage-0 checkpoint (lab/stage0.py): intact, made with the demo's current recipe,
installed as a verified copy, and refused with the way out when damaged or stale."""

from __future__ import annotations

import json
import shutil

import pytest

from lab import stage0
from lab.demo import bootstrap_demo_model, demo_bootstrap_settings
from shared.formats import load_format


def test_the_committed_checkpoint_matches_its_manifest_and_the_demos_recipe():
    # fails when the bootstrap recipe (settings, trace format, system prompt) changed without a
    # new checkpoint: `rstar demo --from-scratch`, then `python -m lab.stage0 export ...`
    manifest = stage0.verify(digest=demo_bootstrap_settings().digest())
    info = json.loads((stage0.COMMITTED / "bootstrap.json").read_text())
    assert info["digest"] == manifest["bootstrap_digest"] and info["settings"]["steps"] == manifest["train"]["steps"]
    assert set(stage0.REQUIRED) <= set(manifest["files"])


def test_the_demo_starts_from_a_verified_copy_that_loads_as_the_tiny_model(tmp_path):
    model = bootstrap_demo_model(tmp_path)
    assert model.parent == tmp_path / "models" and model != stage0.COMMITTED
    assert stage0.file_digests(model) == stage0.file_digests(stage0.COMMITTED)
    fmt = load_format(model, "compact")  # the whole model check the services run before an engine
    assert fmt.describe()["family"]
    assert bootstrap_demo_model(tmp_path) == model  # reused


def test_a_damaged_or_stale_checkpoint_is_refused_with_the_way_out(tmp_path):
    copy = tmp_path / "ckpt"
    shutil.copytree(stage0.COMMITTED, copy)
    digest = demo_bootstrap_settings().digest()
    with pytest.raises(stage0.Stage0Error, match="--from-scratch"):
        stage0.install(tmp_path / "models", digest="0" * 16, source=copy)
    with (copy / "model.safetensors").open("r+b") as f:
        f.seek(1000)
        f.write(b"\x00\x01\x02\x03")
    with pytest.raises(stage0.Stage0Error, match="model.safetensors: sha256"):
        stage0.install(tmp_path / "models", digest=digest, source=copy)
    (copy / "extra.bin").write_bytes(b"x")
    (copy / "tokenizer.json").unlink()
    with pytest.raises(stage0.Stage0Error) as err:
        stage0.verify(copy)
    assert "tokenizer.json: missing" in str(err.value) and "extra.bin: not in the manifest" in str(err.value)
    assert not (tmp_path / "models" / f"stage0-{digest}").exists()


def test_a_damaged_installed_copy_is_replaced(tmp_path):
    digest = demo_bootstrap_settings().digest()
    first = stage0.install(tmp_path, digest=digest)
    (first / "config.json").write_text("{}")
    again = stage0.install(tmp_path, digest=digest)
    assert again == first and stage0.file_digests(again) == stage0.file_digests(stage0.COMMITTED)


def test_export_writes_a_manifest_that_verifies(tmp_path):
    src = tmp_path / "model"
    shutil.copytree(stage0.COMMITTED, src)
    (src / stage0.MANIFEST).unlink()
    manifest = stage0.export(src, tmp_path / "out", pass1=0.5)
    assert manifest["held_out_pass1_before_rl"] == 0.5
    assert stage0.verify(tmp_path / "out", digest=manifest["bootstrap_digest"])["files"] == manifest["files"]
    with pytest.raises(stage0.Stage0Error, match="not a bootstrapped"):
        stage0.export(tmp_path / "out" / "nothing", tmp_path / "out2")
