"""``tag profile``: measure op-group and communication costs on this machine into the profile database."""

from __future__ import annotations

import sys

from .common import MAX_BATCH, PROFILES_HELP, add_model_args, int_in


def register(sub) -> None:
    p = sub.add_parser(
        "profile", help="measure op-group and communication times on the local device",
        description="Time every op-group's forward, backward and optimizer update on the local device at a few "
                    "per-replica batch sizes (median of repeats, warm-up excluded) and store them under "
                    "data/profiles/<device-type>/; also time point-to-point and collective communication between "
                    "two local processes (gloo; NCCL with --device cuda) and fit latency + bytes/bandwidth.")
    add_model_args(p)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="device to profile (default cpu)")
    p.add_argument("--threads", type=int_in(1), default=None,
                   help="CPU intra-op threads (default: torch's; the device type is cpu-<threads>t)")
    p.add_argument("--batches", default=None, metavar="B1,B2,...",
                   help="per-replica batch sizes to time (default 1, B/4, B/2, B)")
    p.add_argument("--repeats", type=int_in(1), default=5, help="timed repeats per batch size (median; default 5)")
    p.add_argument("--warmup", type=int_in(0), default=2, help="untimed warm-up iterations (default 2)")
    # No default here: importing tag.executor.commprof for its DEFAULT_REPEATS would load torch on
    # every `tag` start-up, --help included.
    p.add_argument("--comm-repeats", type=int_in(1), default=None,
                   help="timed calls per communication operation and size (mean; default: the profiler's "
                        "DEFAULT_REPEATS, tag/executor/commprof.py)")
    p.add_argument("--out", default=None, metavar="DIR", help=PROFILES_HELP)
    p.add_argument("--compile", action="store_true",
                   help="time every op-group's stages compiled by torch.compile (Inductor), as tag execute --compile "
                        "runs them; stored as device type <type>-compiled, which tag execute --compile predicts with")
    comm = p.add_mutually_exclusive_group()
    comm.add_argument("--no-comm", action="store_true", help="skip the communication measurements")
    comm.add_argument("--comm-only", action="store_true", help="only measure communication")
    p.set_defaults(func=run)


def _batches(text: str | None) -> list[int] | None:
    from ..errors import TagError

    if text is None:
        return None
    try:
        out = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        out = []
    if not out or out[0] < 1 or out[-1] > MAX_BATCH:
        raise TagError(f"--batches: expected comma-separated integers between 1 and {MAX_BATCH}, got {text!r}")
    return out


def run(args) -> int:
    import torch

    from ..cost.profile import COMPILED, cpu_device_type, default_profile_dir
    from ..errors import TagError
    from ..io import check_folder

    if args.threads is not None and args.threads < 1:
        raise TagError(f"--threads: expected a positive integer, got {args.threads}")
    if args.repeats < 1 or args.warmup < 0 or (args.comm_repeats is not None and args.comm_repeats < 1):
        raise TagError("--repeats/--comm-repeats/--warmup: expected repeats >= 1 and warmup >= 0, got "
                       f"{args.repeats}/{args.comm_repeats}/{args.warmup}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise TagError("--device: cuda requested but no CUDA device is available")
    if args.batch is not None and args.batch < 1:
        raise TagError(f"--batch: expected a positive integer, got {args.batch}")
    batches = _batches(args.batches)
    root = args.out or default_profile_dir()
    check_folder(root, TagError, "--out")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    dtype = cpu_device_type(torch.get_num_threads())
    if not args.comm_only:
        from ..cost.profiler import profile_model

        prof = profile_model(args.model, batch=args.batch, device=args.device, batches=batches,
                             repeats=args.repeats, warmup=args.warmup, optimizer=args.optimizer,
                             num_groups=args.groups, seed=args.seed, precision=args.precision,
                             compiled=args.compile)
        path = prof.save(root)
        dtype = prof.device_type.removesuffix(COMPILED)  # (links are the same, compiled or not)
        print(f"profile {prof.model} ({prof.graph_signature}) on {dtype}: batches {prof.batches} -> {path}")
        from ..cost.profiler import host_launch_report

        host = host_launch_report(prof.meta, dtype)  # a CUDA profile times the host's launches
        if host is not None:
            print(host)
    if not args.no_comm:
        from ..executor.commprof import profile_comm
        from ..topology.units import format_bandwidth, format_time

        backend = "nccl" if args.device == "cuda" and torch.cuda.device_count() >= 2 else "gloo"
        print(f"profile comm: {backend}, 2 local processes, 4 KiB..16 MiB", file=sys.stderr, flush=True)
        repeats = {"repeats": args.comm_repeats} if args.comm_repeats is not None else {}
        cp = profile_comm(dtype, backend=backend, warmup=args.warmup, **repeats)
        path = cp.save(root)
        fits = ", ".join(f"{op} {format_time(f.alpha, digits=3)} + {format_bandwidth(f.beta, digits=3)}"
                         for op, f in cp.fits.items())
        print(f"comm on {dtype} ({backend}): {fits} -> {path}")
    return 0
