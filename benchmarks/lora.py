"""LoRA vs full fine-tuning in the fsdp trainer: bytes per weight sync and trainer peak memory.

    .venv/bin/python benchmarks/lora.py [--shape qwen2-0.5b|small] [--rank 8] [--tokens 64] [--rows 4]
        [--gradient-checkpointing] [--shard auto|always|never] [--logits-chunk-mib MIB] [--json]

Each case (full, then LoRA) runs in its own subprocess: one world-1 ``fsdp``
rank in that process (:func:`asyncflow_fsdp.testing.local_rank`, gloo on the
CPU, float32 master weights as the engine keeps them), built from a
``Qwen2Config`` with random weights, one GRPO train step, then one weight
export through the rank's real export path (plan, gather, buckets in shared
memory). Reported per case:

- ``sync_bytes``: bytes of the buckets of the update after the step
  (``export_dtype`` bfloat16, the 0.5B checkpoint's dtype; LoRA sends only the
  adapter's tensors, full fine-tuning every tensor);
- ``export_s``: the trainer side of that export (gather + pack + shared memory),
  not the end-to-end sync;
- ``rss_before_step_gib``: resident memory once set up (weights, imports);
- ``peak_rss_train_gib``: the process's peak resident memory from just before
  the train step to the end of the export (Linux ``VmHWM`` after resetting it
  through ``/proc/self/clear_refs``): weights, gradients, optimizer state,
  activations;
- ``peak_rss_setup_gib``: the peak up to the end of setup (rank 0 holds its
  source model and the sharded copy at once, whatever trains);
- ``peak_rss_gib``: the peak of the whole process, the larger of the two
  (``ru_maxrss`` cannot give it: the reset clears it too).

``--shard`` passes the engine's ``shard`` option (default: the engine's own
default; ``sharded`` in the output says whether the rank ran FSDP2), and
``--logits-chunk-mib`` the log-prob head's chunk (``0``: the whole
micro-batch's logits at once, the path before chunking). Memory figures
are the process's resident set, so they include what glibc's heap keeps of
freed tensors; ``MALLOC_MMAP_THRESHOLD_=262144`` in the environment makes it
return them, which shows the live tensors' share.

The ``qwen2-0.5b`` shape is Qwen2-0.5B's (hidden 896, 24 layers, 14 heads, 2
KV heads, intermediate 4864, vocab 151936, tied embeddings): 494M parameters,
about 10 GiB resident for full fine-tuning in float32 with AdamW.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SHAPES: dict[str, dict[str, Any]] = {
    "qwen2-0.5b": {"model_type": "qwen2", "hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14,
                   "num_key_value_heads": 2, "intermediate_size": 4864, "vocab_size": 151936,
                   "max_position_embeddings": 4096, "tie_word_embeddings": True},
    "small": {"model_type": "qwen2", "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 1024, "vocab_size": 8192,
              "max_position_embeddings": 1024, "tie_word_embeddings": True},
}


def _vm(field: str) -> int:
    """A ``/proc/self/status`` memory field in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def case(shape: str, lora: bool, rank: int, tokens: int, rows: int, checkpointing: bool,
         shard: str | None = None, logits_chunk_mib: float | None = None,
         model_dtype: str = "float32") -> dict[str, Any]:
    """One case, in this process (the parent runs each in a fresh subprocess)."""
    import torch

    import asyncflow_fsdp.forward

    from asyncflow_core import columns as C
    from asyncflow_core.launchers.rank_driver import from_shared_memory
    from asyncflow_core.plugins import get_plugin_manager
    from asyncflow_core.types import Batch, RaggedTensor
    from asyncflow_fsdp.testing import local_rank, train_payload

    cfg = dict(SHAPES[shape])
    options = {"model": {"hf_config": cfg, "dtype": model_dtype}, "device": "cpu", "mixed_precision": "float32",
               "export_dtype": "bfloat16", "lr": 1e-5, "cpu_threads_per_rank": os.cpu_count() or 1,
               "micro_batch_tokens": 1 << 20, "timeout_s": 3600, "setup_timeout_s": 3600,
               "gradient_checkpointing": checkpointing}
    if shard is not None:
        options["shard"] = shard
    if logits_chunk_mib is not None:  # the rank runs in this process: its log-prob head reads this at call time
        asyncflow_fsdp.forward.LOGITS_CHUNK_BYTES = int(logits_chunk_mib * 2**20)
    if lora:
        options["lora"] = {"rank": rank, "alpha": 2 * rank}
    gen = torch.Generator().manual_seed(0)
    vocab = cfg["vocab_size"]
    batch = Batch({
        C.PROMPT_IDS: RaggedTensor.from_sequences([torch.randint(0, vocab, (tokens,), generator=gen)
                                                   for _ in range(rows)]),
        C.RESPONSE_IDS: RaggedTensor.from_sequences([torch.randint(0, vocab, (tokens,), generator=gen)
                                                     for _ in range(rows)]),
        C.REWARD: torch.arange(rows, dtype=torch.float32) % 2,
        C.GROUP_ID: torch.zeros(rows, dtype=torch.int64),
    })
    algo = get_plugin_manager().create("algorithm", "grpo", {})
    t0 = time.perf_counter()
    with local_rank(options) as worker:
        setup_s = time.perf_counter() - t0
        sharded = bool(worker._fsdp)
        params = sum(p.numel() for p in worker.model.parameters())
        trainable = sum(p.numel() for p in worker.model.parameters() if p.requires_grad)
        logps, _ = worker.op_logprobs({"batch": batch, "micro_batches": [torch.arange(rows)], "passes": 1,
                                       "values": False})
        train = algo.compute_advantages(batch.with_columns(
            **{C.BEHAVIOR_LOGPROBS: RaggedTensor.from_sequences(logps, dtype=torch.float32)}))
        resident, setup_peak = _vm("VmRSS"), _vm("VmHWM")
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM: the train step's peak from here
        t1 = time.perf_counter()
        reply = worker.op_train(train_payload(train, algo, 0))
        step_s = time.perf_counter() - t1
        t2 = time.perf_counter()
        chunks = worker.op_export_plan({"bucket_bytes": 64 << 20})
        nbytes, tensors = 0, 0
        for i in range(chunks):
            for d in worker.op_export_chunk({"index": i, "version": 1, "bucket_bytes": 64 << 20}) or []:
                buffer = from_shared_memory(d["shm"], d["nbytes"])  # what the driver does; unlinks the segment
                nbytes += buffer.numel()
                tensors += len(d["metas"])
                del buffer
        worker.op_export_done(None)
        export_s = time.perf_counter() - t2
        train_peak = _vm("VmHWM")
    return {"shape": shape, "lora": lora, "rank": rank if lora else None, "parameters": params,
            "trainable_parameters": trainable, "sync_bytes": nbytes, "sync_tensors": tensors,
            "export_s": round(export_s, 3), "setup_s": round(setup_s, 1), "step_s": round(step_s, 1),
            "stepped": bool(reply["stepped"]), "gradient_checkpointing": checkpointing, "sharded": sharded,
            "logits_chunk_bytes": asyncflow_fsdp.forward.LOGITS_CHUNK_BYTES,
            "rss_before_step_gib": round(resident / 2**30, 3), "peak_rss_train_gib": round(train_peak / 2**30, 3),
            "peak_rss_setup_gib": round(setup_peak / 2**30, 3),
            "peak_rss_gib": round(max(setup_peak, train_peak) / 2**30, 3)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen2-0.5b")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank")
    p.add_argument("--tokens", type=int, default=64, help="prompt and response tokens per row")
    p.add_argument("--rows", type=int, default=4, help="rows in the train step")
    p.add_argument("--gradient-checkpointing", action="store_true", help="recompute activations in backward (both)")
    p.add_argument("--shard", choices=["auto", "always", "never"],
                   help="the engine's shard option (default: the engine's default)")
    p.add_argument("--logits-chunk-mib", type=float,
                   help="float32 logits per chunk of the log-prob head (default: asyncflow_fsdp.forward's; 0: the "
                        "whole micro-batch's logits at once)")
    p.add_argument("--model-dtype", choices=["float32", "bfloat16"], default="float32",
                   help="dtype rank 0 builds the source model in (the master weights are float32 either way)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--case", choices=["full", "lora"], help=argparse.SUPPRESS)  # the subprocess's own case
    a = p.parse_args(argv)
    if a.case:
        print(json.dumps(case(a.shape, a.case == "lora", a.rank, a.tokens, a.rows, a.gradient_checkpointing,
                              a.shard, a.logits_chunk_mib, a.model_dtype)))
        return 0
    results = {}
    for name in ("full", "lora"):
        cmd = [sys.executable, __file__, "--case", name, "--shape", a.shape, "--rank", str(a.rank),
               "--tokens", str(a.tokens), "--rows", str(a.rows), "--model-dtype", a.model_dtype]
        cmd += ["--gradient-checkpointing"] if a.gradient_checkpointing else []
        cmd += ["--shard", a.shard] if a.shard else []
        cmd += ["--logits-chunk-mib", str(a.logits_chunk_mib)] if a.logits_chunk_mib is not None else []
        out = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if out.returncode != 0:
            print(out.stderr[-3000:], file=sys.stderr)
            return out.returncode
        results[name] = json.loads(out.stdout.strip().splitlines()[-1])
    full, lora = results["full"], results["lora"]
    summary = {
        "shape": a.shape, "rank": a.rank, "rows": a.rows, "tokens": a.tokens,
        "gradient_checkpointing": a.gradient_checkpointing, "shard": a.shard,
        "logits_chunk_mib": a.logits_chunk_mib, "cases": results,
        "sync_bytes_ratio": lora["sync_bytes"] / full["sync_bytes"],
        "peak_rss_train_ratio": lora["peak_rss_train_gib"] / full["peak_rss_train_gib"],
        "peak_rss_ratio": lora["peak_rss_gib"] / full["peak_rss_gib"],
    }
    if a.json:
        print(json.dumps(summary, indent=2))
        return 0
    gc = ", gradient checkpointing" if a.gradient_checkpointing else ""
    print(f"shape {a.shape}, LoRA rank {a.rank}, {a.rows} rows x ({a.tokens} + {a.tokens}) tokens, 1 rank, CPU{gc}")
    print(f"{'case':6} {'trainable':>12} {'sync MiB':>10} {'export s':>9} {'train peak GiB':>15} {'peak GiB':>9}")
    for name, r in results.items():
        print(f"{name:6} {r['trainable_parameters']:>12,} {r['sync_bytes'] / 2**20:>10.2f} {r['export_s']:>9.3f} "
              f"{r['peak_rss_train_gib']:>15.2f} {r['peak_rss_gib']:>9.2f}")
    print(f"LoRA / full: sync bytes {summary['sync_bytes_ratio']:.4f}, train-step peak "
          f"{summary['peak_rss_train_ratio']:.3f}, whole-process peak {summary['peak_rss_ratio']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
