"""Benchmark suites: which models, topologies and methods ``tag bench`` puts side by side.

Models here are held out of the planner's training data (``tag/data/pairs.py`` samples other
depths/widths), so the GNN is judged on graphs it has never seen.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Method names and what they are (see tag/bench/runner.py for how each runs). The searches and
# the grid range over every plan the simulator costs (PlannerConfig(executable=False), the layouts
# with and without sequence parallelism): the figures are comparable with those recorded before
# tag plan searched executable plans only; a plan tag execute refuses says so in its cell's note.
METHODS: dict[str, str] = {
    "dp": "data parallel, even shares (Horovod-like)",
    "dp-prop": "data parallel, shares proportional to device speed",
    "single": "best single device",
    "mp": "greedy model parallel (fill devices in topological order by memory)",
    "fsdp": "FSDP: ZeRO-3 over every device, even shares (parameters, gradients, optimizer state sharded)",
    "dp-tp-pp-grid": "best Megatron-style layout by hand: dp x tp x pp = devices (tp 2-8 within a machine "
                     "where the model's blocks divide), balanced stages, 1F1B with 1-64 micro-batches, "
                     "sequence parallelism and full recomputation on or off",
    "random": "random search",
    "sa": "simulated annealing",
    "tpe": "optuna TPE, one categorical per op-group",
    "mcts-uniform": "MCTS with a uniform prior",
    "tag-50": "TAG: GNN-guided MCTS, 50 playouts, then the layout grid and its refinements, no compression",
    "tag-200": "TAG: GNN-guided MCTS, 200 playouts, then the layout grid and its refinements, no compression",
    "tag-50+sfb": "TAG: GNN-guided MCTS, 50 playouts, then the layout grid and its refinements, SFB compression",
    "tag-200+sfb": "TAG: GNN-guided MCTS, 200 playouts, then the layout grid and its refinements, SFB compression",
    "lower-bound": "ideal: total compute / summed device throughput, no communication",
}


@dataclass(frozen=True)
class ModelCase:
    """One workload of a suite."""

    spec: str
    """Workload spec (zoo name with overrides or factory)."""
    batch: int
    """Global batch size (samples)."""


@dataclass
class SuiteConfig:
    """A benchmark suite."""

    name: str
    models: list[ModelCase]
    topologies: list[str]
    """Shipped topology names (``tag/topology/shipped/<name>.yaml``) or paths."""
    methods: list[str] = field(default_factory=lambda: list(METHODS))
    search_budget: int = 2000
    """Simulator calls (playouts) for random / sa / tpe / mcts-uniform; TAG's are in its name."""
    groups: int = 32
    """Op-groups per model."""
    seed: int = 0
    execute_topologies: list[str] = field(default_factory=list)
    """Topologies of local CPU devices on which every method's plan is also executed for real."""
    execute_steps: int = 3
    """Measured iterations per executed plan (after one warm-up)."""
    precision: str = "fp32"
    """Training precision of every model (``fp32``, ``bf16``, ``fp16``; :mod:`tag.graph.precision`)."""

    def __post_init__(self) -> None:
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown:
            raise ValueError(f"suite {self.name}: unknown method {unknown[0]!r}; expected one of {list(METHODS)}")
        if self.search_budget < 1 or self.groups < 1 or self.execute_steps < 1:
            raise ValueError(f"suite {self.name}: search_budget, groups and execute_steps must be positive")


TAG_TESTBED = "tag-testbed"
HETERO = ["tag-testbed", "mixed-a100-v100", "cloud-t4"]
CONTROLS = ["homogeneous-8xa100", "homogeneous-2x4-v100"]


def quick_suite() -> SuiteConfig:
    """Under 10 minutes on a 2-core machine."""
    return SuiteConfig(
        name="quick",
        models=[ModelCase("gpt2:n_layer=3,n_embd=192,n_head=4,seq=64", 32),
                ModelCase("resnet:depth=18,width=24,norm=gn", 32)],
        topologies=["tag-testbed", "cloud-t4", "homogeneous-8xa100"],
        search_budget=500,
        groups=24,
        execute_topologies=["local-cpu2"],
        execute_steps=2,
    )


def full_suite() -> SuiteConfig:
    """The zoo at the sizes people train (presets of ``tag inspect --list``), in bf16, on the
    shipped GPU topologies (simulated). Real-size models are not executed on this suite's CPU
    ranks (GPT-2 medium's Adam state alone is 5.7 GB per replica): the quick suite executes its
    plans for real, and ``tag validate`` checks predictions against executions."""
    return SuiteConfig(
        name="full",
        models=[ModelCase("gpt2-medium", 32),
                ModelCase("bert-large", 32),
                ModelCase("vit-l16", 64),
                ModelCase("resnet152", 64),
                ModelCase("vgg19", 64),
                ModelCase("llama-1b", 16)],
        topologies=HETERO + CONTROLS,
        search_budget=2000,
        groups=32,
        precision="bf16",
    )


SCALE = ["hetero-64gpu", "cloud-256gpu-3zones", "h100-512gpu"]
"""The shipped topologies at scale (64, 256, 512 GPUs; sources of their figures in the files)."""


def scale_suite() -> SuiteConfig:
    """Real-size models in bf16 at the batch sizes people train them with (Llama-2 7B shape and
    GPT-2 XL, 512 sequences of 2048 / 1024 tokens), cut into 128 op-groups, on 64, 256 and 512
    GPUs, every method. Neither fits one device: plans need model parallelism, pipelines, tensor
    parallelism or activation recomputation. Beyond :data:`tag.planner.GNN_MAX_DEVICES` the
    ``tag-*`` methods search with the uniform prior (the cell's note says so). Hours on a 2-core
    machine (a simulation of a 512-GPU plan costs ~0.1-0.5 s): run it by topology or model with
    ``--topologies`` / ``--models`` into one ``--out``. The suite until 2026-11-26 (a 12-layer
    GPT-2 of width 768 at sequence 128, fp32) is ``evaluation/results/scale-2026-11-26`` at a818f3a."""
    return SuiteConfig(
        name="scale",
        models=[ModelCase("llama-7b", 512), ModelCase("gpt2-xl", 512)],
        topologies=list(SCALE),
        search_budget=2000,
        groups=128,
        precision="bf16",
    )


SUITES = {"quick": quick_suite, "full": full_suite, "scale": scale_suite}
