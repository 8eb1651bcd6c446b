"""Random (model, topology) pairs for training the predictor.

Everything is a pure function of ``(seed, index)``, so an interrupted generation resumes with
exactly the same pairs. Models are zoo entries at varied depths, widths and batch sizes (kept
small: each distinct model is captured once, 1-10 s); topologies are random heterogeneous
clusters: 2-32 GPUs over 1-8 machines of catalog GPU types, PCIe or NVLink inside a machine,
1-100 Gbit/s between machines, occasionally a slow link between a pair of machines or uneven
machine sizes. With ``large_fraction`` > 0 that share of the pairs is drawn at scale instead
(:func:`random_large_topology`: 48-256 GPUs over 4-32 machines of 1-4 GPU kinds, often in zones
with a faster network inside a zone; :data:`LARGE_MODELS` at the batch sizes of data parallelism
over that many GPUs); the other pairs are exactly those of ``large_fraction = 0``. With
``large_inputs="full"`` the models at scale take the inputs of their published settings
(:data:`LARGE_INPUTS`: 512-token sequences, 224x224 images) instead of the zoo's small defaults.

Held out for the benchmark (never generated here): the shipped topologies and the benchmark
models listed in :data:`HELD_OUT_MODELS`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

# Training models: (zoo spec, batch choices). Small enough to capture in a few seconds.
TRAIN_MODELS: tuple[tuple[str, tuple[int, ...]], ...] = (
    ("mlp:layers=6,hidden=512", (32, 128)),
    ("mlp:layers=12,hidden=1024", (64, 256)),
    ("gpt2:n_layer=2,n_embd=128", (8, 32)),
    ("gpt2:n_layer=3,n_embd=256", (16, 64)),
    ("gpt2:n_layer=2,n_embd=512,n_head=8", (8, 32)),
    ("bert:n_layer=3,n_embd=192,n_head=4", (8, 32)),
    ("vit:n_layer=3,n_embd=192,n_head=4", (16, 64)),
    ("resnet:depth=18,width=16,norm=gn", (16, 64)),
    ("resnet:depth=18,width=32,norm=gn", (8, 32)),
    ("vgg:depth=11,width=16", (16, 64)),
    ("vgg:depth=13,width=32", (8, 32)),
)
HELD_OUT_MODELS: tuple[str, ...] = (
    "gpt2:n_layer=4,n_embd=256", "bert:n_layer=4,n_embd=256", "vgg:depth=16,width=32",
    "resnet:depth=34,width=16,norm=gn", "vit:n_layer=4,n_embd=256",
)
GROUP_CHOICES = (8, 16, 24, 32, 48)
LARGE_MODELS: tuple[tuple[str, tuple[int, ...]], ...] = (
    ("gpt2:n_layer=4,n_embd=512,n_head=8", (128, 256)),
    ("gpt2:n_layer=6,n_embd=384,n_head=6", (256, 512)),
    ("bert:n_layer=4,n_embd=384,n_head=6", (128, 256)),
    ("vit:n_layer=4,n_embd=384,n_head=6", (128, 256)),
    ("mlp:layers=12,hidden=2048", (512, 1024)),
    ("resnet:depth=18,width=32,norm=gn", (256,)),
    ("vgg:depth=11,width=32", (256,)),
)
"""Models of the pairs at scale: the zoo at sizes and batches where 48-256 GPUs each get a few
samples (none is a held-out model of the planner benchmark)."""
LARGE_INPUTS: dict[str, str] = {"gpt2": "seq=512", "bert": "seq=512", "vit": "image=224,patch=16",
                                "resnet": "image=224", "vgg": "image=224"}
"""Zoo overrides of the models at scale with ``large_inputs="full"``, per family: the input sizes
of the published settings (BERT's 512-token sequences, GPT-2's 1,024 cut to 512, ImageNet's
224x224 images, ViT's 16x16 patches) instead of the zoo's defaults (64 tokens, 32x32 images),
which give a model 8-49x less compute per sample for the same parameter bytes. On 2026-11-27
(evaluation/results/planner-bench-mix/ at 167c2e8) the best first action of 20 pairs at scale, every root
action simulated, spanned several machines in 1 of 20 pairs with the zoo's inputs and in 12 of 20
with these. ``mlp`` has no input of a published setting: unchanged."""
LARGE_INPUT_CHOICES = ("zoo", "full")
"""``large_inputs`` values: ``zoo`` (the zoo's default inputs, the pairs of before 2026-11-27) or
``full`` (:data:`LARGE_INPUTS`)."""

# GPU types drawn for random machines (catalog names).
GPU_TYPES = ("P100-SXM2-16GB", "V100-SXM2-16GB", "V100-SXM2-32GB", "GTX-1080Ti", "RTX-2080Ti", "T4",
             "RTX-3090", "A10", "A100-40GB", "A100-80GB", "L4", "H100-SXM")


@dataclass(frozen=True)
class PairSpec:
    """One training pair."""

    index: int
    model: str
    batch: int
    groups: int
    topology: dict
    """``load_topology``-compatible dict."""

    def to_dict(self) -> dict:
        return asdict(self)


def random_topology(rng: np.random.Generator, name: str) -> dict:
    """A random heterogeneous cluster description (see the module docstring)."""
    n_machines = int(rng.choice([1, 2, 2, 3, 4, 4, 5, 6, 8]))
    total_cap = 32
    machines = []
    n_types = int(rng.integers(1, min(n_machines, 3) + 1))
    types = list(rng.choice(GPU_TYPES, size=n_types, replace=False))
    budget = total_cap
    for m in range(n_machines):
        left = n_machines - m - 1
        max_count = max(1, min(8, budget - left))
        count = int(rng.choice([c for c in (1, 2, 4, 8) if c <= max_count] or [1]))
        if n_machines == 1 and count == 1:
            count = 2
        budget -= count
        nvlink = rng.random() < 0.4
        intra = float(rng.uniform(100, 600)) if nvlink else float(rng.uniform(8, 32))
        entry = {"name": f"m{m}", "gpu": str(types[m % n_types] if rng.random() < 0.8 else rng.choice(types)),
                 "count": count}
        if count > 1:
            entry["intra_bandwidth"] = f"{intra:.1f} GB/s"
        machines.append(entry)
    gbit = float(np.exp(rng.uniform(np.log(1.0), np.log(100.0))))
    topo = {"name": name, "machines": machines,
            "network": {"bandwidth": f"{gbit:.2f} Gbit/s", "latency": f"{rng.uniform(5, 50):.1f} us"}}
    if n_machines >= 2 and rng.random() < 0.3:
        a, b = rng.choice(n_machines, size=2, replace=False)
        slow = gbit * float(rng.uniform(0.05, 0.4))
        topo["network"]["links"] = [{"between": [f"m{a}", f"m{b}"], "bandwidth": f"{slow:.3f} Gbit/s",
                                     "latency": f"{rng.uniform(20, 200):.1f} us"}]
    return topo


def random_large_topology(rng: np.random.Generator, name: str) -> dict:
    """A random cluster at scale: 48-256 GPUs over 4-32 machines of 2, 4 or 8 GPUs, 1-4 GPU kinds
    (one per machine), NVLink or PCIe inside a machine, 1-50 Gbit/s between machines; in half of
    them the machines sit in 2-4 zones with 25-400 Gbit/s inside a zone (as the shipped
    ``hetero-64gpu`` and ``cloud-256gpu-3zones``)."""
    while True:
        n_machines = int(rng.integers(4, 33))
        per = [int(rng.choice([2, 4, 8, 8])) for _ in range(n_machines)]
        if 48 <= sum(per) <= 256:
            break
    n_types = int(rng.integers(1, 5))
    types = list(rng.choice(GPU_TYPES, size=n_types, replace=False))
    n_zones = int(rng.integers(2, 5)) if rng.random() < 0.5 else 0
    machines = []
    for m, count in enumerate(per):
        nvlink = rng.random() < 0.5
        intra = float(rng.uniform(100, 600)) if nvlink else float(rng.uniform(8, 32))
        entry = {"name": f"m{m}", "gpu": str(types[m * n_types // n_machines]), "count": count,
                 "intra_bandwidth": f"{intra:.1f} GB/s"}
        if n_zones:
            entry["zone"] = f"z{m * n_zones // n_machines}"
        machines.append(entry)
    gbit = float(np.exp(rng.uniform(np.log(1.0), np.log(50.0))))
    network = {"bandwidth": f"{gbit:.2f} Gbit/s", "latency": f"{rng.uniform(10, 100):.1f} us"}
    if n_zones:
        network["zones"] = [{"name": f"z{z}", "bandwidth": f"{float(np.exp(rng.uniform(np.log(25), np.log(400)))):.1f} Gbit/s",
                             "latency": f"{rng.uniform(5, 20):.1f} us"} for z in range(n_zones)]
    return {"name": name, "machines": machines, "network": network}


def sample_pair(seed: int, index: int, *, max_groups: int | None = None,
                models: tuple[tuple[str, tuple[int, ...]], ...] = TRAIN_MODELS,
                large_fraction: float = 0.0,
                large_models: tuple[tuple[str, tuple[int, ...]], ...] = LARGE_MODELS,
                large_inputs: str = "zoo") -> PairSpec:
    """The ``index``-th pair of the stream for ``seed``; with probability ``large_fraction`` (drawn
    from its own stream, so the other pairs do not move) a pair at scale, its model's inputs those
    of ``large_inputs`` (:data:`LARGE_INPUT_CHOICES`; the draws are the same for both)."""
    check_large_inputs(large_inputs)
    if large_fraction > 0:
        lrng = np.random.default_rng([seed, index, 3])
        if lrng.random() < large_fraction:
            spec, batches = large_models[int(lrng.integers(len(large_models)))]
            if large_inputs == "full":
                spec = full_inputs(spec)
            return PairSpec(index, spec, int(lrng.choice(batches)), _groups(lrng, max_groups),
                            random_large_topology(lrng, f"rand-{seed}-{index}"))
    rng = np.random.default_rng([seed, index])
    spec, batches = models[int(rng.integers(len(models)))]
    batch = int(rng.choice(batches))
    groups = _groups(rng, max_groups)
    return PairSpec(index, spec, batch, groups, random_topology(rng, f"rand-{seed}-{index}"))


def check_large_inputs(value: str) -> str:
    """``value`` if it is one of :data:`LARGE_INPUT_CHOICES`, else a one-line ValueError."""
    if value not in LARGE_INPUT_CHOICES:
        raise ValueError(f"large_inputs: expected one of {', '.join(LARGE_INPUT_CHOICES)}, got {value!r}")
    return value


def full_inputs(spec: str) -> str:
    """Zoo ``spec`` with its family's :data:`LARGE_INPUTS` overrides appended (unchanged for a
    family without any)."""
    extra = LARGE_INPUTS.get(spec.partition(":")[0])
    if not extra:
        return spec
    return f"{spec},{extra}" if ":" in spec else f"{spec}:{extra}"


def _groups(rng: np.random.Generator, max_groups: int | None) -> int:
    choices = [g for g in GROUP_CHOICES if max_groups is None or g <= max_groups] or [min(GROUP_CHOICES)]
    return int(rng.choice(choices))
