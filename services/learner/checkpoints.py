"""The learner's checkpoints on disk: one immutable directory per policy version.

Layout (``<checkpoint_dir>/v00000012/`` is written whole under a temporary name and renamed,
see :func:`shared.checkpoint.atomic_directory`)::

    v00000012/
      weights/               ← WeightVersion.uri; WeightVersion.sha256 = checkpoint_sha256(weights/)
        config.json, generation_config.json, tokenizer files   (copied from the initial model dir)
        model.safetensors                                       (HF names; tied lm_head omitted)
      trainer/
        state.json           run, version, step, stage, consumed group ids, weights sha256, metrics
        optimizer.pt         AdamW moments + schedule position (torch.save)

``weights/`` is an ordinary HF model directory: ``transformers`` and vLLM
(``collective_rpc("reload_weights", kwargs={"weights_path": .../weights})``) load it as is; the
training state lives beside it, not inside, so the rollout never hashes or reads optimizer
moments. A directory without the ``v<8 digits>`` name (an interrupted ``.tmp-*`` write), or
whose weights no longer match the recorded hash, is not a complete checkpoint and is ignored on
resume.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from shared.checkpoint import (
    CheckpointError,
    atomic_directory,
    checkpoint_sha256,
    copy_model_files,
    remove_stale_temporaries,
    save_weights,
)

WEIGHTS = "weights"
TRAINER = "trainer"
STATE_FILE = "state.json"
OPTIMIZER_FILE = "optimizer.pt"
_NAME = re.compile(r"^v(\d{8})$")


@dataclass
class LearnerState:
    run_id: str = ""
    version: int = 0
    step: int = 0
    stage: int | None = None
    consumed: list[str] = field(default_factory=list)  # group ids trained on (or given up on)
    weights_sha256: str = ""
    optimizer_reset_steps: list[int] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)  # the step's metrics (re-recorded on resume)
    created_at: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "LearnerState":
        data = json.loads(text)
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})


def weights_state_dict(model: torch.nn.Module, dtype: torch.dtype | None = None,
                       state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The model's tensors under their HF names, each storage once; a tied output layer is
    dropped as HF ``save_pretrained`` does (vLLM and HF re-tie it on load).

    ``state``: an already gathered state dict (FSDP2's full state dict on rank 0), else the
    model's own.
    """
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    for name, tensor in (state if state is not None else model.state_dict()).items():
        if tied and name == "lm_head.weight":
            continue
        key = tensor.untyped_storage().data_ptr()
        if key in seen:
            continue
        seen.add(key)
        t = tensor.detach()
        out[name] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
    return out


def config_dtype(model_dir: Path) -> torch.dtype:
    """The dtype the model directory declares (``dtype`` / ``torch_dtype`` in config.json), fp32 if none."""
    cfg = json.loads((model_dir / "config.json").read_text())
    name = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"{model_dir}/config.json declares unknown dtype {name!r}")
    return dtype


class CheckpointStore:
    def __init__(self, root: Path, source_model_dir: Path, *, writer: bool = True):
        """``writer``: this process writes checkpoints (and so may delete interrupted writes); the
        other ranks of a multi-device learner only read the one rank 0 resumes from."""
        self.root = Path(root)
        self.source_model_dir = Path(source_model_dir)
        if writer:
            self.root.mkdir(parents=True, exist_ok=True)
            remove_stale_temporaries(self.root)

    def version_dir(self, version: int) -> Path:
        return self.root / f"v{version:08d}"

    def weights_dir(self, version: int) -> Path:
        return self.version_dir(version) / WEIGHTS

    def versions(self) -> list[int]:
        out = []
        for child in self.root.iterdir():
            m = _NAME.match(child.name)
            if m and child.is_dir():
                out.append(int(m.group(1)))
        return sorted(out)

    def save(self, state: LearnerState, model: torch.nn.Module, trainer_state: dict[str, Any],
             weights_dtype: torch.dtype | None = None,
             weights: dict[str, torch.Tensor] | None = None) -> tuple[Path, str]:
        """Write version ``state.version`` atomically; returns (weights dir, its sha256).

        ``weights``: the full weights already gathered from the ranks (FSDP2), else the model's own.
        """
        final = self.version_dir(state.version)
        dtype = weights_dtype or config_dtype(self.source_model_dir)
        with atomic_directory(final) as tmp:
            wdir = tmp / WEIGHTS
            wdir.mkdir()
            copy_model_files(self.source_model_dir, wdir)
            save_weights(weights_state_dict(model, dtype, state=weights), wdir)
            sha = checkpoint_sha256(wdir)
            tdir = tmp / TRAINER
            tdir.mkdir()
            torch.save(trainer_state, tdir / OPTIMIZER_FILE)
            state.weights_sha256 = sha
            state.created_at = datetime.now(timezone.utc).isoformat()
            (tdir / STATE_FILE).write_text(state.to_json())
        return final / WEIGHTS, sha

    def read_state(self, version: int) -> LearnerState:
        return LearnerState.from_json((self.version_dir(version) / TRAINER / STATE_FILE).read_text())

    def latest(self, *, verify: bool = True) -> LearnerState | None:
        """The newest complete checkpoint's state (weights hash checked), or None."""
        for version in reversed(self.versions()):
            try:
                state = self.read_state(version)
                if verify and checkpoint_sha256(self.weights_dir(version)) != state.weights_sha256:
                    raise CheckpointError("weights do not match the recorded sha256")
                if not (self.version_dir(version) / TRAINER / OPTIMIZER_FILE).is_file():
                    raise CheckpointError("optimizer state missing")
                return state
            except (OSError, ValueError, KeyError, TypeError, CheckpointError) as exc:
                # Corrupt or incomplete: skip it, an older one may be whole.
                _warn(f"ignoring checkpoint {self.version_dir(version)}: {exc}")
        return None

    def load_trainer_state(self, version: int, device: torch.device | str = "cpu") -> dict[str, Any]:
        return torch.load(self.version_dir(version) / TRAINER / OPTIMIZER_FILE, map_location=device, weights_only=True)

    def prune(self, keep_last: int) -> list[int]:
        """Delete all but the newest ``keep_last`` checkpoints; returns the removed versions."""
        versions = self.versions()
        removed = versions[:-keep_last] if keep_last > 0 else []
        for v in removed:
            shutil.rmtree(self.version_dir(v), ignore_errors=True)
        return removed


def _warn(message: str) -> None:
    from shared.logging import get_logger

    get_logger("learner.checkpoints").warning("checkpoint_skipped", reason=message)
