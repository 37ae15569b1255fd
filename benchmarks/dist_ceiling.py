"""Raw gloo broadcast over loopback, 2 processes: the ceiling the ``dist`` weight transport works under.

    PYTHONPATH=.:spec python benchmarks/dist_ceiling.py [--json] [--mb 1888] [--connections 1,2,4]
        [--chunk-mb 16,64,256,512] [--repeats 2] [--variants touched,fresh,hash] [--socket]

One payload of ``--mb`` MiB (1888 MiB ~ the Qwen2.5-0.5B shape's 1.98 GB in
fp32) goes from rank 0 to rank 1 of a gloo group whose store and pairs bind
127.0.0.1, as ``asyncflow_plugins.weight_transports.dist`` builds it, but
with nothing of the transport around it: every message is posted with
``async_op`` at once (all in flight), then waited for in order.

- ``--connections N``: the group gets N gloo devices (``_Options._devices``),
  so N TCP pairs between the two ranks and N worker threads
  (``_Options._threads``); gloo gives each broadcast the context of its tag
  (round robin), so N messages move at once.
- ``--chunk-mb``: the size of each broadcast message.
- variants, on the receiver: ``touched`` receives into a buffer it has
  written before (pages mapped); ``fresh`` into a new ``torch.empty`` buffer
  each time (the first write to every page faults, as the transport's
  receiver did before it kept its buffers); ``hash`` is ``touched`` plus the
  transport's digest of every 8 MiB span as soon as the message holding it
  is in (on the digest threads), which is what the receiver must do.
- ``--socket``: a plain TCP socket pair over loopback moving the same bytes
  (``sendall`` / ``recv_into`` on one connection): the kernel's copy cost
  with no gloo at all.

Reported per row: wall seconds from the sender's start to the receiver's
end (``time.monotonic`` is one clock on the host), GB/s (10^9 bytes), and
the CPU seconds each process used (all its threads; the kernel's TCP copies
count to the process that makes the system call). Medians of ``--repeats``.
The load average at the start and the end is in the report: on a shared
2-core host the absolute figures move with it.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import socket
import statistics
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from transport_bench import _free_port, emit  # noqa: E402  (the same port picking and output as its siblings)

VARIANTS = ("touched", "fresh", "hash")


def _group(store: Any, rank: int, connections: int) -> Any:
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1") for _ in range(connections)]
    options._threads = max(2, connections)
    options._timeout = timedelta(seconds=300)
    return dist.ProcessGroupGloo(dist.PrefixStore(f"pg{connections}/", store), rank, 2, options)


def _ranges(total: int, chunk: int) -> list[tuple[int, int]]:
    return [(a, min(a + chunk, total)) for a in range(0, total, chunk)]


def _broadcast_all(pg: Any, buf: torch.Tensor, chunk: int, on_done=None) -> None:
    ranges = _ranges(buf.numel(), chunk)
    works = []
    for a, b in ranges:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        works.append(pg.broadcast([buf[a:b]], opts))
    for work, (a, b) in zip(works, ranges, strict=True):
        work.wait()
        if on_done is not None:
            on_done(a, b)


def _rank(rank: int, port: int, plan: list[dict[str, Any]], nbytes: int, conn) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from asyncflow_core.types.weights import DIGEST_SPAN_BYTES, digest_leaf, digest_pool

    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=120), use_libuv=False)
    groups = {c: _group(store, rank, c) for c in sorted({p["connections"] for p in plan})}
    buf = torch.ones(nbytes, dtype=torch.uint8) if rank == 0 else torch.zeros(nbytes, dtype=torch.uint8)
    out = []
    for i, p in enumerate(plan):
        pg = groups[p["connections"]]
        chunk = p["chunk_mb"] << 20
        target = buf
        if rank == 1 and p["variant"] == "fresh":
            target = torch.empty(nbytes, dtype=torch.uint8)
        leaves: list[Any] = []
        on_done = None
        if rank == 1 and p["variant"] == "hash":
            data = target.numpy()
            pool = digest_pool()
            done = [0]

            def hash_spans(a: int, b: int, data=data, pool=pool, done=done, leaves=leaves) -> None:
                """Hash every 8 MiB span that ends inside what has arrived (the transport's receiver does this)."""
                while done[0] + DIGEST_SPAN_BYTES <= b or (b == nbytes and done[0] < b):
                    end = min(done[0] + DIGEST_SPAN_BYTES, nbytes)
                    leaves.append(pool.submit(digest_leaf, data[done[0]:end]))
                    done[0] = end

            on_done = hash_spans
        store.set(f"ready/{i}/{rank}", "1")
        store.wait([f"ready/{i}/{1 - rank}"])
        cpu0 = time.process_time()
        start = time.monotonic()
        _broadcast_all(pg, target, chunk, on_done)
        for leaf in leaves:
            leaf.result()
        end = time.monotonic()
        out.append({"start": start, "end": end, "cpu_s": time.process_time() - cpu0})
        del target
    conn.send(out)
    store.set(f"done/{rank}", "1")
    store.wait([f"done/{1 - rank}"])
    for pg in groups.values():
        pg.shutdown()


def _socket_rank(rank: int, port: int, nbytes: int, repeats: int, conn) -> None:
    buf = torch.ones(nbytes, dtype=torch.uint8) if rank == 0 else torch.zeros(nbytes, dtype=torch.uint8)
    view = memoryview(buf.numpy()).cast("B")
    out = []
    if rank == 0:
        with socket.create_connection(("127.0.0.1", port)) as s:
            for _ in range(repeats):
                s.recv(1)  # the receiver is ready
                cpu0 = time.process_time()
                start = time.monotonic()
                s.sendall(view)
                out.append({"start": start, "cpu_s": time.process_time() - cpu0})
                s.recv(1)
    else:
        with socket.socket() as ls:
            ls.bind(("127.0.0.1", port))
            ls.listen(1)
            conn.send("listening")
            s, _ = ls.accept()
            with s:
                for _ in range(repeats):
                    cpu0 = time.process_time()
                    s.sendall(b"r")
                    got = 0
                    while got < nbytes:
                        got += s.recv_into(view[got:], nbytes - got)
                    out.append({"end": time.monotonic(), "cpu_s": time.process_time() - cpu0})
                    s.sendall(b"d")
    conn.send(out)


def _spawn(target, args_for_rank) -> list[Any]:
    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    for rank in (1, 0):  # the receiver first: the socket variant needs its listener up
        mine, theirs = ctx.Pipe()
        proc = ctx.Process(target=target, args=(*args_for_rank(rank), theirs))
        proc.start()
        if target is _socket_rank and rank == 1:
            mine.recv()
        pipes.append(mine)
        procs.append(proc)
    results = [pipe.recv() for pipe in pipes]
    for proc in procs:
        proc.join(60)
    recv, send = results
    return [(s, r) for s, r in zip(send, recv, strict=True)]


def run(mb: int, connections: list[int], chunks: list[int], variants: list[str], repeats: int,
        with_socket: bool) -> dict[str, Any]:
    nbytes = mb << 20
    load0 = os.getloadavg()
    plan = [{"connections": c, "chunk_mb": ch, "variant": v}
            for v in variants for c in connections for ch in chunks for _ in range(repeats)]
    port = _free_port()
    pairs = _spawn(_rank, lambda rank: (rank, port, plan, nbytes))
    rows: dict[tuple, list] = {}
    for p, (s, r) in zip(plan, pairs, strict=True):
        rows.setdefault((p["variant"], p["connections"], p["chunk_mb"]), []).append(
            (r["end"] - s["start"], s["cpu_s"], r["cpu_s"]))
    results = []
    for (variant, c, ch), ms in rows.items():
        secs = statistics.median(m[0] for m in ms)
        results.append({"path": f"gloo/{variant}", "connections": c, "chunk_mb": ch, "seconds": secs,
                        "gb_per_s": nbytes / secs / 1e9, "sender_cpu_s": statistics.median(m[1] for m in ms),
                        "receiver_cpu_s": statistics.median(m[2] for m in ms), "all_seconds": [m[0] for m in ms]})
    if with_socket:
        port = _free_port()
        ms = [(r["end"] - s["start"], s["cpu_s"], r["cpu_s"])
              for s, r in _spawn(_socket_rank, lambda rank: (rank, port, nbytes, repeats))]
        secs = statistics.median(m[0] for m in ms)
        results.append({"path": "socket", "connections": 1, "chunk_mb": mb, "seconds": secs,
                        "gb_per_s": nbytes / secs / 1e9, "sender_cpu_s": statistics.median(m[1] for m in ms),
                        "receiver_cpu_s": statistics.median(m[2] for m in ms), "all_seconds": [m[0] for m in ms]})
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    copies = []
    for _ in range(3):
        t = time.perf_counter()
        dst.copy_(src)
        copies.append(time.perf_counter() - t)
    memcpy = statistics.median(copies)
    return {
        "benchmark": "dist_ceiling",
        "bytes": nbytes,
        "repeats": repeats,
        "memcpy_s": memcpy,
        "memcpy_gb_per_s": nbytes / memcpy / 1e9,
        "loadavg": {"start": load0, "end": os.getloadavg()},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                    "platform": platform.platform()},
        "results": results,
    }


def print_table(report: dict[str, Any]) -> None:
    print(f"loopback broadcast of {report['bytes'] / 1e9:.2f} GB, rank 0 -> rank 1, median of {report['repeats']}; "
          f"memcpy {report['memcpy_s']:.3f} s ({report['memcpy_gb_per_s']:.2f} GB/s); load "
          f"{report['loadavg']['start'][0]:.1f} -> {report['loadavg']['end'][0]:.1f}; "
          f"{report['machine']['cpus']} CPUs, torch {report['machine']['torch']}")
    print(f"{'path':<14} {'conns':>5} {'chunk MiB':>9} {'seconds':>8} {'GB/s':>6} {'send cpu':>8} {'recv cpu':>8}")
    for r in report["results"]:
        print(f"{r['path']:<14} {r['connections']:>5} {r['chunk_mb']:>9} {r['seconds']:>8.3f} {r['gb_per_s']:>6.2f} "
              f"{r['sender_cpu_s']:>8.2f} {r['receiver_cpu_s']:>8.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="Print one JSON object instead of a table.")
    parser.add_argument("--mb", type=int, default=1888, help="Payload in MiB (1888 ~ 1.98 GB, the 0.5b shape).")
    parser.add_argument("--connections", default="1,2,4", help="gloo devices (TCP pairs), comma-separated.")
    parser.add_argument("--chunk-mb", default="16,64,256,512", help="Broadcast message sizes in MiB.")
    parser.add_argument("--variants", default="touched", help=f"Receiver variants among {VARIANTS}.")
    parser.add_argument("--repeats", type=int, default=2, help="Measurements per row (median shown).")
    parser.add_argument("--socket", action="store_true", help="Also time a plain loopback TCP socket.")
    args = parser.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    if not variants or set(variants) - set(VARIANTS):
        parser.error(f"--variants takes some of {VARIANTS}, got {args.variants!r}")
    try:
        connections = [int(c) for c in args.connections.split(",") if c]
        chunks = [int(c) for c in args.chunk_mb.split(",") if c]
    except ValueError:
        parser.error("--connections and --chunk-mb take comma-separated integers, e.g. 1,2,4")
    if args.mb < 1 or args.repeats < 1 or not connections or not chunks or min(connections + chunks) < 1:
        parser.error("--mb, --repeats, --connections and --chunk-mb must be positive")
    return emit(run(args.mb, connections, chunks, variants, args.repeats, args.socket), args.json, print_table)


if __name__ == "__main__":
    sys.exit(main())
