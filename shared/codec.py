"""Compact array fields for events.

Token ids, logprobs and masks make up almost all of a trajectory's bytes. As JSON lists of
numbers a 12K-token trajectory costs ~100 KB; packed little-endian and base64-encoded it costs
a third of that and round-trips byte-exact. On the wire these fields are strings
(``"i4:<base64>"``, ``"f4:<base64>"``, ``"u1:<base64>"``); in Python they are plain lists, so
domain code never sees the encoding. Validation also accepts plain lists (handy in tests and
hand-written JSON).

Floats are stored as float32: the validator rounds incoming floats to float32 so that
``decode(encode(x)) == x`` holds exactly for any validated event.
"""

from __future__ import annotations

import base64
from typing import Annotated, Any

import numpy as np
from pydantic import BeforeValidator, PlainSerializer, WithJsonSchema

_DTYPES = {"i4": np.dtype("<i4"), "f4": np.dtype("<f4"), "u1": np.dtype("<u1")}


def pack(values: list, code: str) -> str:
    arr = np.asarray(values, dtype=_DTYPES[code])
    return f"{code}:" + base64.b64encode(arr.tobytes()).decode("ascii")


def unpack(value: Any, code: str) -> list:
    """Accept a packed string or any sequence of numbers; return a list of Python numbers."""
    dtype = _DTYPES[code]
    if isinstance(value, str):
        prefix, sep, body = value.partition(":")
        if not sep or prefix != code:
            raise ValueError(f"expected a '{code}:'-packed array, got prefix {prefix!r}")
        try:
            raw = base64.b64decode(body, validate=True)
        except Exception as exc:  # binascii.Error
            raise ValueError(f"bad base64 in packed array: {exc}") from exc
        if len(raw) % dtype.itemsize:
            raise ValueError("packed array length is not a multiple of the item size")
        return np.frombuffer(raw, dtype=dtype).tolist()
    if isinstance(value, (list, tuple, np.ndarray)):
        arr = np.asarray(value)
        if arr.ndim != 1:
            raise ValueError("expected a flat array")
        if code != "f4" and arr.size and not np.issubdtype(arr.dtype, np.integer):
            raise ValueError("expected integers")
        if code == "u1" and arr.size and (arr.min() < 0 or arr.max() > 255):
            raise ValueError("mask values must be in 0..255")
        return arr.astype(dtype).tolist()
    raise ValueError(f"expected a packed array string or a list, got {type(value).__name__}")


def _packed(code: str, desc: str):
    return [
        BeforeValidator(lambda v: unpack(v, code)),
        PlainSerializer(lambda v: pack(v, code), return_type=str, when_used="json"),
        WithJsonSchema({"type": "string", "description": f"{desc}, packed as '{code}:<base64 little-endian>'"}),
    ]


Int32Array = Annotated[list[int], *_packed("i4", "int32 array")]
Float32Array = Annotated[list[float], *_packed("f4", "float32 array")]
ByteArray = Annotated[list[int], *_packed("u1", "uint8 array")]
