"""``tag inspect``: capture a model and summarise its op graph and op-groups."""

from __future__ import annotations

from .common import add_force_arg, add_model_args, check_outputs, int_in, load_captured, print_json


def register(sub) -> None:
    p = sub.add_parser("inspect", help="capture a model's training iteration and summarise its op graph",
                       description="Capture forward, backward and optimizer of a model as an op graph, group it, "
                                   "and print ops, groups, FLOPs, parameters, activation bytes and the heaviest groups.")
    add_model_args(p)
    p.add_argument("--top", type=int_in(0), default=5, help="how many of the heaviest groups to list")
    p.add_argument("--json", action="store_true", help="print a JSON summary")
    p.add_argument("--save", metavar="PATH", help="also write the op graph as JSON to PATH")
    add_force_arg(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from ..graph.summary import graph_summary
    from ..io import write_atomic
    from ..topology.table import render_table
    from ..topology.units import format_bytes, format_time

    check_outputs(args, save=args.save)
    wl, cap = load_captured(args)
    s = graph_summary(cap.graph, top=args.top)
    s["capture_s"] = round(cap.export_seconds, 3)
    if args.save:
        write_atomic(args.save, cap.graph.to_json())
    if args.json:
        print_json(s)
        return 0
    ph = s["num_ops_by_phase"]
    print(f"model        {s['model']}  (batch {s['batch_size']}, optimizer {s['optimizer']})")
    print(f"ops          {s['num_ops']}  (fwd {ph.get('fwd', 0)}, bwd {ph.get('bwd', 0)}, opt {ph.get('opt', 0)})")
    print(f"op-groups    {s['num_groups']}")
    print(f"parameters   {s['num_params']:,}  ({format_bytes(s['param_bytes'], digits=3)}; "
          f"optimizer state {format_bytes(s['opt_state_bytes'], digits=3)})")
    print(f"FLOPs        fwd {s['flops_fwd'] / 1e9:.3f} G, fwd+bwd {s['flops_fwd_bwd'] / 1e9:.3f} G, "
          f"optimizer {s['flops_opt'] / 1e9:.4f} G")
    print(f"activations  {format_bytes(s['activation_bytes'], digits=3)} saved for backward")
    print(f"capture      {s['capture_s']:.1f} s, signature {s['signature']}")
    print("\nheaviest groups (reference roofline time, V100):")
    rows = [[str(g["group"]), str(g["ops"]), format_bytes(g["param_bytes"], digits=3), f"{g['flops'] / 1e9:.3f}",
             format_time(g["weight_s"], digits=3), g["first_op"]] for g in s["heaviest_groups"]]
    print(render_table(["group", "ops", "params", "GFLOPs", "time", "first op"], rows))
    return 0
