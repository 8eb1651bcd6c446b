"""``tag plan``: search a deployment of a model on a topology (GNN-guided MCTS by default)."""

from __future__ import annotations

from dataclasses import asdict

from .common import (
    MAX_BUDGET,
    PROFILES_HELP,
    add_cache_arg,
    add_force_arg,
    add_model_args,
    add_numerics_args,
    check_outputs,
    folder,
    int_in,
    numerics_of,
    print_json,
    seconds,
)


def register(sub) -> None:
    p = sub.add_parser(
        "plan", help="search a deployment plan (GNN-guided MCTS) for a model on a topology",
        description="Capture the model, simulate both data-parallel baselines, then search per-op-group "
                    "deployments (devices, batch shares, gradient synchronisation) with MCTS guided by the "
                    "shipped GNN predictor (or another searcher), among the plans tag execute runs unless "
                    "--allow-unexecutable. Prints the plan, its predicted iteration "
                    "time, the speedup over the baselines and the distance to the lower bound.")
    add_model_args(p)
    add_cache_arg(p)
    p.add_argument("--topology", required=True, help="topology YAML/JSON file or shipped topology name")
    p.add_argument("--budget", type=int_in(1, MAX_BUDGET), default=None, metavar="N",
                   help=f"search budget in playouts: plans proposed and not simulated before (1..{MAX_BUDGET}; "
                        "default 200 unless --time is given)")
    p.add_argument("--time", type=seconds, default=None, metavar="S", help="time limit in seconds for the search and the layout grid after set-up (the search "
                        "half of it where the grid runs; at least one wave of playouts and one layout run)")
    p.add_argument("--prior", choices=["gnn", "uniform"], default="gnn", help="MCTS prior (default gnn)")
    p.add_argument("--searcher", choices=["mcts", "sa", "random", "tpe"], default="mcts",
                   help="search algorithm (default mcts)")
    p.add_argument("--checkpoint", default=None, metavar="FILE",
                   help="predictor checkpoint (default: the shipped tag/gnn/predictor.pt)")
    p.add_argument("--compression", choices=["auto", "off"], default="auto",
                   help="auto: choose Sufficient Factor Broadcasting per group after search (default)")
    p.add_argument("--pipelines", choices=["auto", "grid", "off"], default="auto",
                   help="auto: search pipeline stages, micro-batches, schedules and tensor-parallel degrees with the "
                        "per-group actions, then the Megatron-style data x tensor x pipeline layouts a user would "
                        "try by hand (branch and bound: those that could beat the searched plan), the best few "
                        "refined (speed-proportional shares, selective recomputation), and return the fastest "
                        "(default); grid: the same, the grid not bounded by the searched plan (its best layout "
                        "reported); off: TAG's action space alone")
    p.add_argument("--allow-unexecutable", dest="executable", action="store_false",
                   help="also search plans the simulator costs but tag execute refuses (tensor-parallel groups "
                        "beside other groups, pipeline stages of different tensor-parallel degrees, sequence "
                        "parallelism); the "
                        "output then says when the plan is simulated only (default: only plans tag execute runs)")
    p.add_argument("--no-one-shot", dest="one_shot", action="store_false",
                   help="with --prior gnn: do not spend the last playout on the network's one-shot plan")
    p.add_argument("--background", choices=["stated", "expected", "none"], default="stated",
                   help="a topology whose NICs or links carry other jobs' traffic: plan for it as stated (each "
                        "iteration at time 0 of it; default), for its mean share of the bandwidth over its trace or "
                        "period (expected), or for a network free of it (none)")
    p.add_argument("--profiles", metavar="DIR", type=folder, default=None, help=PROFILES_HELP)
    p.add_argument("--out", metavar="PLAN.json", default=None, help="write the plan JSON here")
    p.add_argument("--trace", metavar="OUT.json", default=None,
                   help="write the simulated timeline of the plan (Chrome/Perfetto trace)")
    p.add_argument("--json", action="store_true", help="print a JSON summary instead of the table")
    add_export_arg(p)
    add_numerics_args(p)
    add_force_arg(p)
    p.add_argument("--allow-oom", action="store_true",
                   help="when even the best plan runs out of memory, still write it and exit 0 (default: "
                        "print the memory report, write nothing and exit 2)")
    p.set_defaults(func=run)


def summary(plan) -> dict:
    from ..parallel import execution_refusal
    from ..planner import PlannerResult

    r = PlannerResult.of(plan)
    return {
        "model": plan.model, "topology": plan.topology, "batch_size": plan.batch_size,
        "groups": len(plan.groups), "searcher": r.searcher, "prior": r.prior,
        "seed": r.seed, "predicted_iteration_time_s": plan.predicted_iteration_time_s,
        "oom": r.oom, "dp_even_time_s": r.dp_even_time_s, "dp_prop_time_s": r.dp_prop_time_s,
        "lower_bound_s": r.lower_bound_s, "playouts": r.playouts, "repeats": r.repeats,
        "value_cuts": r.value_cuts, "sim_calls": r.sim_calls,
        "search_time_s": r.search_time_s, "first_beat_dp_playout": r.first_beat_dp_playout,
        "improvements": r.improvements, "one_shot_time_s": r.one_shot_time_s,
        "source": r.source, "compression": r.compression,
        "pipeline": None if plan.pipeline is None else asdict(plan.pipeline), "layout": r.layout,
        "machines": r.machines, "idle_kinds": r.idle_kinds, "best_layout": r.best_layout, "best_layout_time_s": r.best_layout_time_s,
        "layouts": r.layouts, "layouts_tried": r.layouts_tried, "layouts_pruned": r.layouts_pruned,
        "grid_time_s": r.grid_time_s, "grid_cut": r.grid_cut, "refinement": r.refinement,
        "refinements": r.refinements, "subclusters": r.subclusters,
        # a plan head or bound that met a case it cannot handle: the rule it replaces took over
        "plan_head_fallback": r.plan_head_fallback, "bounds_fallback": r.bounds_fallback,
        "speedup_vs_dp_even": _ratio(r.dp_even_time_s, plan.predicted_iteration_time_s),
        "speedup_vs_dp_prop": _ratio(r.dp_prop_time_s, plan.predicted_iteration_time_s),
        "fsdp_time_s": r.fsdp_time_s,
        "speedup_vs_fsdp": _ratio(r.fsdp_time_s, plan.predicted_iteration_time_s),
        # None: tag execute runs the plan; else why not (only with --allow-unexecutable)
        "execution_refusal": execution_refusal(plan),
    }


def _ratio(a, b):
    return a / b if a and b else None


def run(args) -> int:
    import time

    from ..planner import PlannerConfig, find_plan
    from ..topology import load_topology
    from .common import StageProgress, load_graph

    check_outputs(args, out=args.out, trace=args.trace, export=args.export and args.export[1])
    check_export(args)
    from ..topology.background import planning_topology

    stated = load_topology(args.topology)
    topo = planning_topology(stated, args.background)  # (the plan is stamped for the file's topology below)
    progress = StageProgress(quiet=args.json)
    t0 = time.perf_counter()
    progress("capture")
    graph, _, _ = load_graph(args)
    if not args.allow_oom:
        from ..cost.baselines import check_fits
        check_fits(graph, topo)
    capture_s = time.perf_counter() - t0
    costs = None
    try:
        from ..cost.model import CostModel
        costs = CostModel.for_topology(graph, topo, args.profiles, numerics=numerics_of(args))
    except ImportError:  # pragma: no cover
        pass
    try:
        cfg = PlannerConfig(searcher=args.searcher, prior=args.prior, budget=args.budget, time_limit=args.time,
                            seed=args.seed, checkpoint=args.checkpoint, compression=args.compression,
                            one_shot=args.one_shot, pipelines=args.pipelines, executable=args.executable)
        p = find_plan(graph, topo, cfg, costs=costs, progress=progress)
    finally:
        progress.close()  # no bar left on the terminal, after an error either
    p.meta["capture_s"] = capture_s
    if topo is not stated:
        p = p.on_topology(stated, list(range(stated.num_devices)))
        p.meta["background"] = args.background
    if p.meta.get("oom") and not args.allow_oom:
        from ..errors import OutOfMemoryError
        from ..sim import Simulator
        res = Simulator(graph, topo, costs).run(p.groups, pipeline=p.pipeline)
        grid = (f", so do the {p.meta['layouts']} Megatron-style layouts of the grid ({p.meta['layouts_tried']} "
                "simulated, the others bounded out of memory or slower)") if "layouts" in p.meta else ""
        raise OutOfMemoryError(f"every plan searched runs out of memory, also with activation recomputation where the "
                               f"search may use it{grid}; the closest to fitting: {res.memory_report(topo)}; "
                               "no plan written (--allow-oom writes it anyway)")
    if args.out:
        p.save(args.out)
    if args.trace:
        from ..io import write_json
        from ..sim import Simulator
        res = Simulator(graph, topo, costs).run(p.groups, trace=True, pipeline=p.pipeline)
        write_json(args.trace, res.chrome_trace(), indent=None)
    exported = export_to(graph, topo, p, args, costs) if args.export else None
    if args.json:
        print_json(summary(p) | ({} if exported is None else {"export": export_summary(exported, args)}))
        return 0
    _print(graph, topo, p, args)
    print_export(exported, args)
    return 0


def add_export_arg(p) -> None:
    """``--export TRAINER FILE`` (``tag plan``, ``tag simulate``)."""
    p.add_argument("--export", nargs=2, metavar=("TRAINER", "FILE"), default=None,
                   help="also write the plan as a trainer's configuration: torchtitan (TOML job config), megatron "
                        "(Megatron-LM arguments) or deepspeed (JSON); a plan the trainer cannot express gets a line "
                        "naming why and the nearest layout it can, simulated beside the plan, in FILE")


def check_export(args) -> None:
    """One-line error for an ``--export`` trainer TAG does not write, before any work."""
    from ..parallel.export import TRAINERS

    if args.export and args.export[0] not in TRAINERS:
        from ..errors import TagError
        raise TagError(f"--export: {args.export[0]!r}: expected a trainer, one of {', '.join(TRAINERS)}")


def export_to(graph, topo, plan, args, costs):
    """The plan as ``--export TRAINER FILE``'s configuration, written to FILE."""
    from ..planner import export_plan

    exported = export_plan(plan, graph, topo, args.export[0], costs=costs, profiles=args.profiles,
                           numerics=numerics_of(args))
    exported.write(args.export[1])
    return exported


def export_summary(exported, args) -> dict:
    """``--json``'s ``export`` entry."""
    from ..parallel.export import spell

    return {"trainer": exported.trainer, "file": args.export[1], "layout": spell(exported.layout),
            "exact": exported.exact, "problems": exported.problems, "notes": exported.notes,
            "plan_time_s": exported.plan_time_s, "layout_time_s": exported.layout_time_s}


def print_export(exported, args) -> None:
    """The export's lines (:meth:`tag.parallel.export.Export.lines`) and where it went."""
    if exported is not None:
        print("\n".join(exported.lines()))
        print(f"{exported.trainer} configuration written to {args.export[1]}")


FOLD_MACHINES = 4
"""Machines of an op-group above which its line gives their range and count, not each name."""
FOLD_SHARES = 8
"""Shares of an op-group above which its line gives runs of equal shares (``0.021 x16``), and
above which many runs their range."""


def _describe(topo, gp) -> str:
    per: dict[int, list[int]] = {}
    for d in gp.devices:
        per.setdefault(topo.machine_of(d), []).append(d)
    whole = {m for m, ds in per.items() if len(ds) == topo.machines[m].count}
    if len(per) > FOLD_MACHINES:  # h100-00..h100-63 (64 machines), not 64 names
        ms = sorted(per)
        span = f"{topo.machines[ms[0]].name}..{topo.machines[ms[-1]].name} " if ms == list(range(ms[0], ms[-1] + 1)) \
            else ""
        where = span + (f"({len(ms)} machines)" if len(whole) == len(ms) else
                        f"({len(gp.devices)} devices of {len(ms)} machines)")
    else:
        where = "+".join(topo.machines[m].name if m in whole else
                         f"{topo.machines[m].name}{[topo.devices[d].local_index for d in ds]}" for m, ds in per.items())
    from ..parallel import strategy_of
    from ..topology.units import format_count

    if strategy_of(gp).chunked:
        return f"{gp.sync:7s} on {where} ({format_count(len(gp.devices), 'chunk')})"
    shares = ", ".join(f"{s:.2f}" for s in gp.shares)
    if len(set(round(s, 3) for s in gp.shares)) == 1 and len(gp.shares) > 3:
        shares = f"{gp.shares[0]:.3f} x{len(gp.shares)}"
    elif len(gp.shares) > FOLD_SHARES:  # runs of equal shares: 0.021 x16, 0.012 x32, 0.005 x16
        runs: list[list] = []
        for v in (round(s, 3) for s in gp.shares):
            if runs and runs[-1][0] == v:
                runs[-1][1] += 1
            else:
                runs.append([v, 1])
        shares = ", ".join(f"{v:.3f}" + (f" x{n}" if n > 1 else "") for v, n in runs) if len(runs) <= FOLD_SHARES \
            else f"{min(gp.shares):.3f}-{max(gp.shares):.3f} over {len(gp.shares)} devices"
    sync = gp.sync if len(gp.devices) > 1 else "single"
    extra = f", server {topo.devices[gp.server].name}" if gp.server is not None else ""
    if gp.shard is not None:  # hybrid sharding: devices per shard group
        extra += f", shard {gp.shard}"
    if gp.offload:
        extra += f", {gp.offload} offloaded"
    if gp.tp is not None:  # tensor parallel: devices per tensor-parallel group
        extra += f", tp {gp.tp}"
    if gp.sequence_parallel:
        extra += ", sequence parallel"
    if gp.recompute:
        extra += ", recompute"
    sfb = f", sfb {len(gp.sfb)}" if gp.sfb else ""
    return f"{sync:9s} on {where} (shares {shares}{extra}{sfb})"


def _print(graph, topo, p, args) -> None:
    from ..topology.units import format_count

    s = summary(p)

    def ms(x):
        return "n/a" if x is None else f"{x * 1e3:.3f} ms"

    print(f"plan for {graph.model} (batch {graph.batch_size}, {format_count(graph.num_groups, 'op-group')}) on "
          f"{topo.name} ({format_count(topo.num_devices, 'device')}, {format_count(topo.num_machines, 'machine')})")
    prior = f", prior {s['prior']}" if s["prior"] else ""
    extra = "".join(f", {text}" for k, text in (("repeats", format_count(s["repeats"] or 0, "repeat")),
                                                 ("value_cuts", f"{s['value_cuts']} cut by the value head"))
                    if s.get(k))
    print(f"searcher {s['searcher']}{prior}: {format_count(s['playouts'], 'playout')}{extra}, "
          f"{format_count(s['sim_calls'], 'simulator call')}, "
          f"{s['search_time_s']:.2f} s (seed {s['seed']})")
    imp = s.get("improvements") or []
    dp_fits = s.get("dp_even_time_s") is not None or s.get("dp_prop_time_s") is not None
    first = "first beat data parallel" if dp_fits else "first plan that fits (data parallel does not)"
    if imp:
        print(f"progress: {first} at playout {imp[0][0]}, best plan at playout {imp[-1][0]} "
              f"({format_count(len(imp), 'improvement')})")
    else:
        print("progress: " + ("no plan beat data parallel" if dp_fits else
                              "no searched plan fits in memory (nor does data parallel)"))
    for key in ("plan_head_fallback", "bounds_fallback"):
        if s.get(key):
            print(f"note: {s[key]}")
    if s.get("one_shot_time_s") is not None:
        print(f"network's one-shot plan (simulated after the tree): {ms(s['one_shot_time_s'])}")
    if s.get("layouts") is not None:
        best = (f"best {s['best_layout']} at {ms(s['best_layout_time_s'])}" if s["best_layout"]
                else "none faster than the searched plan")
        skipped = "bounded out or left at the time limit" if s.get("grid_cut") else "bounded out"
        print(f"layout grid: {format_count(s['layouts'], 'layout')}, {s['layouts_tried']} simulated, "
              f"{s['layouts_pruned']} {skipped}, {s['grid_time_s']:.2f} s; {best}")
        for line in s.get("refinements") or []:
            print(f"  refinement: {line}")
        for line in s.get("subclusters") or []:
            print(f"  sub-cluster {line}")
    rows = []
    start = 0
    descs = [_describe(topo, gp) for gp in p.groups]
    for g in range(1, len(descs) + 1):
        if g == len(descs) or descs[g] != descs[start]:
            rows.append((start, g - 1, descs[start]))
            start = g
    print("op-groups:")
    for a, b, d in rows:
        rng = f"{a}" if a == b else f"{a}-{b}"
        print(f"  {rng:>7}  {d}")
    t = p.predicted_iteration_time_s
    print(f"predicted iteration time: {ms(t)}" + ("  (OUT OF MEMORY)" if s["oom"] else ""))
    for name, key, sk in (("data parallel, even shares", "dp_even_time_s", "speedup_vs_dp_even"),
                          ("data parallel, proportional", "dp_prop_time_s", "speedup_vs_dp_prop"),
                          ("fsdp (ZeRO-3 over every device)", "fsdp_time_s", "speedup_vs_fsdp")):
        if key == "fsdp_time_s" and p.meta.get("fsdp_oom") is None:
            continue  # (not seeded: one device a group, or refused by the executor)
        base = s[key]
        sp = f"speedup {s[sk]:.2f}x" if s[sk] else "baseline out of memory" if base is None else ""
        print(f"  vs {name}: {ms(base)}  {sp}")
    lb = s["lower_bound_s"]
    if lb and t:
        print(f"  lower bound: {ms(lb)}  (plan is {t / lb:.2f}x the bound)")
    pp = p.pipeline
    if pp is not None:
        from ..parallel.pipeline import spell_schedule

        print(f"  pipeline: {len(pp.stages)} stages from groups {pp.stages}, {pp.micro_batches} "
              f"micro-batch{'es' if pp.micro_batches > 1 else ''}, {spell_schedule(pp.schedule, pp.k, ' (k={k})')}")
    if s["source"] == "layout-grid":
        shape = " (no pipeline)" if p.pipeline is None else ""  # tensor parallelism alone
        why_grid = ("fits where every searched plan runs out of memory" if p.meta.get("grid_because")
                    else "beats the searched plan")
        how = f", {s['refinement']}" if s.get("refinement") else ""
        where = f" with the {s['idle_kinds']} GPUs idle" if s.get("idle_kinds") else ""
        print(f"  a Megatron-style layout {why_grid}: {s['layout']}{shape}{where}{how}")
    elif s["source"] != "search":
        print(f"  search found nothing better than the baselines; returning {s['source']}")
    why = s["execution_refusal"]  # (--allow-unexecutable) e.g. tp beside data parallel: simulated only
    if why:
        print(f"  simulated only: tag execute refuses this plan ({why})")
    print(f"  {s['compression']}")
    if args.out:
        print(f"plan written to {args.out}")
        if not why:
            import shlex
            run = (f"tag execute --model {shlex.quote(args.model)} --topology {shlex.quote(args.topology)} "
                   f"--plan {shlex.quote(args.out)}" + ("" if args.optimizer == "adam" else f" --optimizer {args.optimizer}")
                   + ("" if args.seed == 0 else f" --seed {args.seed}"))
            # (machines the plan leaves idle launch nothing: tag.executor.launch.on_used_machines)
            many = " --run-dir DIR --torchrun HOST0:29500" if len(p.used_machines(topo)) > 1 else ""
            print(f"run it: {run}{many}" + ("  (prints each machine's torchrun command)" if many else ""))
    if args.trace:
        print(f"trace written to {args.trace}")
