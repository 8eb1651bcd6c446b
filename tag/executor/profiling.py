"""Op and kernel tables of one training iteration (``torch.profiler``), for diagnosing where an
executed step spends its time against an eager one.

``TAG_PROFILE_KERNELS=PREFIX tag execute ...`` (the launcher passes it to its ranks) makes every
rank run one extra iteration after the timed ones under ``torch.profiler`` (not counted in any
figure) and write ``PREFIX-rank<R>.json``: :func:`op_table` of that iteration. ``evaluation/gpu_check.py`` writes the
same table for an eager step, so the two can be compared kernel by kernel.
"""

from __future__ import annotations

import collections
import contextlib
import os

import torch

ENV = "TAG_PROFILE_KERNELS"
"""Environment variable naming the path prefix of the per-rank tables (unset: no profiling)."""


@contextlib.contextmanager
def profiled():
    """``torch.profiler.profile`` over the CPU and, when there is one, the CUDA device; the device
    finishes the block's kernels before the profiler stops (an eager step returns with its last
    kernels still queued)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        yield prof
        if cuda:
            torch.cuda.synchronize()


def op_table(prof, top: int = 200) -> dict:
    """Counts and times of what ``prof`` saw (times in seconds).

    ``aten_ops``: calls of ``aten::`` operators issued from Python (nested calls inside another
    aten op not counted again); ``kernels``: device kernels launched and their summed device
    time; ``top_kernels``: the ``top`` largest by device time, ``[name, count, seconds]``;
    ``top_ops``: the ``top`` largest by host time, ``[name, count, host seconds, device seconds of
    the kernels they launched]`` (per ATen op: what a GPU cost rule per op class is fitted to)."""
    kernels: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    ops: dict[str, list] = collections.defaultdict(lambda: [0, 0.0, 0.0])
    n_ops = 0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels[e.name]
            k[0] += 1
            k[1] += e.time_range.elapsed_us() / 1e6  # a device event's own span
        elif e.name.startswith("aten::") and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")):
            o = ops[e.name]
            o[0] += 1
            o[1] += e.cpu_time_total / 1e6
            o[2] += _device_s(e)  # the kernels it launched, its nested ops' included
            n_ops += 1

    def largest(d: dict) -> list:
        return [[name, *(round(x, 9) if isinstance(x, float) else x for x in v)]
                for name, v in sorted(d.items(), key=lambda kv: -kv[1][1])[:top]]

    return {"aten_ops": n_ops, "kernels": sum(c for c, _ in kernels.values()),
            "kernel_s": round(sum(t for _, t in kernels.values()), 9),
            "top_kernels": largest(kernels), "top_ops": largest(ops)}


def _device_s(event) -> float:
    """Seconds of the device kernels launched under a CPU op (0 without a device)."""
    try:
        return event.device_time_total / 1e6
    except (AttributeError, AssertionError):
        return 0.0


def table_path(rank: int, prefix: str | None = None) -> str | None:
    """Where rank ``rank`` writes its table (``<prefix>-rank<R>.json``; ``prefix`` defaults to
    ``$TAG_PROFILE_KERNELS``), or None."""
    prefix = prefix or os.environ.get(ENV)
    return f"{prefix}-rank{rank}.json" if prefix else None
