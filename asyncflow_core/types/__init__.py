"""Value types shared by every interface: ragged sequences, columnar batches,
generation requests/results, weight buckets, dataset records and reward inputs."""

from asyncflow_core.types.batch import Batch, Column
from asyncflow_core.types.generation import FinishReason, GenerationRequest, GenerationResult, SamplingParams
from asyncflow_core.types.ragged import RaggedTensor
from asyncflow_core.types.records import PromptRecord, RewardInput, RewardOutput
from asyncflow_core.types.weights import (
    ExportArena,
    ModelTensors,
    TensorMeta,
    WeightBucket,
    buffer_checksum,
    collect_update,
    pack_buckets,
    verify_buckets,
    weight_digest,
    weight_digests,
)

__all__ = [
    "Batch",
    "Column",
    "ExportArena",
    "FinishReason",
    "GenerationRequest",
    "GenerationResult",
    "ModelTensors",
    "PromptRecord",
    "RaggedTensor",
    "RewardInput",
    "RewardOutput",
    "SamplingParams",
    "TensorMeta",
    "WeightBucket",
    "buffer_checksum",
    "collect_update",
    "pack_buckets",
    "verify_buckets",
    "weight_digest",
    "weight_digests",
]
