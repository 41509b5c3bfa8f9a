"""The wire format between the grader and the sandbox: plain data as JSON, never pickle.

A submission's code runs in another process (`autograder.sandbox.process`). Everything that crosses back is
decoded here by hand into a small set of types, so no object the submission made can reach the
grader's process: not an object whose ``__eq__`` always says yes, not a list subclass, not a
pickle that runs code when loaded.

Encoded values are JSON, with tagged objects for what JSON lacks:

==================  ==============================================================
Python value        JSON
==================  ==============================================================
None, bool, str     themselves
int, float          themselves (NaN and infinities as ``{"$f": "nan"}`` etc.)
list                a JSON array
tuple               ``{"$t": [...]}``
set, frozenset      ``{"$s": [...]}`` (decoded as a set)
bytes               ``{"$b": "<base64>"}``
dict                ``{"$d": [[key, value], ...]}`` (keys may be ints, tuples, ...)
numpy array         ``{"$nd": [dtype, shape, "<base64 of the raw bytes>"]}``
torch tensor        ``{"$pt": [dtype, shape, "<base64 of the raw bytes>"]}``
a sandbox object    ``{"$h": id, "type": "ClassName", "callable": bool}`` (a handle)
==================  ==============================================================

Messages are framed as an 8-byte big-endian length followed by that many bytes of UTF-8 JSON.

What the grader decodes comes from a process it does not trust, so decoding is bounded: a reply of at
most `MAX_REPLY_BYTES`, `MAX_ITEMS` values in all, `MAX_KEYS` entries in one dict or set, no more than
`MAX_SAME_HASH` keys of one dict or set sharing a hash (ints such as ``k * (2**61 - 1)`` all hash
alike, and would make building the dict quadratic), nesting of at most `MAX_DEPTH`, and a deadline.

Deliberately left out: custom classes, and any way to send code.
"""

from __future__ import annotations

import base64
import json
import math
import os
import time
from collections.abc import Callable
from typing import Any

MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # a bigger request is refused by the sandbox
MAX_REPLY_BYTES = 8 * 1024 * 1024  # a bigger reply is refused by the grader (and fails the call)
MAX_DEPTH = 64  # nesting deeper than this is refused
MAX_ITEMS = 1_000_000  # values in one decoded message
MAX_KEYS = 100_000  # entries in one dict or set
MAX_SAME_HASH = 16  # keys of one dict or set with the same hash
DECODE_SECONDS = 10.0  # the longest the grader spends decoding one reply
HEADER_BYTES = 8

# Array dtypes that may cross, by name. Object arrays never do.
ARRAY_DTYPES = frozenset(
    ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]
    + ["float16", "float32", "float64", "complex64", "complex128"]
)
TENSOR_DTYPES = frozenset(
    ["bool", "int8", "int16", "int32", "int64", "uint8", "float16", "float32", "float64", "bfloat16"]
)


class CodecError(ValueError):
    """A message that is not valid under this format (too big, too deep, wrong tags, bad arrays)."""


# ---------------------------------------------------------------------------------------------- encode


def encode(value: Any, make_handle: Callable[[Any], dict] | None = None, _depth: int = 0) -> Any:
    """Turn ``value`` into JSON-ready data; objects that are not plain data go through ``make_handle``.

    Subclasses of the plain types are sent as the plain type (a ``str`` subclass arrives as a ``str``).
    Without ``make_handle`` any other object raises `CodecError`.
    """
    if _depth > MAX_DEPTH:
        raise CodecError(f"value is nested more than {MAX_DEPTH} levels deep")
    if value is None or isinstance(value, bool):
        return None if value is None else bool(value)
    # The base types' own conversions: a subclass's __str__ or __int__ (an enum's, say) is not its value.
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        v = float.__float__(value)
        return v if math.isfinite(v) else {"$f": repr(v)}
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {"$b": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, list):
        return [encode(v, make_handle, _depth + 1) for v in list.__iter__(value)]
    if isinstance(value, tuple):
        return {"$t": [encode(v, make_handle, _depth + 1) for v in tuple.__iter__(value)]}
    if isinstance(value, (set, frozenset)):
        return {"$s": [encode(v, make_handle, _depth + 1) for v in value]}
    if isinstance(value, dict):
        items = dict.items(value)
        return {
            "$d": [[encode(k, make_handle, _depth + 1), encode(v, make_handle, _depth + 1)] for k, v in items]
        }
    kind = type(value).__module__.split(".")[0]
    if kind == "numpy":
        encoded = _encode_numpy(value)
        if encoded is not None:
            return encoded
    if kind == "torch":
        encoded = _encode_torch(value)
        if encoded is not None:
            return encoded
    if make_handle is None:
        raise CodecError(f"cannot send a {type(value).__name__} object as plain data")
    return make_handle(value)


def _encode_numpy(value: Any) -> Any:
    import numpy as np

    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return encode(float(value))
    if isinstance(value, np.ndarray) and value.dtype.name in ARRAY_DTYPES:
        arr = np.ascontiguousarray(value)
        return {"$nd": [arr.dtype.str, list(arr.shape), base64.b64encode(arr.tobytes()).decode("ascii")]}
    return None


def _encode_torch(value: Any) -> Any:
    import torch

    if not isinstance(value, torch.Tensor):
        return None
    dtype = str(value.dtype).removeprefix("torch.")
    if dtype not in TENSOR_DTYPES:
        return None
    t = value.detach().cpu().contiguous()
    raw = t.view(torch.int16) if dtype == "bfloat16" else t
    data = raw.numpy().tobytes()
    return {"$pt": [dtype, list(t.shape), base64.b64encode(data).decode("ascii")]}


# ---------------------------------------------------------------------------------------------- decode


def decode(data: Any, make_remote: Callable[[dict], Any] | None = None, deadline: float | None = None) -> Any:
    """Rebuild a value from `encode`'s output, creating only the types in the module docstring.

    Handles become ``make_remote(tag)``; without ``make_remote`` a handle raises `CodecError`. Past
    ``deadline`` (`time.monotonic`), or beyond the limits in the module docstring, `CodecError`.
    """
    return _Decoder(make_remote, deadline).value(data, 0)


class _Decoder:
    """One message's decoding: counts what it builds and watches the clock."""

    def __init__(self, make_remote: Callable[[dict], Any] | None, deadline: float | None):
        self.make_remote = make_remote
        self.deadline = deadline
        self.items = 0

    def tick(self) -> None:
        self.items += 1
        if self.items > MAX_ITEMS:
            raise CodecError(f"a message may hold at most {MAX_ITEMS} values")
        if self.deadline is not None and self.items % 1024 == 0 and time.monotonic() > self.deadline:
            raise CodecError("decoding the message took too long")

    def value(self, data: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise CodecError(f"value is nested more than {MAX_DEPTH} levels deep")
        self.tick()
        if data is None or type(data) in (bool, int, float, str):
            return data
        if type(data) is list:
            return [self.value(v, depth + 1) for v in data]
        if type(data) is not dict or len(data) == 0:
            raise CodecError(f"unexpected {type(data).__name__} in message")
        if "$t" in data:
            return tuple(self.value(v, depth + 1) for v in _list(data["$t"]))
        if "$b" in data:
            return _b64(data["$b"])
        if "$s" in data:
            members = [self.value(v, depth + 1) for v in _list(data["$s"])]
            _check_keys(members)
            return set(members)
        if "$d" in data:
            items = []
            for item in _list(data["$d"]):
                if type(item) is not list or len(item) != 2:
                    raise CodecError("a dict item must be a [key, value] pair")
                items.append((self.value(item[0], depth + 1), self.value(item[1], depth + 1)))
            _check_keys([key for key, _ in items])
            return dict(items)
        if "$f" in data:
            if data["$f"] not in ("nan", "inf", "-inf"):
                raise CodecError(f"bad float {data['$f']!r}")
            return float(data["$f"])
        if "$nd" in data:
            return _decode_array(data["$nd"])
        if "$pt" in data:
            return _decode_tensor(data["$pt"])
        if "$h" in data:
            if self.make_remote is None or type(data["$h"]) is not int:
                raise CodecError("unexpected object handle")
            return self.make_remote(data)
        raise CodecError(f"unknown tag in {sorted(data)[:3]}")


def _check_keys(keys: list) -> None:
    """Refuse the keys of a dict or set that are too many, unhashable, or collide on purpose."""
    if len(keys) > MAX_KEYS:
        raise CodecError(f"a dict or set may hold at most {MAX_KEYS} entries")
    seen: dict[int, int] = {}
    for key in keys:
        try:
            h = hash(key)
        except TypeError as e:  # an unhashable key or member such as a list
            raise CodecError(f"unusable dict key or set member: {e}") from None
        seen[h] = seen.get(h, 0) + 1
        if seen[h] > MAX_SAME_HASH:
            raise CodecError(f"more than {MAX_SAME_HASH} keys of a dict or set share one hash")


def _list(value: Any) -> list:
    if type(value) is not list:
        raise CodecError(f"expected a list, got {type(value).__name__}")
    return value


def _b64(value: Any) -> bytes:
    if type(value) is not str:
        raise CodecError("bytes must be base64 text")
    try:
        return base64.b64decode(value.encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError) as e:
        raise CodecError(f"bad base64: {e}") from None


def _shape(value: Any) -> tuple[int, ...]:
    shape = _list(value)
    if len(shape) > 32 or not all(type(n) is int and 0 <= n for n in shape):
        raise CodecError(f"bad array shape {shape!r}")
    return tuple(shape)


def _decode_array(spec: Any) -> Any:
    import numpy as np

    spec = _list(spec)
    if len(spec) != 3 or type(spec[0]) is not str:
        raise CodecError("an array is [dtype, shape, data]")
    try:
        dtype = np.dtype(spec[0])
    except TypeError:
        raise CodecError(f"bad array dtype {spec[0]!r}") from None
    if dtype.name not in ARRAY_DTYPES:
        raise CodecError(f"array dtype {dtype.name} may not be sent")
    shape = _shape(spec[1])
    raw = _b64(spec[2])
    if len(raw) != math.prod(shape) * dtype.itemsize:
        raise CodecError("array data does not match its shape")
    return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()


def _decode_tensor(spec: Any) -> Any:
    import numpy as np
    import torch

    spec = _list(spec)
    if len(spec) != 3 or spec[0] not in TENSOR_DTYPES:
        raise CodecError("a tensor is [dtype, shape, data] with a plain dtype")
    shape = _shape(spec[1])
    raw = _b64(spec[2])
    np_dtype = np.dtype("int16" if spec[0] == "bfloat16" else spec[0])
    if len(raw) != math.prod(shape) * np_dtype.itemsize:
        raise CodecError("tensor data does not match its shape")
    t = torch.from_numpy(np.frombuffer(raw, dtype=np_dtype).reshape(shape).copy())
    return t.view(torch.bfloat16) if spec[0] == "bfloat16" else t


# ---------------------------------------------------------------------------------------------- framing


def dumps(message: dict) -> bytes:
    """A framed message: length header, then compact JSON."""
    body = json.dumps(message, separators=(",", ":"), allow_nan=False).encode("utf-8")
    return len(body).to_bytes(HEADER_BYTES, "big") + body


def loads(body: bytes) -> dict:
    """Parse one message body (without its header); anything but a JSON object raises `CodecError`."""
    if len(body) > MAX_MESSAGE_BYTES:
        raise CodecError(f"message of {len(body)} bytes is larger than {MAX_MESSAGE_BYTES}")
    try:
        message = json.loads(body.decode("utf-8"))
    except (ValueError, RecursionError) as e:
        raise CodecError(f"message is not valid JSON: {str(e)[:200]}") from None
    if type(message) is not dict:
        raise CodecError("a message must be a JSON object")
    return message


def write_message(fd: int, message: dict) -> None:
    """Write one framed message to a file descriptor (blocking)."""
    view = memoryview(dumps(message))
    while view:
        n = os.write(fd, view)
        view = view[n:]


def read_exact(fd: int, n: int) -> bytes:
    """Read exactly ``n`` bytes (blocking); `EOFError` if the other end closes first."""
    chunks, left = [], n
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise EOFError("pipe closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_message(fd: int) -> dict:
    """Read one framed message (blocking). Used on the sandbox side, where the grader is trusted."""
    size = int.from_bytes(read_exact(fd, HEADER_BYTES), "big")
    if size > MAX_MESSAGE_BYTES:
        raise CodecError(f"message of {size} bytes is larger than {MAX_MESSAGE_BYTES}")
    return loads(read_exact(fd, size))
