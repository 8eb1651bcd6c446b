"""``tag simulate``: predict one training iteration of a plan (or a baseline) on a topology."""

from __future__ import annotations

from .common import (
    PROFILES_HELP,
    add_cache_arg,
    add_force_arg,
    add_model_args,
    add_numerics_args,
    check_outputs,
    folder,
    numerics_of,
    print_json,
)
from .plan import add_export_arg, check_export, export_summary, export_to, print_export

FOLD_ABOVE = 32
"""Devices above which the per-device table folds identical rows into one (``--all-devices`` not)."""


def register(sub) -> None:
    p = sub.add_parser(
        "simulate", help="simulate one training iteration of a plan on a topology",
        description="Capture the model, build the cost model (profiles from data/profiles where they exist, else the "
                    "roofline rule) and simulate one iteration of a plan file or a baseline plan: iteration time, "
                    "per-device compute / communication / idle time, peak memory against capacity, critical path.")
    add_model_args(p)
    add_cache_arg(p)
    p.set_defaults(groups=None)
    p.add_argument("--topology", required=True, help="topology YAML/JSON file or shipped topology name")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--plan", metavar="FILE", help="plan JSON file")
    # Checked in run() against tag.cost.baselines.BASELINES: importing it here would load torch on
    # every `tag` start-up, --help included.
    src.add_argument("--baseline", metavar="NAME",
                     help="dp: even data parallel; dp-prop: shares proportional to device speed; single: best "
                          "single device; mp: greedy model parallel by memory; fsdp: ZeRO-3 over every device")
    src.add_argument("--layout", metavar="dp=D,tp=T,pp=P,micro=M",
                     help="a Megatron-style layout: D data-parallel replicas per stage, each T-way tensor parallel "
                          "on one machine (default 1), P pipeline stages of about equal compute placed "
                          "machine-major, M micro-batches; optional schedule=1f1b|gpipe|kfkb (or a schedule "
                          "registered in tag.parallel.pipeline), k=K (kfkb block), vpp=V (V chunks per stage's devices: "
                          "interleaved 1F1B over P*V virtual stages, M a multiple of P), "
                          "cut=time|memory, sp=1 (tensor parallelism with sequence parallelism), recompute=1 (every "
                          "op-group recomputes its activations in its backward), stages=7+6+6+5 (transformer layers "
                          "per stage, as a published plan cuts them: the first stage also the embedding, the last "
                          "the head and loss; without --groups the op-group count nearest 48 whose groups start at "
                          "those layers), order=m1:0-3+m0:0-3 (the device of each rank, stage-major, then replica, "
                          "tensor parallel innermost: machine:first-last, machine:index, a machine name or global "
                          "first-last, joined by +; the others idle), zero=1|2|3 (ZeRO stage of the data parallelism: optimizer "
                          "state, + gradients, + parameters sharded over the D replicas; not with T > 1), shard=S "
                          "(replicas per shard group: hybrid sharding), hsdp=SxR (zero=3,shard=S,dp=S*R); D*T*P must equal the topology's device count "
                          "(with order: the devices it names)")
    p.add_argument("--machines", metavar="NAME,NAME", default=None,
                   help="with --layout: the machines it occupies (their device count = D*T*P), the others idle, "
                        "as tag plan's sub-cluster layouts (default: every machine); with the layout's order=, "
                        "the machines of exactly its devices")
    p.add_argument("--trace", metavar="OUT.json", help="write the timeline in Chrome/Perfetto trace format")
    p.add_argument("--save-plan", metavar="PLAN.json",
                   help="write the simulated plan (the layout's or baseline's) as a plan file, for `tag execute`")
    p.add_argument("--profiles", metavar="DIR", type=folder, default=None, help=PROFILES_HELP)
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    add_export_arg(p)
    p.add_argument("--all-devices", action="store_true",
                   help=f"print one table row per device (default: above {FOLD_ABOVE} devices, devices with "
                        "identical rows share one row with their device range and count)")
    p.add_argument("--allow-oom", action="store_true",
                   help="with --layout or --save-plan: a plan that runs out of memory is still reported (and "
                        "written) with exit status 0 (default: one line naming the devices over their memory, "
                        "nothing written, exit 2); a plan file or baseline alone is always reported")
    add_numerics_args(p)
    add_force_arg(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from ..cost.baselines import BASELINES, baseline_plan
    from ..cost.model import CostModel
    from ..errors import TagError
    from ..io import write_json
    from ..parallel import validate_plan
    from ..parallel.layout import align_groups, layout_devices, parse_layout, stage_table
    from ..plan import Plan
    from ..planner import layout_machines, layout_plan
    from ..sim import Simulator, lower_bound
    from ..topology import load_topology

    if args.baseline is not None and args.baseline not in BASELINES:
        raise TagError(f"--baseline: unknown baseline {args.baseline!r}; expected one of {', '.join(BASELINES)}")
    check_outputs(args, trace=args.trace, save_plan=args.save_plan, export=args.export and args.export[1])
    check_export(args)
    layout = parse_layout(args.layout) if args.layout is not None else None  # a typo fails before any capture
    if args.machines is not None and layout is None:
        raise TagError("--machines: expected --layout too (the machines a layout occupies)")
    machines = None if args.machines is None else [m.strip() for m in args.machines.split(",") if m.strip()]
    topo = load_topology(args.topology)
    if layout is not None and machines is None:
        layout_devices(layout, topo)
    elif layout is not None:  # (names and device count, before any capture)
        layout_machines(topo, layout, machines)
    plan = Plan.load(args.plan) if args.plan is not None else None
    if plan is not None:
        if args.batch is None:
            args.batch = plan.batch_size
        if args.groups is None:
            args.groups = len(plan.groups)
        if args.precision == "fp32" and plan.precision != "fp32":  # the plan says what it was made for
            args.precision = plan.precision
    stated_groups = args.groups is not None
    if args.groups is None:
        args.groups = 48
    from .common import load_graph

    graph, _, _ = load_graph(args)
    if layout is not None and layout.stages is not None and not stated_groups:
        args.groups = align_groups(graph, layout, args.groups)  # (before anything costs the groups)
    from ..cost.baselines import check_fits
    check_fits(graph, topo)
    costs = CostModel.for_topology(graph, topo, args.profiles, numerics=numerics_of(args))
    if layout is not None:
        plan = layout_plan(graph, topo, layout, costs, machines=machines)
    elif plan is None:
        plan = baseline_plan(args.baseline, graph, topo, costs)
    where = _what(args)
    validate_plan(plan, graph, topo, source=where, pipelines=True, tensor_parallel=True)
    res = Simulator(graph, topo, costs).run(plan.groups, trace=bool(args.trace), pipeline=plan.pipeline)
    if res.oom and (layout is not None or args.save_plan) and not args.allow_oom:
        # a layout is a configuration to run: one that does not fit is an error, as tag plan's
        from ..errors import OutOfMemoryError
        hint = " (recompute=1, more pipeline stages or tensor parallelism may fit)" if layout is not None else ""
        raise OutOfMemoryError(f"{where} runs out of memory{hint}: {res.memory_report(topo)}; nothing written "
                               "(--allow-oom reports and writes it anyway)")
    lb = lower_bound(graph, topo, costs)
    if args.trace:
        write_json(args.trace, res.chrome_trace(), indent=None)
    if args.save_plan:
        plan.predicted_iteration_time_s = None if res.oom else float(res.iteration_time_s)
        plan.save(args.save_plan)
    sources = _sources(costs, topo)
    hosts = _hosts(costs, topo)
    if args.export:
        plan.predicted_iteration_time_s = None if res.oom else float(res.iteration_time_s)
    exported = export_to(graph, topo, plan, args, costs) if args.export else None
    if args.json:
        out = {"model": graph.model, "batch_size": graph.batch_size, "topology": topo.name,
               "plan": args.plan or (f"layout:{args.layout}" if args.layout else f"baseline:{args.baseline}"), "lower_bound_s": lb, "cost_sources": sources,
               "host_sources": hosts,
               **res.to_dict()}
        if layout is not None:  # what ran: the layout spelled out (order resolved), each stage's groups, layers, devices
            out.update(layout=plan.meta["layout"], stages=stage_table(graph, plan))
        if exported is not None:
            out["export"] = export_summary(exported, args)
        print_json(out)
        return 0
    _print_summary(graph, topo, args, res, lb, sources, hosts)
    if layout is not None and (layout.stages is not None or layout.order is not None):
        _print_stages(graph, topo, plan)
    print_export(exported, args)
    return 0


def _print_stages(graph, topo, plan) -> None:
    """The layout that ran, one line per stage: its op-groups, layers and devices."""
    from ..parallel.layout import spell_order, stage_table

    print(f"layout ran: {plan.meta['layout']}")
    for s, row in enumerate(stage_table(graph, plan)):
        a, b = row["layers"] or (None, None)
        layers = "no whole layer" if a is None else f"layer {a}" if a == b else f"layers {a}-{b}"
        print(f"  stage {s}: {layers}, op-groups {row['groups'][0]}-{row['groups'][1]}, "
              f"devices {spell_order(row['devices'], topo)}")


def _sources(costs, topo) -> list[str]:
    """``<source> (<device type>)`` of each device type: where its compute costs come from."""
    out = {}
    for d in range(topo.num_devices):
        out.setdefault(costs.device_type(d), costs.source(d))
    return [f"{src} ({dt})" if not src.endswith(dt) else src for dt, src in out.items()]


def _hosts(costs, topo) -> list[dict]:
    """Where each GPU device type's host seconds come from, per host: ``{"device_type", "machines",
    "host_launch_s" (seconds per forward kernel launch), "source"}`` (``topology``: the machines'
    ``host_launch``; ``assumed: ...``: the host the rule was fitted on), in device order."""
    out: dict[tuple, dict] = {}
    for d in range(topo.num_devices):
        host = costs.host_launch(d)
        if host is not None:
            entry = out.setdefault((costs.device_type(d), *host), {
                "device_type": costs.device_type(d), "machines": [], "host_launch_s": host[0], "source": host[1]})
            name = topo.devices[d].machine
            if name not in entry["machines"]:
                entry["machines"].append(name)
    return list(out.values())


def _host_text(h: dict, hosts: list[dict]) -> str:
    """``55 us (assumed: ...) on H200``; the machines too where the type runs on several hosts."""
    where = h["device_type"]
    if sum(o["device_type"] == where for o in hosts) > 1:
        names = h["machines"]
        where += f" of {', '.join(names[:3])}" + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return f"{h['host_launch_s'] * 1e6:.3g} us ({h['source']}) on {where}"


def _print_summary(graph, topo, args, res, lb, sources, hosts=()) -> None:
    from ..topology.table import render_table
    from ..topology.units import format_bytes, format_count

    def ms(x: float) -> str:
        return f"{x * 1e3:.3f}"

    what = _what(args)
    print(f"model {graph.model} (batch {graph.batch_size}, {format_count(graph.num_groups, 'op-group')}, "
          f"{graph.precision}) on "
          f"{topo.name}: {what}")
    print(f"costs from {', '.join(sources)}")
    if hosts:
        print("host launch " + "; ".join(_host_text(h, hosts) for h in hosts))
    print(f"iteration time {res.iteration_time_s * 1e3:.3f} ms  (ideal lower bound {lb * 1e3:.3f} ms)  "
          f"OOM: {'yes' if res.oom else 'no'}")
    rows = [[str(d), f"{dev.name} ({dev.gpu.name})", ms(res.compute_time_s[d]), ms(res.comm_time_s[d]),
             ms(res.idle_time_s[d]), format_bytes(res.peak_memory_bytes[d], digits=3),
             format_bytes(res.memory_capacity_bytes[d], digits=3),
             "OOM" if res.peak_memory_bytes[d] > res.memory_capacity_bytes[d] else ""]
            for d, dev in enumerate(topo.devices)]
    fold = topo.num_devices > FOLD_ABOVE and not args.all_devices
    if fold:
        rows = fold_rows(rows, [dev.gpu.name for dev in topo.devices])
    print(render_table(["", "device", "compute ms", "comm ms", "idle ms", "peak memory", "capacity", ""], rows))
    if fold and res.oom:
        print(f"out of memory: {res.memory_report(topo)}")
    else:
        for d, over in res.oom_devices:
            print(f"out of memory on device {d} ({topo.devices[d].name}) by {format_bytes(over, digits=3)}")
    path = res.critical_path
    shown = path if len(path) <= 8 else path[:4] + [f"... ({len(path) - 8} more)"] + path[-4:]
    print("critical path: " + " -> ".join(shown))
    if args.trace:
        print(f"trace written to {args.trace}")
    if args.save_plan:
        print(f"plan written to {args.save_plan}")


def _what(args) -> str:
    """What is simulated: the plan file, the layout or the baseline."""
    return args.plan or (f"layout {args.layout}" if args.layout else f"baseline {args.baseline}")


def fold_rows(rows: list[list[str]], kinds: list[str]) -> list[list[str]]:
    """Per-device table rows (``[index, name, figures...]``, one per device) with the devices of
    one kind whose figures print alike folded into one row, in order of first appearance: index
    ``0-7,16-23`` (the devices), name ``16 x A100-40GB`` (their count and kind); a device alike
    with no other keeps its own row."""
    folded: dict[tuple, list[int]] = {}
    for d, (row, kind) in enumerate(zip(rows, kinds)):
        folded.setdefault((kind, *row[2:]), []).append(d)
    from ..plan.format import device_ranges  # (not at import: `tag --help` loads no numpy)

    out = []
    for (kind, *figures), devs in folded.items():
        out.append(rows[devs[0]] if len(devs) == 1 else [device_ranges(devs), f"{len(devs)} x {kind}", *figures])
    return out
