"""The JSON manifest every verified transport carries, and checks shared by ``shm``, ``dist`` and ``disk``.

A version travels as one flat payload: the bucket buffers laid end to end
(each starting at a multiple of 64 bytes). The manifest says where each
bucket lies in it, what tensors it holds and its checksum
(:func:`asyncflow_core.types.weights.weight_digest`, the one digest every
producer and checker calls). It is
plain JSON validated by a pydantic model — never pickle — so a receiver
reads metadata from another process (or a file anyone could have written)
without executing anything.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence
from typing import Literal, TypeVar

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from asyncflow_core.errors import WeightTransferError
from asyncflow_core.types import TensorMeta, WeightBucket
from asyncflow_core.types.weights import (
    BUCKET_ALIGNMENT,
    DIGEST_NAME,
    digest_pool,
    digest_spans,
    dtype_from_name,
    verify_buckets,
    weight_digest,
)

#: bumped from /1 when the digest changed from BLAKE2b to xxh3-128-tree: an old manifest is refused by its format
FORMAT = "asyncflow-weights/2"
_HEX = re.compile(r"^[0-9a-f]{32}$")


class TensorEntry(BaseModel):
    """One named tensor inside a bucket."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="Parameter name.")
    dtype: str = Field(description="Element type, e.g. 'bfloat16'.")
    shape: tuple[int, ...] = Field(description="Tensor shape.")
    offset: int = Field(ge=0, description="Byte offset inside its bucket's buffer.")


class BucketEntry(BaseModel):
    """One bucket: where it lies in the payload, its checksum and its tensors."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    index: int = Field(ge=0, description="Position of the bucket in its version, from 0.")
    offset: int = Field(ge=0, description="Byte offset of the bucket's buffer inside the version's payload.")
    nbytes: int = Field(ge=0, description="Length of the bucket's buffer in bytes.")
    checksum: str = Field(description=f"{DIGEST_NAME} hex digest of the buffer (weight_digest), computed by the "
                                      "trainer.")
    last: bool = Field(description="True on the final bucket of the version.")
    tensors: tuple[TensorEntry, ...] = Field(description="The named tensors packed in the buffer.")


class VersionManifest(BaseModel):
    """What a receiver needs to rebuild and verify one weight version."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: Literal["asyncflow-weights/2"] = Field(FORMAT, description="Manifest format tag.")
    version: int = Field(ge=0, description="Weight version.")
    total_bytes: int = Field(ge=0, description="Payload length: end of the last bucket.")
    buckets: tuple[BucketEntry, ...] = Field(description="Buckets in index order.")

    @model_validator(mode="after")
    def _whole_and_in_bounds(self) -> VersionManifest:
        """A manifest that does not describe one whole, in-bounds version is refused before any byte is read."""
        if not self.buckets:
            raise ValueError("a version must have at least one bucket")
        if [b.index for b in self.buckets] != list(range(len(self.buckets))):
            raise ValueError("bucket indices must be 0..n-1 in order")
        if not self.buckets[-1].last or any(b.last for b in self.buckets[:-1]):
            raise ValueError("only the final bucket may (and must) have last=True")
        end = 0
        for b in self.buckets:
            if b.offset < end or b.offset % BUCKET_ALIGNMENT:
                raise ValueError(f"bucket {b.index} overlaps the previous one or is not {BUCKET_ALIGNMENT}-aligned")
            if not _HEX.match(b.checksum):
                raise ValueError(f"bucket {b.index} has a malformed checksum {b.checksum!r}")
            for t in b.tensors:
                try:
                    itemsize = dtype_from_name(t.dtype).itemsize
                except WeightTransferError as exc:
                    raise ValueError(str(exc)) from None
                n = itemsize
                for d in t.shape:
                    if d < 0:
                        raise ValueError(f"tensor {t.name!r} has a negative dimension")
                    n *= d
                if t.offset + n > b.nbytes:
                    raise ValueError(f"tensor {t.name!r} extends past the end of bucket {b.index}")
            end = b.offset + b.nbytes
        if end != self.total_bytes:
            raise ValueError(f"total_bytes is {self.total_bytes} but the buckets end at {end}")
        return self


M = TypeVar("M", bound=BaseModel)


def align(n: int) -> int:
    return (n + BUCKET_ALIGNMENT - 1) // BUCKET_ALIGNMENT * BUCKET_ALIGNMENT


def manifest_for(buckets: Sequence[WeightBucket]) -> VersionManifest:
    """Lay ``buckets`` (one whole version, already checked) end to end and describe them."""
    entries = []
    offset = 0
    for b in buckets:
        entries.append(
            BucketEntry(
                index=b.index,
                offset=offset,
                nbytes=b.nbytes,
                checksum=b.checksum,
                last=b.last,
                tensors=tuple(TensorEntry(name=m.name, dtype=m.dtype, shape=m.shape, offset=m.offset) for m in b.metas),
            )
        )
        offset = align(offset + b.nbytes)
    total = entries[-1].offset + entries[-1].nbytes
    return VersionManifest(version=buckets[0].version, total_bytes=total, buckets=tuple(entries))


def parse_manifest(text: str | bytes, model: type[M], *, source: str) -> M:
    """Validate a manifest's JSON against ``model``; a malformed one is a ``WeightTransferError`` naming ``source``."""
    try:
        return model.model_validate_json(text)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "<root>"
        raise WeightTransferError(f"the weight manifest from {source} is invalid at {where}: {first['msg']}") from None


def buckets_from_payload(manifest: VersionManifest, payload: torch.Tensor) -> list[WeightBucket]:
    """Buckets whose buffers are views into ``payload`` (1-D uint8 of ``manifest.total_bytes``)."""
    if payload.numel() < manifest.total_bytes:
        raise WeightTransferError(
            f"version {manifest.version} arrived with {payload.numel()} bytes, its manifest says {manifest.total_bytes}"
        )
    return [
        WeightBucket(
            version=manifest.version,
            index=b.index,
            metas=tuple(TensorMeta(t.name, t.dtype, tuple(t.shape), t.offset) for t in b.tensors),
            buffer=payload[b.offset : b.offset + b.nbytes],
            checksum=b.checksum,
            last=b.last,
        )
        for b in manifest.buckets
    ]


checksum = weight_digest  #: the core digest, under the name this module used


def verify_all(buckets: Sequence[WeightBucket], *, where: str) -> None:
    """Check every bucket against its checksum (in parallel); the first mismatch is a ``WeightTransferError``."""
    verify_buckets(buckets, where=where)


def copy_into(payload: torch.Tensor, manifest: VersionManifest, buckets: Sequence[WeightBucket], *,
              only: Collection[int] | None = None) -> None:
    """Write each bucket's buffer at its manifest offset in ``payload`` (the padding between them is left as is).

    The copy runs in spans of ``DIGEST_SPAN_BYTES`` on the digest threads
    (``numpy.copyto`` releases the GIL). ``only``: the indices of the
    buckets to copy (the others are already in place).
    """
    dst = payload.numpy()
    jobs = []
    for entry, bucket in zip(manifest.buckets, buckets, strict=True):
        if only is not None and entry.index not in only:
            continue
        src = bucket.buffer.reshape(-1)
        if src.device.type != "cpu":
            payload[entry.offset : entry.offset + entry.nbytes].copy_(src)
            continue
        src_np = src.numpy()
        jobs += [(dst[entry.offset + a : entry.offset + b], src_np[a:b]) for a, b in digest_spans(entry.nbytes)]
    if len(jobs) <= 1:
        for d, s in jobs:
            np.copyto(d, s)
        return
    list(digest_pool().map(lambda job: np.copyto(*job), jobs))

