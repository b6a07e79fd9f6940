"""`lit-parallel doctor`: is this machine ready for distributed training, and if not, what to do.

Checks versions, devices and backends in this process, then starts N ranks that (1) all-reduce
their rank (the sum must be N(N-1)/2) and (2) measure all-reduce bus bandwidth for a few sizes.
Every failure is printed with the fix that usually applies.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time
from dataclasses import dataclass
from typing import Any

from lit_parallel.commands.launch import add_worker_arguments
from lit_parallel.measure.collectives import bus_bandwidth

SIZES = (4 * 1024, 256 * 1024, 4 * 1024 * 1024, 32 * 1024 * 1024)

FIXES = {
    "backend": "install a torch build with this backend (gloo ships with every build; NCCL needs a CUDA build)",
    "nccl_devices": "NCCL needs one CUDA device per rank: lower --devices or use --backend gloo",
    "launch_timeout": (
        "the ranks did not meet: check that MASTER_ADDR resolves and MASTER_PORT is free and not blocked by a"
        " firewall; on multi-homed hosts pin the interface with GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME"
        " (e.g. =eth0); for NCCL set NCCL_DEBUG=INFO to see which transport it picks"
    ),
    "launch_failed": (
        "a rank failed to start or crashed: read its traceback above; NCCL errors often mean a wrong"
        " interface (NCCL_SOCKET_IFNAME), no InfiniBand (NCCL_IB_DISABLE=1) or blocked P2P (NCCL_P2P_DISABLE=1)"
    ),
    "wrong_sum": (
        "all-reduce returned a wrong sum: the transport corrupts data; try NCCL_P2P_DISABLE=1 /"
        " NCCL_IB_DISABLE=1 to rule out a faulty link, and update the driver"
    ),
}


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--devices", type=int, default=2, help="ranks to start for the live checks (default 2)")
    p.add_argument(
        "--backend", choices=("gloo", "nccl"), default=None, help="default: nccl with CUDA, else gloo"
    )
    p.add_argument("--timeout", type=float, default=120.0, help="seconds before the live checks give up")
    p.add_argument("--repeats", type=int, default=5, help="timed all-reduces per size (median)")
    add_worker_arguments(p)


def run(args: argparse.Namespace) -> int:
    if args.worker:
        return _worker(args)
    if args.devices < 1 or args.repeats < 1 or args.timeout <= 0:
        raise ValueError("--devices and --repeats must be at least 1 and --timeout positive")
    backend, checks, env_rows = environment_checks(args.devices, args.backend)
    live: dict[str, Any] | None = None
    if all(c.ok for c in checks):
        live, more = live_checks(args, backend)
        checks += more
    print_report(env_rows, checks, live)
    return 0 if all(c.ok for c in checks) else 1


def environment_checks(devices: int, backend: str | None) -> tuple[str, list[Check], list[tuple[str, str]]]:
    """Versions, devices and backend availability in this process (no process group)."""
    import lightning
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    n_gpu = torch.cuda.device_count() if cuda else 0
    backend = backend or ("nccl" if cuda and n_gpu >= devices else "gloo")
    nccl_version = ".".join(map(str, torch.cuda.nccl.version())) if cuda and dist.is_nccl_available() else "-"
    rows = [
        ("torch", torch.__version__),
        ("lightning", lightning.__version__),
        ("CUDA", torch.version.cuda or "- (CPU build)"),
        ("NCCL", nccl_version),
        ("visible CUDA devices", f"{n_gpu}" + (f" ({torch.cuda.get_device_name(0)})" if n_gpu else "")),
        ("CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES", "(unset)")),
        ("CPU cores", str(os.cpu_count())),
        (
            "backends available",
            ", ".join(b for b in ("gloo", "nccl", "mpi") if _available(dist, b)) or "none",
        ),
    ]
    checks = [
        Check(
            f"backend {backend!r} available",
            _available(dist, backend),
            f"torch.distributed.is_{backend}_available()",
            FIXES["backend"],
        )
    ]
    if backend == "nccl":
        checks.append(
            Check(
                "one CUDA device per rank",
                n_gpu >= devices,
                f"{devices} ranks, {n_gpu} visible devices",
                FIXES["nccl_devices"],
            )
        )
    return backend, checks, rows


def _available(dist, backend: str) -> bool:
    return bool(getattr(dist, f"is_{backend}_available", lambda: False)())


def live_checks(args: argparse.Namespace, backend: str) -> tuple[dict[str, Any] | None, list[Check]]:
    from lit_parallel.commands.launch import run_ranks

    start = time.perf_counter()
    try:
        result = run_ranks(
            "lit_parallel.commands.doctor",
            args.devices,
            [f"--backend={backend}", f"--repeats={args.repeats}", f"--devices={args.devices}"],
            timeout=args.timeout,
        )
    except subprocess.TimeoutExpired:
        return None, [
            Check("ranks meet", False, f"no rendezvous within {args.timeout:.0f} s", FIXES["launch_timeout"])
        ]
    except RuntimeError as err:
        return None, [Check("ranks start and run", False, str(err), FIXES["launch_failed"])]
    n = args.devices
    expected = n * (n - 1) // 2
    checks = [
        Check(
            "process group initialises",
            True,
            f"{n} ranks on {backend} in {result['init_s']:.2f} s (launch {time.perf_counter() - start:.1f} s)",
        ),
        Check(
            "all-reduce sanity (sum of ranks)",
            result["sum"] == expected,
            f"got {result['sum']}, expected N(N-1)/2 = {expected}",
            FIXES["wrong_sum"],
        ),
    ]
    return result, checks


def print_report(env_rows, checks: list[Check], live: dict[str, Any] | None) -> None:
    from rich.markup import escape

    from lit_parallel.commands.terminal import Column, fit_table, terminal_console
    from lit_parallel.formatting import format_bytes

    console = terminal_console()
    width = console.width
    env = [[f"[bold]{k}[/bold]", escape(v)] for k, v in env_rows]
    columns = [Column("what"), Column("value", wrap=True)]
    console.print(fit_table(columns, env, width=width, title="environment", show_header=False))
    rows = [
        [escape(c.name), "[green]ok[/green]" if c.ok else "[red]FAILED[/red]", escape(c.detail)]
        for c in checks
    ]
    columns = [Column("check", wrap=True), Column("result"), Column("detail", wrap=True)]
    console.print(fit_table(columns, rows, width=width, title="checks"))
    for c in checks:
        if not c.ok:
            console.print(f"[red]{escape(c.name)}[/red]: {escape(c.fix)}")
    if live:
        columns = [Column(h, "right") for h in ("size", "time (us)", "algbw (GB/s)", "busbw (GB/s)")]
        rows = [
            [
                # the sizes are whole KiB / MiB: "32 MiB" reads better than "32.00 MiB"
                format_bytes(row["bytes"]).replace(".00 ", " "),
                f"{row['time_s'] * 1e6:.1f}",
                f"{row['algbw_gbps']:.3f}",
                f"{row['busbw_gbps']:.3f}",
            ]
            for row in live["bandwidth"]
        ]
        title = f"all-reduce bandwidth ({live['world_size']} ranks, {live['backend']}, median)"
        console.print(fit_table(columns, rows, width=width, title=title))
        console.print("busbw = algbw x 2(N-1)/N: comparable with nccl-tests; the link speed bounds it.")


def _worker(args: argparse.Namespace) -> int:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from lit_parallel.commands.launch import write_result
    from lit_parallel.devices import init_process_group_on_device

    t0 = time.perf_counter()
    # nccl: the rank's own GPU (LOCAL_RANK modulo the visible GPUs) is made current before NCCL starts
    device = init_process_group_on_device(args.backend, timeout=timedelta(seconds=60))
    init_s = time.perf_counter() - t0
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.tensor([float(rank)], device=device)
    dist.all_reduce(t)
    rows = []
    for nbytes in SIZES:
        buf = torch.ones(nbytes // 4, device=device)
        dist.all_reduce(buf)  # warm-up
        times = []
        for _ in range(args.repeats):
            if device.type == "cuda":
                torch.cuda.synchronize()
            dist.barrier()
            s = time.perf_counter()
            dist.all_reduce(buf)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - s)
        med = statistics.median(times)
        algbw, busbw = bus_bandwidth(nbytes, med, world)
        rows.append({"bytes": nbytes, "time_s": med, "algbw_gbps": algbw, "busbw_gbps": busbw})
    if rank == 0:
        write_result(
            args.result,
            {
                "sum": int(t.item()),
                "world_size": world,
                "backend": args.backend,
                "init_s": init_s,
                "bandwidth": rows,
            },
        )
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m lit_parallel.commands.doctor")
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
