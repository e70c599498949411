"""shared.checkpoint: the sha256 definition, verification and atomic directory writes."""

import hashlib
import struct

import pytest
import torch

from shared.checkpoint import (
    CheckpointError,
    atomic_directory,
    checkpoint_sha256,
    load_weights,
    path_from_uri,
    remove_stale_temporaries,
    save_weights,
    uri_for,
    verify_checkpoint,
)


def test_sha256_matches_the_documented_framing(tmp_path):
    (tmp_path / "b.txt").write_bytes(b"world")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.bin").write_bytes(b"\x00\x01")
    (tmp_path / "a.txt").write_bytes(b"hello")
    h = hashlib.sha256()
    for rel, data in sorted([("a.txt", b"hello"), ("b.txt", b"world"), ("sub/a.bin", b"\x00\x01")]):
        h.update(rel.encode() + b"\0" + struct.pack("<Q", len(data)) + data)
    assert checkpoint_sha256(tmp_path) == h.hexdigest()


def test_verify_detects_changed_renamed_and_added_files(tmp_path):
    (tmp_path / "x").write_bytes(b"abc")
    digest = checkpoint_sha256(tmp_path)
    verify_checkpoint(tmp_path, digest)
    verify_checkpoint(uri_for(tmp_path), digest)
    (tmp_path / "x").write_bytes(b"abd")
    with pytest.raises(CheckpointError):
        verify_checkpoint(tmp_path, digest)
    (tmp_path / "x").write_bytes(b"abc")
    (tmp_path / "x").rename(tmp_path / "y")
    with pytest.raises(CheckpointError):
        verify_checkpoint(tmp_path, digest)
    (tmp_path / "y").rename(tmp_path / "x")
    (tmp_path / "extra").write_bytes(b"")
    with pytest.raises(CheckpointError):
        verify_checkpoint(tmp_path, digest)
    with pytest.raises(CheckpointError):
        verify_checkpoint(tmp_path / "missing", digest)


def test_atomic_directory_renames_on_success_and_leaves_nothing_on_failure(tmp_path):
    final = tmp_path / "ckpt" / "v1"
    with pytest.raises(RuntimeError):
        with atomic_directory(final) as tmp:
            (tmp / "half").write_bytes(b"x")
            raise RuntimeError("crash while writing")
    assert not final.exists()
    assert list((tmp_path / "ckpt").iterdir()) == []
    with atomic_directory(final) as tmp:
        save_weights({"w": torch.arange(6.0).reshape(2, 3)}, tmp)
    assert torch.equal(load_weights(final)["w"], torch.arange(6.0).reshape(2, 3))
    with pytest.raises(CheckpointError):
        with atomic_directory(final):
            pass
    # a crash after mkdir of the temporary leaves only a .tmp- sibling, which is garbage
    (tmp_path / "ckpt" / ".tmp-v2-deadbeef").mkdir()
    assert [p.name for p in remove_stale_temporaries(tmp_path / "ckpt")] == [".tmp-v2-deadbeef"]


def test_path_from_uri_rejects_remote_schemes(tmp_path):
    assert path_from_uri(uri_for(tmp_path)) == tmp_path.resolve()
    with pytest.raises(CheckpointError):
        path_from_uri("s3://bucket/x")
