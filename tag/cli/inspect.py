"""``tag inspect``: capture a model and summarise its op graph and op-groups."""

from __future__ import annotations

from .common import (
    add_cache_arg,
    add_force_arg,
    add_model_args,
    check_outputs,
    int_in,
    load_graph,
    print_json,
)


def register(sub) -> None:
    p = sub.add_parser("inspect", help="capture a model's training iteration and summarise its op graph",
                       description="Capture forward, backward and optimizer of a model as an op graph, group it, "
                                   "and print ops, groups, FLOPs, parameters, activation bytes and the heaviest groups. "
                                   "--list shows the zoo models and presets instead.")
    add_model_args(p, required=False)
    add_cache_arg(p)
    p.add_argument("--list", action="store_true", help="list the zoo models and presets (parameters, default batch, "
                                                       "sequence or image size) and exit")
    p.add_argument("--top", type=int_in(0), default=5, help="how many of the heaviest groups to list")
    p.add_argument("--json", action="store_true", help="print a JSON summary")
    p.add_argument("--save", metavar="PATH", help="also write the op graph as JSON to PATH")
    add_force_arg(p)
    p.set_defaults(func=run)


def list_models(as_json: bool) -> int:
    from ..workloads.zoo import zoo_entries, zoo_params

    rows = []
    for name, e in zoo_entries().items():
        size = e.defaults.get("seq", e.defaults.get("image"))
        rows.append({"name": name, "params": zoo_params(name), "batch": e.batch,
                     "size": f"{'seq' if 'seq' in e.defaults else 'image'} {size}" if size else "-",
                     "attn": e.defaults.get("attn", "-"), "description": e.summary()})
    if as_json:
        print_json(rows)
        return 0
    print(f"{'model':<12} {'params':>8} {'batch':>5}  {'seq/image':<10} {'attn':<5} description")
    for r in rows:
        print(f"{r['name']:<12} {_count(r['params']):>8} {r['batch']:>5}  {r['size']:<10} {r['attn']:<5} "
              f"{r['description'].split('; defaults')[0]}")
    return 0


def _count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(n)


def run(args) -> int:
    from ..errors import TagError
    from ..graph.summary import graph_summary
    from ..io import write_atomic
    from ..topology.table import render_table
    from ..topology.units import format_bytes, format_time

    if args.list:
        return list_models(args.json)
    if not args.model:
        raise TagError("--model is required (or --list to see the zoo)")
    check_outputs(args, save=args.save)
    graph, seconds, hit = load_graph(args)
    s = graph_summary(graph, top=args.top)
    s["capture_s"] = round(seconds, 3)
    s["from_cache"] = hit
    if args.save:
        write_atomic(args.save, graph.to_json())
    if args.json:
        print_json(s)
        return 0
    ph = s["num_ops_by_phase"]
    print(f"model        {s['model']}  (batch {s['batch_size']}, {s['precision']}, optimizer {s['optimizer']})")
    print(f"ops          {s['num_ops']}  (fwd {ph.get('fwd', 0)}, bwd {ph.get('bwd', 0)}, opt {ph.get('opt', 0)})")
    print(f"op-groups    {s['num_groups']}")
    print(f"parameters   {s['num_params']:,}  ({format_bytes(s['param_bytes'], digits=3)}; "
          f"optimizer state {format_bytes(s['opt_state_bytes'], digits=3)})")
    print(f"FLOPs        fwd {s['flops_fwd'] / 1e9:.3f} G, fwd+bwd {s['flops_fwd_bwd'] / 1e9:.3f} G, "
          f"optimizer {s['flops_opt'] / 1e9:.4f} G")
    print(f"activations  {format_bytes(s['activation_bytes'], digits=3)} saved for backward")
    print(f"capture      {s['capture_s']:.1f} s{' (graph cache)' if hit else ''}, signature {s['signature']}")
    print("\nheaviest groups (reference roofline time, V100):")
    rows = [[str(g["group"]), str(g["ops"]), format_bytes(g["param_bytes"], digits=3), f"{g['flops'] / 1e9:.3f}",
             format_time(g["weight_s"], digits=3), g["first_op"]] for g in s["heaviest_groups"]]
    print(render_table(["group", "ops", "params", "GFLOPs", "time", "first op"], rows))
    return 0
