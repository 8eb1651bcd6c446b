"""``tag topology show|detect``: print a topology file as a table, or describe this machine."""

from __future__ import annotations

from .common import add_force_arg, check_outputs, print_json


def register(sub) -> None:
    p = sub.add_parser("topology", help="show a topology file or detect the local one",
                       description="Inspect cluster topologies (machines, GPUs, links).")
    tsub = p.add_subparsers(dest="topology_command", metavar="ACTION", required=True)
    show = tsub.add_parser("show", help="print a topology (YAML/JSON file or shipped name) as a table")
    show.add_argument("file", help="topology YAML/JSON file or shipped topology name (e.g. tag-testbed)")
    show.add_argument("--json", action="store_true", help="print the parsed topology as JSON (base units)")
    show.set_defaults(func=run_show)
    det = tsub.add_parser("detect", help="describe this machine (CUDA GPUs, else the CPU) as a topology")
    det.add_argument("--out", metavar="FILE",
                     help="write the topology YAML here (default: print it, and the table to stderr: "
                          "`tag topology detect > local.yaml` is a topology file)")
    det.add_argument("--name", default=None, help="topology name (default: the host name)")
    add_force_arg(det)
    det.set_defaults(func=run_detect)


def run_show(args) -> int:
    from ..topology import format_topology, load_topology

    topo = load_topology(args.file)
    if args.json:
        print_json(topo.to_dict())
    else:
        print(format_topology(topo))
    return 0


def run_detect(args) -> int:
    import os
    import sys
    import tempfile

    from ..topology import detect_topology, dump_topology, format_topology

    check_outputs(args, out=args.out)
    topo = detect_topology(args.name)
    if args.out:
        dump_topology(topo, args.out)
        print(f"wrote {args.out}")
    else:
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "topology.yaml")
            dump_topology(topo, path)
            print(open(path).read(), end="")
    # (without --out stdout is the YAML alone; the table goes beside it, for a person)
    print(format_topology(topo), file=sys.stdout if args.out else sys.stderr)
    return 0
