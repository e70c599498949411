"""The committed stage-0 checkpoint: the tiny model after the bootstrap's SFT, shipped in the
repository so that ``make demo`` starts from the same weights on every machine.

Why: the bootstrap (``lab/bootstrap.py``) is reproducible on one machine, not across machines —
another CPU's floating-point kernels change the last bits, and the SFT amplifies them near the
step where digit copying forms: the same recipe gave held-out pass@1 0.19, 0.36 and 0.47 on
three machines. A demo that starts from a different model on each machine measures the machine,
not the RL. It also saves the bootstrap's ~7 minutes on a first run.

``lab/checkpoints/tiny-sft/`` holds the files the bootstrap wrote — weights, tokenizer, chat
template, ``bootstrap.json`` (its recipe: every setting, the settings digest, the training
figures and loss curve) — and ``MANIFEST.json``: the sha256 of every file, the bootstrap digest,
and where it was trained and what it scored there. :func:`install` verifies every digest and
that the checkpoint was made with the demo's current recipe (the digest of its settings), then
copies it under the state directory (nothing ever writes into the source tree). A recipe change
without a new checkpoint fails there, and in ``tests/unit/lab/test_stage0.py``, with the way out:
``rstar demo --from-scratch`` trains it anew (cached as the bootstrap caches), and
``python -m lab.stage0 export MODEL_DIR --pass1 X`` commits the result.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from shared.checkpoint import TMP_PREFIX, fsync_tree

COMMITTED = Path(__file__).resolve().parent / "checkpoints" / "tiny-sft"
MANIFEST = "MANIFEST.json"
# The files a stage-0 checkpoint consists of (what lab.bootstrap writes, less nothing).
REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja", "bootstrap.json")


class Stage0Error(RuntimeError):
    """The committed checkpoint is missing, damaged, or made with another recipe."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def file_digests(directory: Path) -> dict[str, str]:
    return {p.name: _sha256(p) for p in sorted(directory.iterdir()) if p.is_file() and p.name != MANIFEST}


def verify(directory: Path = COMMITTED, *, digest: str | None = None) -> dict[str, Any]:
    """The checkpoint's manifest, once every file matches it (and, with ``digest``, the recipe
    it was made with is that one); raises Stage0Error naming what is wrong."""
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        raise Stage0Error(f"{directory} has no {MANIFEST}: not a committed stage-0 checkpoint")
    manifest = json.loads(manifest_path.read_text())
    expected: dict[str, str] = manifest["files"]
    found = file_digests(directory)
    problems = [f"{name}: missing" for name in expected if name not in found]
    problems += [f"{name}: not in the manifest" for name in found if name not in expected]
    problems += [f"{name}: sha256 {found[name][:12]}… != {sha[:12]}…" for name, sha in expected.items()
                 if name in found and found[name] != sha]
    if problems:
        raise Stage0Error(f"{directory} does not match its manifest: " + "; ".join(problems))
    if digest is not None and manifest["bootstrap_digest"] != digest:
        raise Stage0Error(
            f"{directory} was trained with bootstrap settings {manifest['bootstrap_digest']}, but the demo's recipe "
            f"is now {digest}: train the new one with `rstar demo --from-scratch` and commit it with "
            "`python -m lab.stage0 export <state_dir>/models/tiny-sft-<digest> --pass1 <pass@1 before RL>`")
    return manifest


def install(models_dir: Path, *, digest: str, source: Path = COMMITTED) -> Path:
    """A verified copy of the committed checkpoint under ``models_dir`` (reused when present and
    intact), written atomically: a reader never sees a partial copy under the final name."""
    verify(source, digest=digest)
    final = models_dir / f"stage0-{digest}"
    if final.is_dir():
        try:
            verify(final, digest=digest)
            return final
        except Stage0Error:
            shutil.rmtree(final)  # a damaged copy of ours: copy again
    models_dir.mkdir(parents=True, exist_ok=True)
    stage = models_dir / f"{TMP_PREFIX}{final.name}-{uuid.uuid4().hex[:8]}"
    try:
        shutil.copytree(source, stage)
        fsync_tree(stage)
        os.rename(stage, final)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return final


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def export(model_dir: Path, dest: Path = COMMITTED, *, pass1: float | None = None) -> dict[str, Any]:
    """Commit a bootstrapped model: copy its files to ``dest`` and write the manifest."""
    missing = [name for name in REQUIRED if not (model_dir / name).is_file()]
    if missing:
        raise Stage0Error(f"{model_dir} is not a bootstrapped stage-0 model (missing {', '.join(missing)})")
    info = json.loads((model_dir / "bootstrap.json").read_text())
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(model_dir, dest)
    manifest = {
        "bootstrap_digest": info["digest"],
        "format_version": info["format_version"],
        "made_by": "lab.bootstrap.bootstrap_tiny_model with lab.demo's settings (rstar demo --from-scratch)",
        "trained_on": {"cpu": _cpu(), "cores": os.cpu_count(), "python": platform.python_version(),
                       "date": datetime.now(timezone.utc).date().isoformat()},
        "train": info.get("train", {}),
        "held_out_pass1_before_rl": pass1,
        "files": file_digests(dest),
    }
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lab.stage0", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("export", help="commit a bootstrapped model as the stage-0 checkpoint")
    ex.add_argument("model_dir", type=Path)
    ex.add_argument("--pass1", type=float, default=None, help="its held-out pass@1 before RL (the demo prints it)")
    sub.add_parser("verify", help="check the committed checkpoint against its manifest and the demo's recipe")
    args = parser.parse_args(argv)
    if args.command == "export":
        print(json.dumps(export(args.model_dir, pass1=args.pass1), indent=2))
    else:
        from lab.demo import demo_bootstrap_settings

        print(json.dumps(verify(digest=demo_bootstrap_settings().digest())["trained_on"]))


if __name__ == "__main__":
    main()
