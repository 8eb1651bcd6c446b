"""Arguments and loaders shared by several commands."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

# Stated bounds of numeric arguments (tag.limits), checked by argparse before any work (capture, search).
from ..limits import MAX_BATCH, MAX_BUDGET, MAX_GROUPS, MAX_SEED  # noqa: F401 (MAX_BUDGET: for the commands)

# Where a command's default output folder lies (tag.io.output_dir), for --help.
OUTSIDE = "in the checkout; for an installed package, under $XDG_DATA_HOME/tag (~/.local/share/tag)"
PROFILES_HELP = f"profile database root (default: $TAG_PROFILE_DIR, else data/profiles {OUTSIDE})"


class HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the text already states it or there is
    none to state (``None``, a flag's ``False``)."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        # (identity: a default of 0 is shown, though 0 == False; flags, nargs=0, have no value to show)
        if ("default" in text or default is None or default is False or default == argparse.SUPPRESS
                or not action.option_strings or action.nargs == 0 or text == argparse.SUPPRESS):
            return text
        shown = ",".join(map(str, default)) if isinstance(default, (list, tuple)) else default
        return f"{text} (default: {str(shown).replace('%', '%%')})" if text else f"default: {shown}"


class RawDescriptionHelpFormatter(argparse.RawDescriptionHelpFormatter, HelpFormatter):
    """:class:`HelpFormatter` that keeps the description's line breaks (a module docstring)."""


def int_in(lo: int, hi: int | None = None):
    """argparse ``type``: an integer in ``[lo, hi]`` (``hi`` None: no upper bound)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < lo or (hi is not None and value > hi):
            bound = f"at least {lo}" if hi is None else f"between {lo} and {hi}"
            raise argparse.ArgumentTypeError(f"expected an integer {bound}, got {value}")
        return value
    parse.__name__ = "integer"
    return parse


def seconds(text: str) -> float:
    """argparse ``type``: a positive, finite number of seconds (refuses 0, inf and nan)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a positive, finite number of seconds, got {text!r}")
    return value


def folder(text: str) -> str:
    """argparse ``type``: an existing folder (``--profiles DIR``: a typo would silently mean no profiles)."""
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"expected an existing folder, got {text!r}"
                                         + (" (a file)" if os.path.exists(text) else " (no such folder)"))
    return text


def add_model_args(p: argparse.ArgumentParser, *, groups: bool = True, required: bool = True) -> None:
    p.add_argument("--model", required=required,
                   help="zoo name with overrides (e.g. gpt2:n_layer=4) or package.module:function factory")
    p.add_argument("--batch", type=int_in(1, MAX_BATCH), default=None,
                   help=f"global batch size (samples, 1..{MAX_BATCH})")
    p.add_argument("--optimizer", default="adam", choices=["adam", "sgd", "sgd-plain"],
                   help="optimizer of the captured training step")
    p.add_argument("--seed", type=int_in(0, MAX_SEED), default=0, help="random seed for weights and inputs")
    add_precision_arg(p)
    if groups:
        p.add_argument("--groups", type=int_in(1, MAX_GROUPS), default=48,
                       help=f"number of op-groups (1..{MAX_GROUPS}, default 48)")


def add_precision_arg(p: argparse.ArgumentParser, default: str | None = "fp32") -> None:
    p.add_argument("--precision", default=default, choices=["fp32", "bf16", "fp16"],
                   help="fp32, or torch.autocast mixed precision: fp32 master weights and optimizer state, "
                        "bf16/fp16 activations (fp16 with loss scaling); default "
                        + (default or "the plan's"))


def add_launch_args(p: argparse.ArgumentParser, model_help: str) -> None:
    """What a command launching a plan's ranks reads (``tag execute``, ``tag validate``, ``tag run``):
    the model, topology, batch, optimizer, precision, seed, op-groups and backend."""
    p.add_argument("--model", required=True, help=model_help)
    p.add_argument("--topology", required=True, help="topology file (one rank per device)")
    p.add_argument("--batch", type=int_in(1, MAX_BATCH), default=None,
                   help=f"global batch (1..{MAX_BATCH}; default: the plan's)")
    p.add_argument("--optimizer", default="adam", choices=["adam", "sgd", "sgd-plain"],
                   help="optimizer the plan was made for")
    add_precision_arg(p, default=None)
    p.add_argument("--seed", type=int_in(0, MAX_SEED), default=0,
                   help="random seed for weights, inputs and every rank's random stream (dropout masks)")
    p.add_argument("--groups", type=int_in(1, MAX_GROUPS), default=None, help="op-groups (default: the plan's)")
    p.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"],
                   help="auto: NCCL when every rank has a GPU on this machine, else gloo")


def add_compile_arg(p: argparse.ArgumentParser, when: str) -> None:
    """``--compile`` of ``tag execute`` and ``tag run``: the ranks' fused segments through torch.compile."""
    p.add_argument("--compile", action="store_true",
                   help="run each rank's fused stage segments (forward, backward) through torch.compile (Inductor; "
                        f"compiled {when}; CPU needs a C++ compiler)")


def add_numerics_args(p: argparse.ArgumentParser) -> None:
    """PyTorch's TF32 switches for the GPU cost model (:class:`tag.cost.gpu.Numerics`)."""
    p.add_argument("--matmul-tf32", action="store_true",
                   help="fp32 matmuls run on TF32 (torch.backends.cuda.matmul.allow_tf32 = True; PyTorch's "
                        "default is off)")
    p.add_argument("--no-cudnn-tf32", action="store_true",
                   help="fp32 convolutions run in full fp32 (torch.backends.cudnn.allow_tf32 = False; PyTorch's "
                        "default is TF32)")


def numerics_of(args):
    from ..cost.gpu import Numerics

    return Numerics(matmul_tf32=bool(getattr(args, "matmul_tf32", False)),
                    conv_tf32=not getattr(args, "no_cudnn_tf32", False))


def add_force_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--force", action="store_true",
                   help="replace output files that exist (never one of this command's own inputs)")


def add_ray_arg(p: argparse.ArgumentParser, items: str) -> None:
    p.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                   help=f"run the {items} as Ray tasks: on the cluster at ADDRESS (auto, HOST:6379, "
                        "ray://HOST:10001; tag installed on every node), or, without ADDRESS, on a Ray cluster "
                        "started on this machine (needs `pip install 'tag-planner[ray]'`; default: this "
                        "machine's process pool)")


def backend_of(args, workers: int = 1):
    """The :class:`tag.dispatch.Backend` of ``--ray`` (a local pool of ``workers`` without it),
    connected: a cluster that cannot be reached is a one-line error before any work."""
    from ..dispatch import Backend
    backend = Backend(workers=workers, ray=args.ray)
    backend.connect()
    return backend


def _input_files(args) -> list[str]:
    """Files the command reads: --topology (a path or a shipped name), --plan, --checkpoint and a
    ``path/to/file.py:function`` model factory."""
    files = [getattr(args, k, None) for k in ("plan", "checkpoint", "file")]
    topo = getattr(args, "topology", None)
    if topo:
        from ..topology.loader import shipped_topologies
        files.append(topo if os.path.exists(topo) else str(shipped_topologies().get(topo, topo)))
    model = getattr(args, "model", None)
    if model and ".py:" in model:
        files.append(model.rsplit(":", 1)[0])
    return [f for f in files if f and os.path.isfile(f)]


def check_outputs(args, **outputs: str | None) -> None:
    """Refuse before any work (one-line TagError) an output file, e.g. ``out=args.out``, that
    is one of the command's inputs (even with --force), that two outputs share, that is a device
    node, FIFO or socket (even with --force), whose folder this process cannot write, or that
    exists without ``--force``. The one convention of every command that writes files (docs/user-guide.md,
    "Errors and output files")."""
    from ..errors import TagError
    from ..io import check_output_file

    given = {f"--{k.replace('_', '-')}": v for k, v in outputs.items() if v}
    inputs = _input_files(args)
    seen: dict[str, str] = {}
    for flag, path in given.items():
        real = os.path.realpath(path)
        for src in inputs:
            if real == os.path.realpath(src):
                raise TagError(f"{flag}: {path} is an input of this command; refusing to overwrite it")
        if real in seen:
            raise TagError(f"{flag}: {path} is also the {seen[real]} file; give different files")
        seen[real] = flag
        if os.path.isdir(path):
            raise TagError(f"{flag}: {path} is a folder; expected a file name")
        check_output_file(path, TagError, flag)  # a regular file (or none) in a folder, or one to make, we can write
        if os.path.lexists(path) and not getattr(args, "force", False):
            raise TagError(f"{flag}: {path} exists; pass --force to replace it")


def add_cache_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-cache", action="store_true",
                   help="capture again instead of reading the graph cache ($TAG_CACHE_DIR/graphs), and store nothing")


def load_graph(args):
    """``(OpGraph, seconds, from_cache)`` of ``--model/--batch/--optimizer/--precision/--groups/--seed``
    (:func:`tag.planner.model_graph`; ``--no-cache`` bypasses the graph cache)."""
    from ..planner import model_graph

    return model_graph(args.model, args.batch, optimizer=args.optimizer,
                       precision=getattr(args, "precision", "fp32"), seed=args.seed,
                       num_groups=getattr(args, "groups", 48), use_cache=not getattr(args, "no_cache", False))


def print_json(obj) -> None:
    json.dump(obj, sys.stdout, indent=1)
    sys.stdout.write("\n")


def print_torchrun(launch, as_json: bool, where: str, endpoint: str) -> None:
    """The machines' ``torchrun`` commands of a prepared run (:class:`tag.executor.TorchrunLaunch`;
    ``tag execute`` / ``tag run --torchrun``): as JSON, or a line per machine after
    ``run folder DIR (BACKEND): <where>``."""
    from dataclasses import asdict

    if as_json:
        print_json(asdict(launch))
        return
    print(f"run folder {launch.run_dir} ({launch.backend}): {where}")
    for name, cmd in launch.commands:
        print(f"  on {name}:  {cmd}")
    if launch.idle_machines:
        print(f"  (nothing on {', '.join(launch.idle_machines)}: the plan leaves them idle; "
              f"{endpoint} must be {launch.commands[0][0]}'s address, node 0)")


class StageProgress:
    """Stage lines and a search bar on stderr for a long command, only where a person watches:
    stderr is a terminal and the command prints no JSON (``quiet``). Called as
    ``progress(stage)`` when a stage starts and ``progress(stage, done, total)`` as it advances
    (the protocol of :func:`tag.planner.find_plan`'s ``progress``)."""

    def __init__(self, quiet: bool = False, stream=None):
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = not quiet and self.stream.isatty()
        self.stage: str | None = None
        self.bar = None

    def __call__(self, stage: str, done: int | None = None, total: int | None = None) -> None:
        if not self.enabled:
            return
        if stage != self.stage:
            self.close()
            self.stage = stage
            if done is None:
                print(f"{stage}...", file=self.stream, flush=True)
            else:
                from tqdm import tqdm

                try:  # a terminal that reports no size (0 x 0) would get no bar at all from tqdm
                    sized = min(os.get_terminal_size(self.stream.fileno())) > 0
                except (OSError, ValueError, AttributeError):
                    sized = False
                fixed = {} if sized else {"ncols": 80, "nrows": 24}
                self.bar = tqdm(total=total, desc=stage, unit="plan", file=self.stream, leave=False,
                                dynamic_ncols=sized, **fixed)
        if self.bar is not None and done is not None:
            self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
