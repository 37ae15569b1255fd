"""A pickle-free encoding for control messages: a JSON header plus raw binary buffers.

Why not pickle: unpickling runs arbitrary code, so a control channel that
unpickles is only as safe as its authentication. The messages the store
exchanges are plain data (ints, strings, small int64 tensors such as row ids,
``BatchMeta`` handles, typed errors), so a JSON header that names each value's
type, followed by the raw bytes of each tensor, covers them with no code
execution on decode. Tensor payloads of puts and gets never travel here: they
go through shared memory (multiprocess) or torch.distributed (distributed).

Frame layout: ``u32 header length | header (UTF-8 JSON) | buffer 0 | buffer 1 | ...``;
the header lists each buffer's length.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from typing import Any

import torch

from asyncflow_core.errors import AsyncflowError
from asyncflow_core.interfaces.store import BatchMeta
from asyncflow_core.types import Batch, RaggedTensor

_U32 = struct.Struct("<I")
_META_FIELDS = tuple(f.name for f in dataclasses.fields(BatchMeta))


class CodecError(AsyncflowError, ValueError):
    """A control message could not be encoded or decoded (a bug or a corrupted peer)."""


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_name`; refuses anything that is not a torch dtype."""
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise CodecError(f"unknown tensor dtype {name!r} in a control message")
    return dtype


def _error_classes() -> dict[str, type[BaseException]]:
    """Errors a peer may raise across the channel, by class name: the typed store errors and a few builtins."""
    import asyncflow_core.errors as core_errors

    classes: dict[str, type[BaseException]] = {}
    modules = [core_errors]
    try:
        import asyncflow_core.store.errors as store_errors

        modules.append(store_errors)
    except ImportError:  # the store core is optional for the codec itself
        pass
    for module in modules:
        for value in vars(module).values():
            if isinstance(value, type) and issubclass(value, AsyncflowError):
                classes[value.__name__] = value
    for builtin in (ValueError, TypeError, KeyError, IndexError, RuntimeError, TimeoutError, NotImplementedError):
        classes.setdefault(builtin.__name__, builtin)
    return classes


def _make_error(name: str, message: str) -> BaseException:
    cls = _error_classes().get(name)
    if cls is None:
        return RuntimeError(f"remote {name}: {message}")
    try:
        err = cls.__new__(cls)
        BaseException.__init__(err, message)
        return err
    except Exception:  # an exception class with an unusual constructor
        return RuntimeError(f"remote {name}: {message}")


class _Encoder:
    def __init__(self) -> None:
        self.buffers: list[memoryview] = []

    def tensor(self, t: torch.Tensor) -> dict[str, Any]:
        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        self.buffers.append(memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b""))
        return {"$t": len(self.buffers) - 1, "dtype": dtype_name(t.dtype), "shape": list(t.shape)}

    def value(self, v: Any) -> Any:
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        if isinstance(v, torch.Tensor):
            return self.tensor(v)
        if isinstance(v, RaggedTensor):
            return {"$ragged": [self.tensor(v.values), self.tensor(v.offsets)]}
        if isinstance(v, BatchMeta):
            return {"$meta": {f: self.value(getattr(v, f)) for f in _META_FIELDS}}
        if isinstance(v, Batch):
            return {
                "$batch": {n: self.value(c) for n, c in v.items()},
                "row_ids": self.value(v.row_ids),
                "num_rows": v.num_rows,
            }
        if isinstance(v, (list, tuple)):
            return {"$list" if isinstance(v, list) else "$tuple": [self.value(x) for x in v]}
        if isinstance(v, dict):
            if all(isinstance(k, str) and not k.startswith("$") for k in v):
                return {k: self.value(x) for k, x in v.items()}
            return {"$dict": [[self.value(k), self.value(x)] for k, x in v.items()]}
        if isinstance(v, (bytes, bytearray, memoryview)):
            self.buffers.append(memoryview(v))
            return {"$bytes": len(self.buffers) - 1}
        if isinstance(v, BaseException):
            return {"$error": type(v).__name__, "message": str(v)}
        if isinstance(v, torch.dtype):
            return {"$dtype": dtype_name(v)}
        raise CodecError(f"cannot send a {type(v).__name__} over the store's control channel")


def encode(obj: Any) -> list[memoryview | bytes]:
    """Encode ``obj`` into frame parts (header first); ``b"".join(parts)`` is the frame."""
    enc = _Encoder()
    body = enc.value(obj)
    header = json.dumps({"v": body, "b": [b.nbytes for b in enc.buffers]}, separators=(",", ":")).encode()
    return [_U32.pack(len(header)) + header, *enc.buffers]


def encode_bytes(obj: Any) -> bytes:
    """Encode ``obj`` into one bytes object."""
    return b"".join(encode(obj))


class _Decoder:
    def __init__(self, buffers: list[memoryview]) -> None:
        self.buffers = buffers

    def tensor(self, d: dict[str, Any]) -> torch.Tensor:
        dtype = dtype_from_name(d["dtype"])
        shape = [int(s) for s in d["shape"]]
        raw = self.buffers[int(d["$t"])]
        if raw.nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        # bytearray copy: the frame buffer is reused by the reader, the tensor must own its bytes
        return torch.frombuffer(bytearray(raw), dtype=dtype).reshape(shape)

    def value(self, v: Any) -> Any:
        if not isinstance(v, dict):
            return v
        if "$t" in v:
            return self.tensor(v)
        if "$ragged" in v:
            values, offsets = v["$ragged"]
            return RaggedTensor(self.tensor(values), self.tensor(offsets))
        if "$meta" in v:
            fields = {k: self.value(x) for k, x in v["$meta"].items() if k in _META_FIELDS}
            fields["columns"] = tuple(fields.get("columns") or ())
            return BatchMeta(**fields)
        if "$batch" in v:
            cols = {k: self.value(x) for k, x in v["$batch"].items()}
            return Batch(cols, row_ids=self.value(v["row_ids"]), num_rows=v["num_rows"])
        if "$list" in v:
            return [self.value(x) for x in v["$list"]]
        if "$tuple" in v:
            return tuple(self.value(x) for x in v["$tuple"])
        if "$dict" in v:
            return {_hashable(self.value(k)): self.value(x) for k, x in v["$dict"]}
        if "$bytes" in v:
            return bytes(self.buffers[int(v["$bytes"])])
        if "$error" in v:
            return _make_error(str(v["$error"]), str(v.get("message", "")))
        if "$dtype" in v:
            return dtype_from_name(v["$dtype"])
        return {k: self.value(x) for k, x in v.items()}


def _hashable(k: Any) -> Any:
    return tuple(k) if isinstance(k, list) else k


def decode(frame: bytes | bytearray | memoryview) -> Any:
    """Decode one frame made by :func:`encode`."""
    mv = memoryview(frame)
    try:
        (hlen,) = _U32.unpack_from(mv, 0)
        header = json.loads(bytes(mv[4 : 4 + hlen]))
        pos = 4 + hlen
        buffers = []
        for n in header["b"]:
            buffers.append(mv[pos : pos + int(n)])
            pos += int(n)
        if pos != mv.nbytes:
            raise CodecError(f"control frame has {mv.nbytes - pos} trailing bytes")
        return _Decoder(buffers).value(header["v"])
    except CodecError:
        raise
    except (ValueError, KeyError, TypeError, struct.error) as exc:
        raise CodecError(f"malformed control frame: {exc}") from exc
