"""Weight sync benchmark: one model's weights from a trainer to a rollout engine, export -> transport -> load.

    PYTHONPATH=.:spec python benchmarks/weight_sync.py [--json] [--size 0.5b|100m|10m]
        [--transports inprocess,shm,dist] [--export fresh,arena,direct] [--load view,copy] [--repeats 2]
        [--warmup 2] [--bucket-mb 64]

The model is a Hugging Face ``Qwen2ForCausalLM`` with random fp32 weights
built on CPU (``--size 0.5b`` is the Qwen2.5-0.5B shape: 494M parameters,
1.98 GB; ``100m`` and ``10m`` are smaller Qwen2 shapes for quick runs). One
sync is what a trainer at world 1 and the torch rollout engine do:

- **export**: ``pack_buckets`` over the trainer model's ``state_dict`` (tied
  tensors once, as the fsdp worker exports them): the copy into bucket
  buffers plus the sender's digests. ``--export direct`` (the default) is
  the code as it is: ``pack_buckets`` fills and hashes each 8 MiB span in
  one task on the digest threads (so the sender's digest time is inside
  ``export``, not under ``digest``); ``shm`` packs straight into the
  shared-memory slot its next send writes (``transport.allocator()``, the
  first version into an ``ExportArena``), the others into an
  ``ExportArena`` kept across versions; the ``inprocess`` receiver trusts
  the digest the sender took of the same buffer; the engine loads in spans
  on the digest threads (``copy_tensors``). ``arena`` is the code before
  that: every transport packs into an ``ExportArena`` with ``copy_`` then
  hashes (``shm`` copies it into the segment in ``send``), the
  ``inprocess`` receiver hashes every bucket again (``recheck``) and the
  engine loads with one ``copy_`` per tensor.
  ``fresh`` allocates new buffers every sync on both sides, as before the
  arena (and rechecks too). The ``shm`` receiver maps the sender's segment
  (``reuse_buffers``, no copy) except under ``fresh``, where it copies into
  fresh memory. ``--export arena,direct``
  measures several, one after the other, in one invocation;
- **transfer**: ``transport.send`` until the engine side holds every bucket
  verified (``receive`` recomputes the digests);
- **load**: ``collect_update`` (the contract's checks, digests included)
  and the load into the engine model's tensors with the torch rollout
  engine's own loader (``WeightLoader``): ``--load view`` (the default, the
  engine's default) makes each model tensor a view of the received bucket
  (no copy; the engine holds that version until the next), ``--load copy``
  copies into the model's own tensors (the code before). ``--load
  copy,view`` measures both, one after the other, in one invocation.

Memory: each row reports the resident set of the process holding the
engine after the last sync, split into private (``anon``) and shared-memory
(``shmem``: mapped ``/dev/shm`` pages) GB, and its peak (``VmHWM``, reset
before each row where Linux allows). For ``inprocess`` that process holds
the trainer model and the export arena too; for ``shm`` and ``dist`` it is
the spawned engine alone.

``digest`` is the part of those three spent computing digests (sender and
receiver, outermost calls only), so export + transfer + load = total and
digest overlaps them. ``inprocess``: engine in this process. ``shm``:
engine in a spawned process. ``dist``: a 2-rank gloo group, engine on the
spawned rank 1. Each transport runs ``--warmup`` syncs (2: both arena
slots and both ``shm`` segments are touched), then ``--repeats`` measured
ones (median shown). ``memcpy`` is a ``copy_`` of the same number
of bytes into an already-touched buffer, measured in the same run. GB/s
counts the model's bytes once (10^9 bytes per GB).

``--lora RANK`` measures an adapter-only sync instead (``inprocess``): the
trainer is the model with a peft LoRA adapter of that rank on the attention
and MLP projections (``trainer.lora``'s default targets); the export is
``adapter_state_dict`` packed into buckets, and the engine is the real
``torch`` rollout engine (``configure_adapter`` + ``update_weights``: the
partial update's checks, then the merge ``W = W0 + scaling * B @ A`` per
targeted weight, or the load into live peft layers), once per
``--lora-modes`` entry. The report gives the adapter's bytes beside the
full model's.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import multiprocessing as mp
import os
import platform
import statistics
import sys
import threading
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from transport_bench import _aiter, _free_port, _options, emit  # noqa: E402  (reused: same transports, same options)

ALL_TRANSPORTS = ("inprocess", "shm", "dist")
LOAD_WITH_COPY_ = False  #: the engine loads with one copy_ per tensor (the code before "direct")
DEADLINE_S = 900.0
SIZES: dict[str, dict[str, int]] = {
    # Qwen2.5-0.5B: 494M parameters (tied embeddings), 1.98 GB in fp32
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936),
    "100m": dict(hidden_size=512, intermediate_size=2816, num_hidden_layers=12, num_attention_heads=8,
                 num_key_value_heads=2, vocab_size=65536),
    "10m": dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=8192),
}


def _median_row(label: str, measured: list[dict[str, float]], nbytes: int) -> dict[str, Any]:
    """One table row: the median of each phase over the repeats, and the GB/s of the median total."""
    row: dict[str, Any] = {"transport": label}
    for key in ("export_s", "digest_s", "transfer_s", "load_s", "total_s"):
        row[key] = statistics.median(r[key] for r in measured)
    row["seconds"] = row["total_s"]
    row["gb_per_s"] = nbytes / row["total_s"] / 1e9
    row["all_total_s"] = [r["total_s"] for r in measured]
    return row


def build_model(size: str, *, seed: int | None) -> torch.nn.Module:
    """A Qwen2 causal LM of ``size`` on CPU; random weights when ``seed`` is given, zeros (pages touched) otherwise."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**SIZES[size], tie_word_embeddings=True, torch_dtype="float32")
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config)
    model = model.to_empty(device="cpu")
    model.tie_weights()
    gen = torch.Generator().manual_seed(seed or 0)
    with torch.no_grad():
        for t in model.state_dict(keep_vars=True).values():
            if seed is None:
                t.zero_()
            else:
                t.uniform_(-0.05, 0.05, generator=gen)
    return model.eval()


def export_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The trainer's export list: ``state_dict`` order, tied tensors under their first name only."""
    seen: set[int] = set()
    out = []
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            out.append((name, t.detach()))
    return out


# ------------------------------------------------------------------ digest timing


class DigestClock:
    """Wall seconds spent inside the outermost digest calls (patched onto whichever digest functions exist)."""

    NAMES = (
        ("asyncflow_core.types.weights", "buffer_checksum"),
        ("asyncflow_core.types.weights", "weight_digest"),
        ("asyncflow_core.types.weights", "weight_digests"),
        ("asyncflow_plugins.weight_transports.manifest", "checksum"),
        ("asyncflow_plugins.weight_transports.manifest", "verify_all"),
        ("asyncflow_plugins.weight_transports.shm", "verify_all"),
        ("asyncflow_plugins.weight_transports.dist", "verify_all"),
    )

    def __init__(self) -> None:
        self.seconds = 0.0
        self._lock = threading.Lock()
        self._local = threading.local()

    def install(self) -> None:
        import importlib

        for module_name, attr in self.NAMES:
            module = importlib.import_module(module_name)
            fn = getattr(module, attr, None)
            if fn is not None and not getattr(fn, "_clocked", False):
                setattr(module, attr, self._wrap(fn))

    def _wrap(self, fn):
        @functools.wraps(fn)
        def clocked(*args, **kwargs):
            depth = getattr(self._local, "depth", 0)
            self._local.depth = depth + 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._local.depth = depth
                if depth == 0:
                    with self._lock:
                        self.seconds += time.perf_counter() - start

        clocked._clocked = True  # type: ignore[attr-defined]
        return clocked

    def take(self) -> float:
        with self._lock:
            s, self.seconds = self.seconds, 0.0
        return s


# ------------------------------------------------------------------ the engine side


def make_loader(params: dict[str, torch.Tensor], load: str):
    """The torch rollout engine's loader over ``params`` (``load``: view or copy, its ``weight_load``)."""
    from asyncflow_core.types import weights

    loader_cls = getattr(weights, "WeightLoader", None)
    if loader_cls is None:  # a tree from before the loader: the engine copied with copy_tensors
        return params
    return loader_cls(params, views=load == "view")


async def load_into(loader, version: int, buckets: list) -> None:
    """What the torch rollout engine's ``update_weights`` does: check the whole update, then load it."""
    from asyncflow_core.types import ModelTensors, collect_update

    params = loader if isinstance(loader, dict) else loader.named
    checked = await collect_update(version, _aiter(buckets), model=ModelTensors.of(params))
    pairs = [(name, tensor) for bucket in checked for name, tensor in bucket.tensors()]
    if LOAD_WITH_COPY_:  # the engine's load before it copied in spans (--export arena)
        with torch.no_grad():
            for name, src in pairs:
                params[name].copy_(src)
    elif isinstance(loader, dict):
        from asyncflow_core.types.weights import copy_tensors

        await asyncio.to_thread(copy_tensors, [(params[name], src) for name, src in pairs])
    else:
        await asyncio.to_thread(loader.load, pairs)  # as the torch engine's update_weights does


def memory() -> dict[str, float]:
    """This process's resident set now (GB: all, private, shared memory) and its peak since the last reset."""
    fields = {"VmRSS": "rss_gb", "RssAnon": "anon_gb", "RssShmem": "shmem_gb", "VmHWM": "peak_rss_gb"}
    out: dict[str, float] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in fields:
                    out[fields[key]] = int(value.split()[0]) * 1024 / 1e9
    except OSError:
        import resource

        out["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
    return out


def reset_peak() -> None:
    """Restart the peak resident set (``VmHWM``) from the current one (Linux >= 4.0); a no-op elsewhere."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _before_direct(on: bool) -> None:
    """The code before ``--export direct``: pack with ``copy_`` then hash, load with ``copy_`` (or as it is now)."""
    global LOAD_WITH_COPY_
    from asyncflow_core.types import weights

    original = getattr(weights, "_pack_and_digest_direct", None) or getattr(weights, "_pack_and_digest", None)
    if original is None:  # a tree from before the change: nothing to switch
        return
    weights._pack_and_digest_direct = original
    weights._pack_and_digest = (lambda *args: None) if on else original
    LOAD_WITH_COPY_ = on


def _engine(kind: str, options: dict[str, Any], size: str, versions: list[int], conn, before: bool = False,
            load: str = "view") -> None:
    """Spawned engine: receive each version (verified in ``receive``), load it, report times."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _before_direct(before)
    from asyncflow_core.plugins import get_plugin_manager

    clock = DigestClock()
    clock.install()
    model = build_model(size, seed=None)
    loader = make_loader(dict(model.state_dict(keep_vars=True)), load)
    reset_peak()

    async def main() -> None:
        t = get_plugin_manager().create("weight_transport", kind, options)
        conn.send("ready")
        try:
            for v in versions:
                clock.take()
                got = [b async for b in t.receive(min_version=v, deadline_s=DEADLINE_S)]
                received = time.monotonic()
                recv_digest = clock.take()
                await load_into(loader, v, got)
                loaded = time.monotonic()
                got_version = got[0].version
                del got  # the engine's own reference (with view loads the model still holds the version)
                conn.send({"version": got_version, "received": received, "loaded": loaded,
                           "digest_s": recv_digest + clock.take(), "memory": memory()})
            conn.recv()
        finally:
            await t.close()

    asyncio.run(main())


# ------------------------------------------------------------------ the trainer side


async def _measure(kind: str, size: str, repeats: int, bucket_mb: int, trainer: torch.nn.Module,
                   clock: DigestClock, *, export: str = "arena", warmup: int = 2,
                   load: str = "view") -> list[dict[str, float]]:
    from asyncflow_core.plugins import get_plugin_manager
    from asyncflow_core.types import pack_buckets
    from asyncflow_core.types.weights import ExportArena

    arena = ExportArena() if export != "fresh" else None
    _before_direct(export != "direct")
    versions = list(range(1, repeats + warmup + 1))  # the first ``warmup`` are not measured
    port = _free_port()
    name = f"wsync.{os.getpid()}"
    proc = conn = None
    params = None
    if kind == "inprocess":
        params = dict(build_model(size, seed=None).state_dict(keep_vars=True))
        loader = make_loader(params, load)
        reset_peak()
    else:
        ctx = mp.get_context("spawn")
        conn, child = ctx.Pipe()
        options = _options(kind, rank=1, port=port, name=name, disk_dir="")
        if kind == "shm":
            options["reuse_buffers"] = arena is not None
        proc = ctx.Process(target=_engine, args=(kind, options, size, versions, child, export != "direct", load))
        proc.start()
    sender_options = _options(kind, rank=0, port=port, name=name, disk_dir="")
    if kind == "inprocess" and export != "direct":
        sender_options["recheck"] = True  # the receiver hashed every bucket again before "direct"
    sender = get_plugin_manager().create("weight_transport", kind, sender_options)
    tensors = export_tensors(trainer)
    rows = []
    try:
        if conn is not None:
            await asyncio.to_thread(conn.recv)
        for version in versions:
            with torch.no_grad():  # a train step changes the weights between syncs
                tensors[0][1].add_(1e-3)
            clock.take()
            start = time.monotonic()
            allocate = arena.allocator() if arena is not None else None
            if kind == "shm" and export == "direct":
                allocate = sender.allocator(fallback=allocate)  # straight into the slot the send publishes
            buckets = list(pack_buckets(tensors, version=version, bucket_bytes=bucket_mb << 20, allocate=allocate))
            exported = time.monotonic()
            digest = clock.take()
            await sender.send(_aiter(buckets), deadline_s=DEADLINE_S)
            if conn is None:
                got = [b async for b in sender.receive(min_version=version, deadline_s=DEADLINE_S)]
                received = time.monotonic()
                await load_into(loader, version, got)
                loaded = time.monotonic()
                digest += clock.take()
                del got
                mem = memory()
            else:
                reply = await asyncio.to_thread(conn.recv)
                assert reply["version"] == version, (reply, version)
                received, loaded = reply["received"], reply["loaded"]
                digest += clock.take() + reply["digest_s"]
                mem = reply.get("memory", {})
            del buckets
            rows.append({"export_s": exported - start, "transfer_s": received - exported, "load_s": loaded - received,
                         "digest_s": digest, "total_s": loaded - start, "memory": mem})
        if conn is not None:
            conn.send("close")
    finally:
        await sender.close()
        if proc is not None:
            proc.join(60)
            if proc.is_alive():
                proc.kill()
    if params is not None:
        check = dict(tensors)
        name0 = tensors[-1][0]
        assert torch.equal(params[name0], check[name0]), "the engine's weights differ from the trainer's"
    if arena is not None and rows:
        rows[-1]["arena"] = arena.stats()
    if rows and params is not None and not isinstance(loader, dict):
        rows[-1]["loader"] = loader.stats()
    if rows and hasattr(sender, "stats"):
        rows[-1]["sender"] = sender.stats()
    return rows[warmup:]


def memcpy_seconds(nbytes: int, repeats: int) -> float:
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    times = []
    for _ in range(max(repeats, 3)):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_bench(transports: list[str], size: str, repeats: int, bucket_mb: int, *,
              exports: tuple[str, ...] = ("arena",), warmup: int = 2, loads: tuple[str, ...] = ("view",)) -> dict:
    clock = DigestClock()
    clock.install()
    trainer = build_model(size, seed=1)
    nbytes = sum(t.numel() * t.element_size() for _, t in export_tensors(trainer))
    memcpy = memcpy_seconds(nbytes, repeats)
    rows = [{"transport": "memcpy", "seconds": memcpy, "gb_per_s": nbytes / memcpy / 1e9}]
    for kind in transports:
        for export in exports:
            for load in loads:
                measured = asyncio.run(_measure(kind, size, repeats, bucket_mb, trainer, clock, export=export,
                                                warmup=warmup, load=load))
                label = f"{kind}/{export}" + (f"/{load}" if len(loads) > 1 else "")
                row = _median_row(label, measured, nbytes)
                for key in ("arena", "sender", "loader", "memory"):
                    if key in measured[-1]:
                        row[key] = measured[-1][key]
                row["load"] = load
                row["memcpy_ratio"] = row["total_s"] / memcpy
                rows.append(row)
    return {
        "benchmark": "weight_sync",
        "size": size,
        "bytes": nbytes,
        "repeats": repeats,
        "warmup": warmup,
        "bucket_mb": bucket_mb,
        "loadavg": _loadavg(),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                    "omp_threads": torch.get_num_threads(), "platform": platform.platform()},
        "results": rows,
    }


def _loadavg() -> list[float] | None:
    try:
        return [float(x) for x in open("/proc/loadavg").read().split()[:3]]
    except OSError:
        return None


def run_lora_bench(size: str, rank: int, modes: list[str], repeats: int, bucket_mb: int) -> dict:
    """Adapter-only syncs into the torch rollout engine, inprocess (see the module docstring)."""
    from asyncflow_core.plugins import get_plugin_manager
    from asyncflow_core.types import pack_buckets
    from asyncflow_core.types.adapter import LoraSpec, adapter_state_dict, wrap

    spec = LoraSpec(rank=rank, alpha=2.0 * rank)
    clock = DigestClock()
    clock.install()
    base = build_model(size, seed=1)
    full_bytes = sum(t.numel() * t.element_size() for _, t in export_tensors(base))
    trainer = wrap(base, spec)
    with torch.no_grad():  # a trained adapter: B is not zero
        for name, p in trainer.named_parameters():
            if "lora_B" in name:
                p.uniform_(-1e-3, 1e-3)
    adapter = [(n, t.detach()) for n, t in adapter_state_dict(trainer).items()]
    nbytes = sum(t.numel() * t.element_size() for _, t in adapter)
    hf = {"model_type": "qwen2", **SIZES[size], "tie_word_embeddings": True}
    rows = []

    async def measure(mode: str) -> list[dict[str, float]]:
        engine = get_plugin_manager().create("rollout_engine", "torch", {
            "model": {"hf_config": hf}, "device": "cpu", "lora_mode": mode})
        engine.configure_adapter(spec)
        await engine.start()
        sender = get_plugin_manager().create("weight_transport", "inprocess", {})
        out = []
        try:
            for version in range(1, repeats + 2):  # the first is a warm-up
                with torch.no_grad():
                    adapter[-1][1].add_(1e-4)  # a train step changes the adapter between syncs
                clock.take()
                start = time.monotonic()
                buckets = list(pack_buckets(adapter, version=version, bucket_bytes=bucket_mb << 20))
                exported = time.monotonic()
                digest = clock.take()
                await sender.send(_aiter(buckets), deadline_s=DEADLINE_S)
                got = [b async for b in sender.receive(min_version=version, deadline_s=DEADLINE_S)]
                received = time.monotonic()
                await engine.update_weights(version, _aiter(got))
                loaded = time.monotonic()
                assert engine.version == version
                out.append({"export_s": exported - start, "transfer_s": received - exported,
                            "load_s": loaded - received, "digest_s": digest + clock.take(),
                            "total_s": loaded - start})
                del got, buckets
        finally:
            await sender.close()
            await engine.shutdown()
        return out[1:]

    for mode in modes:
        measured = asyncio.run(measure(mode))
        rows.append(_median_row(f"inprocess/{mode}", measured, nbytes))
    return {
        "benchmark": "weight_sync_lora",
        "size": size,
        "rank": rank,
        "bytes": nbytes,
        "full_bytes": full_bytes,
        "fraction_of_full": nbytes / full_bytes,
        "repeats": repeats,
        "bucket_mb": bucket_mb,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                    "omp_threads": torch.get_num_threads(), "platform": platform.platform()},
        "results": rows,
    }


def print_table(report: dict) -> None:
    if report["benchmark"] == "weight_sync_lora":
        print(f"LoRA rank {report['rank']} on Qwen2 {report['size']}: {report['bytes'] / 1e6:.1f} MB per sync, "
              f"{100 * report['fraction_of_full']:.2f} % of the full model's {report['full_bytes'] / 1e9:.2f} GB")
    m = report["machine"]
    what = "adapter" if report["benchmark"] == "weight_sync_lora" else "fp32"
    print(f"weight sync: Qwen2 {report['size']} shape, {report['bytes'] / 1e9:.3f} GB {what}, buckets of "
          f"{report['bucket_mb']} MiB, median of {report['repeats']}; {m['cpus']} CPUs, torch {m['torch']}")
    print(f"{'transport':<22} {'export':>7} {'digest':>7} {'transfer':>9} {'load':>7} {'total s':>8} {'GB/s':>6} "
          f"{'x memcpy':>8} {'engine RSS GB (anon+shmem), peak':>34}")
    for r in report["results"]:
        if r["transport"] == "memcpy":
            print(f"{'memcpy':<22} {'':>7} {'':>7} {'':>9} {'':>7} {r['seconds']:>8.3f} {r['gb_per_s']:>6.2f}")
            continue
        ratio = f"{r['memcpy_ratio']:>8.1f}" if "memcpy_ratio" in r else ""
        mem = r.get("memory") or {}
        rss = (f"{mem.get('anon_gb', 0):.2f}+{mem.get('shmem_gb', 0):.2f}, {mem.get('peak_rss_gb', 0):.2f}"
               if mem else "")
        print(f"{r['transport']:<22} {r['export_s']:>7.3f} {r['digest_s']:>7.3f} {r['transfer_s']:>9.3f} "
              f"{r['load_s']:>7.3f} {r['total_s']:>8.3f} {r['gb_per_s']:>6.2f} {ratio} {rss:>34}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="Print one JSON object instead of a table.")
    parser.add_argument("--size", default="0.5b", choices=sorted(SIZES), help="Model shape (Qwen2).")
    parser.add_argument("--repeats", type=int, default=2, help="Measured syncs per transport (median shown).")
    parser.add_argument("--transports", default=",".join(ALL_TRANSPORTS), help="Which transports to run.")
    parser.add_argument("--bucket-mb", type=int, default=64, help="Bucket size of the export.")
    parser.add_argument("--export", default="direct",
                        help="Export buffers: direct (as the code is), arena (before direct), fresh (before the "
                             "arena), or several: arena,direct.")
    parser.add_argument("--warmup", type=int, default=2, help="Unmeasured syncs before the measured ones.")
    parser.add_argument("--load", default="view",
                        help="How the engine loads: view (its default: model tensors become views of the buckets), "
                             "copy (into the model's own tensors), or both: copy,view.")
    parser.add_argument("--lora", type=int, default=None, metavar="RANK",
                        help="Measure an adapter-only sync of a LoRA adapter of this rank (inprocess, torch engine).")
    parser.add_argument("--lora-modes", default="merged,live", help="With --lora: the torch engine's lora_mode(s).")
    args = parser.parse_args(argv)
    transports = [t for t in args.transports.split(",") if t]
    unknown = set(transports) - set(ALL_TRANSPORTS)
    if unknown:
        parser.error(f"unknown transports {sorted(unknown)}; choose from {ALL_TRANSPORTS}")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    exports = tuple(e for e in args.export.split(",") if e)
    if not exports or set(exports) - {"fresh", "arena", "direct"}:
        parser.error(f"--export takes fresh, arena, direct or several of them (arena,direct), got {args.export!r}")
    if args.warmup < 0:
        parser.error("--warmup must be at least 0")
    loads = tuple(x for x in args.load.split(",") if x)
    if not loads or set(loads) - {"view", "copy"}:
        parser.error(f"--load takes view, copy or both (copy,view), got {args.load!r}")
    if args.lora is not None:
        modes = [m for m in args.lora_modes.split(",") if m]
        if args.lora < 1 or set(modes) - {"merged", "live"} or not modes:
            parser.error("--lora takes a rank >= 1 and --lora-modes a list of merged, live")
        report = run_lora_bench(args.size, args.lora, modes, args.repeats, args.bucket_mb)
    else:
        report = run_bench(transports, args.size, args.repeats, args.bucket_mb, exports=exports, warmup=args.warmup,
                           loads=loads)
    return emit(report, args.json, print_table)


if __name__ == "__main__":
    sys.exit(main())
