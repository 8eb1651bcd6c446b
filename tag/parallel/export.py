"""A plan as the configuration of the trainers people run: torchtitan, Megatron-LM, DeepSpeed.

A TAG plan that is a uniform layout (:class:`~tag.parallel.layout.Layout`: ``dp`` replicas x
``tp``-way tensor parallelism x ``pp`` stages, micro-batches, schedule, recomputation, precision,
ZeRO sharding) is what these trainers run; this module recognises one in a plan and writes and
reads each trainer's configuration:

* **torchtitan**: a TOML job config (``--job.config_file``) with its ``[training]``,
  ``[parallelism]`` and ``[activation_checkpoint]`` sections, the field names of
  ``torchtitan/config/job_config.py`` at v0.2.2 (2026-02-20), its last release read from TOML
  (later ones take a Python ``Trainer.Config``: pytorch/torchtitan 9810191, 2026-02-23);
* **Megatron-LM**: command-line arguments, one a line (``$(grep -v '^#' FILE)``), the flags of
  ``megatron/training/arguments.py`` at NVIDIA/Megatron-LM d98e8a6 (2026-08-22);
* **DeepSpeed**: the JSON config (``deepspeed.initialize(config=FILE)``), the keys of
  ``deepspeed/runtime/config.py`` at deepspeedai/DeepSpeed edaa722 (2026-08-22).

Each file states only the layout; the model, data, optimizer and checkpoints are the user's.
Every trainer numbers ranks as TAG does (pipeline stage outermost, then the data-parallel
replica, tensor parallel innermost: Megatron-LM's ``tp-cp-ep-dp-pp`` order, torchtitan's
``pp, dp_replicate, dp_shard, tp`` mesh, DeepSpeed's ``pipe, data, model`` topology), so rank
``r`` runs on the layout's ``r``-th device.

What a trainer cannot express (uneven batch shares, per-group placement or actions, a stage cut
inside a layer, a schedule it lacks, ...) is named by :func:`plan_layout` and :func:`for_trainer`,
each with the nearest layout it can; :func:`tag.planner.export_plan` costs that layout beside the
plan. What a trainer runs differently from TAG's executor but expresses (torchtitan's tensor
parallelism is sequence parallel, Megatron-LM's head vocabulary-parallel) changes the layout the
trainer runs (:func:`for_trainer`), which is the one costed and read back.
"""

from __future__ import annotations

import json
import shlex
import tomllib
from collections import Counter
from dataclasses import dataclass, field, replace

from ..errors import PlanError
from ..io import write_atomic
from ..plan.format import local_batches
from .layers import layer_starts, model_layers
from .layout import (
    MICRO_BATCHES,
    Layout,
    layout_devices,
    layout_plan,
    outside_blocks,
    spell_order,
    spell_stages,
)
from .pipeline import micro_ranges

TRAINERS = ("torchtitan", "megatron", "deepspeed")
"""Trainers a plan exports to (``tag plan --export``)."""

SCHEDULES = {"torchtitan": {"1f1b": "1F1B", "gpipe": "GPipe"}, "megatron": {"1f1b": ""}, "deepspeed": {"1f1b": ""}}
"""TAG's schedules each trainer runs (torchtitan: its ``pipeline_parallel_schedule`` name;
Megatron-LM and DeepSpeed run 1F1B, and gradient accumulation without a pipeline)."""

SHARDED = "zero" in Layout.__dataclass_fields__
"""Whether layouts carry ZeRO sharding (:attr:`Layout.zero`, :attr:`Layout.shard`)."""

PRECISIONS = {"torchtitan": ("fp32", "bf16"), "megatron": ("fp32", "bf16", "fp16"),
              "deepspeed": ("fp32", "bf16", "fp16")}
"""Precisions each trainer trains in (torchtitan's ``mixed_precision_param``: bfloat16 or float32)."""


def zero_of(layout: Layout) -> int:
    """The layout's ZeRO stage (0 where layouts carry no sharding)."""
    return getattr(layout, "zero", 0)


def shard_of(layout: Layout) -> int:
    """Devices per shard group of a hybrid-sharded layout (0: all ``dp``)."""
    return getattr(layout, "shard", 0)


def _sharded(layout: Layout, zero: int, shard: int = 0) -> Layout:
    """``layout`` with ZeRO stage ``zero`` and shard groups of ``shard`` devices."""
    if not SHARDED:
        if zero or shard:
            raise PlanError("export: zero: this TAG has no sharded data parallelism; expected ZeRO stage 0")
        return layout
    return replace(layout, zero=zero, shard=shard)


def spell(layout: Layout) -> str:
    """The layout's text (:func:`tag.parallel.layout.parse_layout` reads it), without its order."""
    text = f"dp={layout.dp},tp={layout.tp},pp={layout.pp},micro={layout.micro}"
    if layout.pp > 1 or layout.micro > 1:
        text += f",schedule={layout.schedule}" + (f",k={layout.k}" if layout.schedule == "kfkb" else "")
    for name in ("sp", "recompute", "vocab", "prop"):
        text += f",{name}=1" if getattr(layout, name) else ""
    if zero_of(layout):
        text += f",hsdp={shard_of(layout)}x{layout.dp // shard_of(layout)}" if shard_of(layout) else \
            f",zero={zero_of(layout)}"
    return text + (f",stages={spell_stages(layout.stages)}" if layout.stages is not None else "")


# ---- recognising a layout in a plan ------------------------------------------------------------
def plan_layout(plan, graph, topology, costs) -> tuple[Layout | None, list[str]]:
    """The layout nearest ``plan`` and what of the plan it drops, one line per feature (empty:
    the plan is exactly that layout's :func:`~tag.parallel.layout.layout_plan`); None when the
    plan has no layout shape to keep (stages of different widths or sharing devices). ``costs``
    builds the layout's plan for the final comparison."""
    groups, pipe = plan.groups, plan.pipeline
    bounds = (list(pipe.stages) if pipe else [0]) + [len(groups)]
    dropped: list[str] = []
    for what, test in (("model parallel (mp: the group's ops split over devices)", lambda g: g.sync == "mp"),
                       ("a parameter server (ps)", lambda g: g.sync == "ps"),
                       ("Sufficient Factor Broadcasting", lambda g: bool(g.sfb))):
        n = sum(map(test, groups))
        if n:
            dropped.append(f"{n} of {len(groups)} op-groups use {what}")
    stage_devs: list[tuple[int, ...]] = []
    uneven = None
    for s, (a, b) in enumerate(zip(bounds, bounds[1:])):
        kept = [g for g in groups[a:b] if g.sync not in ("mp", "ps")] or list(groups[a:b])
        sets = Counter(tuple(g.devices) for g in kept)
        devs = sets.most_common(1)[0][0]
        if len(sets) > 1:
            dropped.append(f"stage {s}'s op-groups run on {len(sets)} different device sets (per-group placement)")
        stage_devs.append(devs)
        for g in kept:
            if uneven is None and tuple(g.devices) == devs and not _even_samples(g, plan):
                uneven = f"uneven batch shares ({', '.join(f'{x:.3f}' for x in g.shares[:6])}" + \
                    (", ..." if len(g.shares) > 6 else "") + f" in stage {s})"
    if uneven:
        dropped.append(uneven)
    widths = [len(d) for d in stage_devs]
    flat = [d for devs in stage_devs for d in devs]
    if len(set(widths)) > 1:
        return None, dropped + [f"stages of different widths ({', '.join(map(str, widths))} devices)"]
    if len(set(flat)) < len(flat):
        return None, dropped + ["pipeline stages share devices"]
    tp, sp, vocab = _tensor_parallel(graph, groups, bounds, dropped)
    layout = _assemble(plan, graph, topology, groups, bounds, flat, widths[0], tp, sp, vocab, dropped)
    if layout is None or dropped:
        return layout, dropped
    return layout, _compare(plan, graph, topology, layout, costs)


def _even_samples(g, plan) -> bool:
    """Whether group ``g``'s shares give each device the samples even shares give (in every
    micro-batch): what a trainer runs, which splits each batch evenly."""
    even = [1.0 / len(g.shares)] * len(g.shares)
    sizes = {hi - lo for lo, hi in micro_ranges(plan.batch_size, plan.pipeline.micro_batches if plan.pipeline else 1)}
    return all(local_batches(b, g.shares) == local_batches(b, even) for b in sizes)


def _tensor_parallel(graph, groups, bounds, dropped: list[str]) -> tuple[int, int, int]:
    """``(tp, sp, vocab)`` of the plan's tensor-parallel groups (the most common degree);
    appends what differs to ``dropped``."""
    tps = Counter(g.tp or len(g.devices) for g in groups if g.sync == "tp")
    if not tps:
        return 1, 0, 0
    tp = tps.most_common(1)[0][0]
    if len(tps) > 1:
        dropped.append(f"tensor-parallel degrees differ across op-groups ({', '.join(map(str, sorted(tps)))})")
    sps = {g.sequence_parallel for g in groups if g.sync == "tp"}
    if len(sps) > 1:
        dropped.append("sequence parallelism on some tensor-parallel op-groups only")
    plain = {i for i, g in enumerate(groups) if g.sync != "tp"}
    outer = outside_blocks(graph)
    vocab = int(bool(plain) and plain <= outer and not any(sps))
    if plain and not vocab:
        dropped.append(f"tensor parallelism on {len(groups) - len(plain)} of {len(groups)} op-groups only")
    return tp, int(True in sps), vocab


def _assemble(plan, graph, topology, groups, bounds, flat, width, tp, sp, vocab, dropped) -> Layout | None:
    """The :class:`Layout` of the recognised degrees (None, with the reason in ``dropped``,
    when they do not make one)."""
    pipe = plan.pipeline
    n = sum(g.recompute for g in groups)
    if 0 < n < len(groups):
        dropped.append(f"recomputation on {n} of {len(groups)} op-groups (selective)")
    zeros = Counter((int(g.sync[4:]), getattr(g, "shard", None) or 0) for g in groups if g.sync.startswith("zero"))
    zero, shard = zeros.most_common(1)[0][0] if zeros else (0, 0)
    if zeros and (len(zeros) > 1 or sum(zeros.values()) < len(groups)):
        dropped.append("ZeRO sharding differs across op-groups")
    off = sum(bool(getattr(g, "offload", None)) for g in groups)
    if off:  # (DeepSpeed's offload_optimizer, Megatron-LM's --optimizer-cpu-offload: not written)
        dropped.append(f"optimizer offload on {off} of {len(groups)} op-groups (offload=optimizer)")
    stages = None
    if len(bounds) > 2:
        stages = _stage_layers(graph, bounds[:-1], dropped)
    order = None if flat == list(range(topology.num_devices)) else tuple(flat)
    if width % tp:
        dropped.append(f"{width} devices per stage do not hold tp={tp} groups")
        return None
    try:
        lay = Layout(dp=width // tp, tp=tp, pp=len(bounds) - 1, micro=pipe.micro_batches if pipe else 1,
                     schedule=pipe.schedule if pipe else "1f1b", k=pipe.k if pipe else 1, sp=sp,
                     recompute=int(n > 0), vocab=vocab if tp > 1 else 0, stages=stages, order=order)
        return _sharded(lay, zero, shard if shard and shard < lay.dp else 0)
    except PlanError as e:
        dropped.append(str(e))
        return None


def _stage_layers(graph, starts: list[int], dropped: list[str]) -> tuple[int, ...] | None:
    """Transformer layers of each stage beginning at op-groups ``starts``; a stage beginning
    inside a layer is named in ``dropped`` and moved to the layer start nearest it (None: the
    model has no numbered layers, or no layer cut keeps every stage one)."""
    layers = model_layers(graph)
    if not len(layers):
        dropped.append(f"model {graph.model!r} has no numbered layers: trainers cut stages between layers")
        return None
    first = layer_starts(graph, layers)
    cuts = []
    for s, g in enumerate(starts[1:], 1):
        at = [i for i, x in enumerate(first) if x == g and i > 0]
        if not at:
            dropped.append(f"stage {s} begins inside a layer (op-group {g}); trainers cut stages between layers")
            at = sorted((i for i, x in enumerate(first) if x is not None and i > 0), key=lambda i: abs(first[i] - g))
        nxt = [i for i in at if not cuts or i > cuts[-1]]
        if not nxt:
            return None
        cuts.append(nxt[0])
    counts = tuple(b - a for a, b in zip([0] + cuts, cuts + [len(layers)]))
    return counts if min(counts) > 0 else None


def _compare(plan, graph, topology, layout: Layout, costs) -> list[str]:
    """What the plan does otherwise than ``layout``'s own plan: the first op-group that differs,
    or the pipeline (empty: the same deployment)."""
    try:
        mine = layout_plan(graph, topology, layout, costs)
    except PlanError as e:
        return [str(e)]
    for g, (a, b) in enumerate(zip(plan.groups, mine.groups)):
        if _even_samples(a, plan):  # (shares that give the even split's samples are even shares)
            a = replace(a, shares=[1.0 / len(a.shares)] * len(a.shares))
        if a.key() != b.key():
            return [f"op-group {g} is deployed otherwise than the layout {spell(layout)} (per-group actions)"]
    ours = (plan.pipeline.stages, plan.pipeline.micro_batches) if plan.pipeline else None
    theirs = (mine.pipeline.stages, mine.pipeline.micro_batches) if mine.pipeline else None
    return [] if ours == theirs else [f"pipeline {ours} differs from the layout {spell(layout)}'s {theirs}"]


# ---- what each trainer runs --------------------------------------------------------------------
def for_trainer(layout: Layout, trainer: str, batch: int, precision: str) -> tuple[Layout | None, list[str], list[str]]:
    """``(run, problems, notes)``: the layout ``trainer`` runs for ``layout`` (None when no layout
    of these degrees is one it runs), what of ``layout`` it cannot express (one line each; the run
    layout is then the nearest it can) and what it runs otherwise than TAG's executor would,
    expressed all the same. One-line :class:`PlanError` for an unknown trainer or a precision it
    lacks (the graph is captured in one; no layout changes it)."""
    if trainer not in TRAINERS:
        raise PlanError(f"export: trainer: expected one of {list(TRAINERS)}, got {trainer!r}")
    if precision not in PRECISIONS[trainer]:
        raise PlanError(f"export: precision: {trainer} trains in {' or '.join(PRECISIONS[trainer])}, the plan is "
                        f"{precision}; expected --precision {PRECISIONS[trainer][-1]}")
    problems, notes = [], []
    run = replace(layout, order=None)
    if run.prop:
        problems.append("speed-proportional batch shares (prop=1)")
        run = replace(run, prop=0)
    if run.schedule not in SCHEDULES[trainer] or (run.schedule == "kfkb" and run.k > 1):
        problems.append(f"the {run.schedule} schedule ({trainer} runs {', '.join(SCHEDULES[trainer])})")
        run = replace(run, schedule="1f1b", k=1)
    run = _parallel_kinds(run, trainer, problems, notes)
    if batch % (run.dp * run.micro):
        problems.append(f"batch {batch} does not split into dp*micro = {run.dp}*{run.micro} equal micro-batches")
        fits = [m for m in MICRO_BATCHES if batch % (run.dp * m) == 0 and (m > 1 or run.pp == 1)]
        if not fits:
            return None, problems, notes
        run = replace(run, micro=min(fits, key=lambda m: (abs(m - run.micro), m)))
    return run, problems, notes


def kinds_note(layout: Layout, topology) -> str | None:
    """The line naming the first stage of ``layout`` whose devices are of different kinds (None:
    none is): a trainer runs it, each device on the same samples, as the layout's even shares say."""
    devs, width = layout_devices(layout, topology), layout.dp * layout.tp
    for s in range(layout.pp):
        kinds = sorted({topology.devices[d].gpu.name for d in devs[s * width:(s + 1) * width]})
        if len(kinds) > 1:
            return (f"stage {s} mixes {' and '.join(kinds)}: the trainer gives every device the same samples, "
                    "as even shares do")
    return None


def order_note(layout: Layout, topology) -> str | None:
    """The line saying which device each rank runs on, for a layout on devices other than all
    of the topology's in order (None otherwise): the launch must place rank ``r`` there."""
    if layout.order is None:
        return None
    devs = layout_devices(layout, topology)
    return (f"rank r runs on the r-th device of {spell_order(devs, topology)} ({len(devs)} of {topology.name}'s "
            f"{topology.num_devices} devices): launch the ranks so")


def _parallel_kinds(run: Layout, trainer: str, problems: list[str], notes: list[str]) -> Layout:
    """``run`` with the tensor-parallel and sharding variants ``trainer`` has (module docstring)."""
    zero, shard = zero_of(run), shard_of(run)
    if trainer == "torchtitan":
        if run.tp > 1 and not run.sp:
            notes.append("torchtitan's tensor parallelism is sequence parallel (Megatron-LM's --sequence-parallel)")
            run = replace(run, sp=1, vocab=0)
        if zero in (1, 2):
            problems.append(f"ZeRO stage {zero} (torchtitan shards parameters too: FSDP, ZeRO stage 3)")
            run = _sharded(run, 3, shard)
        elif not zero and run.dp > 1 and (run.pp > 1 or run.tp > 1):
            notes.append("torchtitan runs data parallelism beside tensor or pipeline parallelism only sharded "
                         "(FSDP; v0.2.2 parallelize.py: 'DDP has not supported > 1D parallelism')" +
                         ("" if run.tp == 1 and SHARDED else "; TAG costs it replicated"))
            run = _sharded(run, 3) if run.tp == 1 and SHARDED else run
    elif trainer == "megatron":
        if run.tp > 1 and not run.sp and not run.vocab:
            notes.append("Megatron-LM splits the embedding, LM head and loss over the tensor-parallel ranks (vocab=1)")
            run = replace(run, vocab=1)
        if shard:
            problems.append(f"hybrid sharding (hsdp={shard}x{run.dp // shard})")
            run = _sharded(run, zero, 0)
    else:  # deepspeed
        if run.sp or run.vocab:
            problems.append("sequence parallelism" if run.sp else "a vocabulary-parallel head (vocab=1)")
            run = replace(run, sp=0, vocab=0)
        if shard:
            problems.append(f"hybrid sharding (hsdp={shard}x{run.dp // shard})")
            run = _sharded(run, zero, 0)
        if zero_of(run) > 1 and run.pp > 1:
            problems.append(f"ZeRO stage {zero_of(run)} with pipeline parallelism (DeepSpeed's pipeline engine "
                            "runs stage 0 or 1)")
            run = _sharded(run, 1)
        if run.recompute and run.pp == 1:
            notes.append("DeepSpeed recomputes activations without a pipeline where the model calls "
                         "deepspeed.checkpointing.checkpoint")
        if run.pp > 1 and run.stages is not None and len(set(run.stages)) > 1:
            notes.append(f"DeepSpeed cuts stages in code: PipelineModule(num_stages={run.pp}, partition_method=...) "
                         f"holding layers {spell_stages(run.stages)}")
    return run


# ---- writing and reading each trainer's file ----------------------------------------------------
@dataclass(frozen=True)
class TrainerConfig:
    """What a trainer's configuration file states, read back (:func:`read_config`)."""

    layout: Layout
    batch: int
    """Global batch size (samples)."""
    precision: str
    """``fp32``, ``bf16`` or ``fp16``."""
    layers: int | None = None
    """Transformer layers the file states (None: it states none)."""


def write_config(trainer: str, layout: Layout, batch: int, precision: str, layers: int | None,
                 header: tuple[str, ...] = ()) -> str:
    """``trainer``'s configuration text for ``layout`` (a layout :func:`for_trainer` returned) at
    global batch ``batch``; ``layers``: the model's transformer layer count (None: unknown);
    ``header``: comment lines (torchtitan, Megatron-LM; JSON has none)."""
    b = batch // (layout.dp * layout.micro)  # samples per micro-batch per replica
    if trainer == "torchtitan":
        return _torchtitan(layout, batch, b, precision, layers, header)
    if trainer == "megatron":
        return _megatron(layout, batch, b, precision, layers, header)
    return _deepspeed(layout, batch, b, precision)


def _torchtitan(lay: Layout, batch: int, b: int, precision: str, layers: int | None, header) -> str:
    zero, shard = zero_of(lay), shard_of(lay)
    sharded = zero == 3 or (lay.dp > 1 and (lay.pp > 1 or lay.tp > 1))
    shard_deg = (shard or lay.dp) if sharded else 1
    out = [f"# {line}" for line in header]
    out += ["[training]", f"local_batch_size = {b * lay.micro if lay.pp > 1 else b}",
            f"global_batch_size = {batch}",
            f"mixed_precision_param = \"{'bfloat16' if precision == 'bf16' else 'float32'}\"",
            "mixed_precision_reduce = \"float32\"", "",
            "[parallelism]", f"data_parallel_replicate_degree = {lay.dp // shard_deg}",
            f"data_parallel_shard_degree = {shard_deg}", f"tensor_parallel_degree = {lay.tp}",
            f"pipeline_parallel_degree = {lay.pp}"]
    if lay.pp > 1:
        out += [f"pipeline_parallel_schedule = \"{SCHEDULES['torchtitan'][lay.schedule]}\"",
                f"pipeline_parallel_microbatch_size = {b}"]
        if lay.stages is not None:
            parts, first = [], 0
            for s, n in enumerate(lay.stages):
                names = (["tok_embeddings"] if s == 0 else []) + [f"layers.{i}" for i in range(first, first + n)] + \
                    (["norm", "output"] if s == lay.pp - 1 else [])
                parts.append("[" + ", ".join(f'"{x}"' for x in names) + "]")
                first += n
            out.append("module_fqns_per_model_part = [" + ", ".join(parts) + "]")
    out += ["", "[activation_checkpoint]", f"mode = \"{'full' if lay.recompute else 'none'}\"", ""]
    return "\n".join(out)


def _megatron(lay: Layout, batch: int, b: int, precision: str, layers: int | None, header) -> str:
    args = [("--tensor-model-parallel-size", lay.tp), ("--pipeline-model-parallel-size", lay.pp),
            ("--micro-batch-size", b), ("--global-batch-size", batch)]
    if layers is not None:
        args.append(("--num-layers", layers))
    if lay.pp > 1 and lay.stages is not None and len(set(lay.stages)) > 1:
        stages = "|".join(f"t*{n}" for n in lay.stages)
        args.append(("--pipeline-model-parallel-layout", f"E{stages}L"))
    if lay.sp:
        args.append(("--sequence-parallel", None))
    if lay.recompute:
        args += [("--recompute-granularity", "full"), ("--recompute-method", "uniform"), ("--recompute-num-layers", 1)]
    if precision != "fp32":
        args.append((f"--{precision}", None))
    zero = zero_of(lay)
    if zero:
        args.append(("--use-distributed-optimizer", None))
    if zero > 1:
        args += [("--use-megatron-fsdp", None),
                 ("--data-parallel-sharding-strategy", "optim_grads" if zero == 2 else "optim_grads_params"),
                 ("--ckpt-format", "fsdp_dtensor")]
    lines = [f"# {line}" for line in header]
    lines.append(f"# {WORLD_LINE}: {lay.devices} ranks (dp {lay.dp} x tp {lay.tp} x pp {lay.pp}): torchrun --nnodes x "
                 "--nproc-per-node")
    lines += [flag if value is None else f"{flag} {shlex.quote(str(value))}" for flag, value in args]
    return "\n".join(lines) + "\n"


def _deepspeed(lay: Layout, batch: int, b: int, precision: str) -> str:
    cfg: dict = {"train_batch_size": batch, "train_micro_batch_size_per_gpu": b,
                 "gradient_accumulation_steps": lay.micro, "zero_optimization": {"stage": zero_of(lay)}}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif precision == "fp16":
        cfg["fp16"] = {"enabled": True, "loss_scale": 0}
    if lay.tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": lay.tp}
    if lay.pp > 1 or lay.recompute:
        cfg["pipeline"] = {"stages": lay.pp, "activation_checkpoint_interval": lay.recompute}
    return json.dumps(cfg, indent=2) + "\n"


def read_config(trainer: str, text: str, *, source: str = "config") -> TrainerConfig:
    """The layout, batch and precision ``text`` (``trainer``'s file) states. One-line
    :class:`PlanError` naming ``source`` and the field for a value TAG cannot read back."""
    try:
        if trainer == "torchtitan":
            return _read_torchtitan(tomllib.loads(text), source)
        if trainer == "megatron":
            return _read_megatron(text, source)
        if trainer == "deepspeed":
            return _read_deepspeed(json.loads(text), source)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise PlanError(f"{source}: not {trainer}'s format: {str(e).splitlines()[0]}") from None
    except (KeyError, IndexError, TypeError, ValueError) as e:
        raise PlanError(f"{source}: {trainer}: a missing or malformed field ({type(e).__name__}: {e})") from None
    raise PlanError(f"export: trainer: expected one of {list(TRAINERS)}, got {trainer!r}")


def _micro(total: int, per: int, source: str, what: str) -> int:
    if per < 1 or total % per:
        raise PlanError(f"{source}: {what}: {total} samples do not split into micro-batches of {per}")
    return total // per


def _read_torchtitan(cfg: dict, source: str) -> TrainerConfig:
    par, tr = cfg["parallelism"], cfg["training"]
    rep, shard, tp, pp = (int(par.get(k, 1)) for k in ("data_parallel_replicate_degree", "data_parallel_shard_degree",
                                                       "tensor_parallel_degree", "pipeline_parallel_degree"))
    if shard < 1:
        raise PlanError(f"{source}: parallelism.data_parallel_shard_degree: {shard}; expected an explicit degree")
    dp, batch, local = rep * shard, int(tr["global_batch_size"]), int(tr["local_batch_size"])
    micro = _micro(local, int(par.get("pipeline_parallel_microbatch_size", 1)), source,
                   "parallelism.pipeline_parallel_microbatch_size") if pp > 1 else _micro(batch, local * dp, source,
                                                                                          "training.local_batch_size")
    names = {v: k for k, v in SCHEDULES["torchtitan"].items()}
    sched = par.get("pipeline_parallel_schedule", "1F1B")
    if sched not in names:
        raise PlanError(f"{source}: parallelism.pipeline_parallel_schedule: {sched!r}; expected one of {list(names)}")
    mode = cfg.get("activation_checkpoint", {}).get("mode", "selective")
    if mode not in ("full", "none"):
        raise PlanError(f"{source}: activation_checkpoint.mode: {mode!r}; expected 'full' or 'none'")
    parts = par.get("module_fqns_per_model_part")
    stages = tuple(sum(x.startswith("layers.") for x in p) for p in parts) if parts and pp > 1 else None
    lay = Layout(dp=dp, tp=tp, pp=pp, micro=micro, schedule=names[sched], sp=int(tp > 1), recompute=int(mode == "full"),
                 stages=stages)
    if shard > 1 and tp == 1 and SHARDED:  # FSDP (HSDP with replicas); beside tp: costed replicated
        lay = _sharded(lay, 3, shard if rep > 1 else 0)
    prec = {"bfloat16": "bf16", "float32": "fp32"}[tr.get("mixed_precision_param", "bfloat16")]
    return TrainerConfig(lay, batch, prec, sum(stages) if stages else None)


MEGATRON_FLAGS = {"--tensor-model-parallel-size": int, "--pipeline-model-parallel-size": int,
                  "--micro-batch-size": int, "--global-batch-size": int, "--num-layers": int,
                  "--pipeline-model-parallel-layout": str, "--sequence-parallel": None,
                  "--recompute-granularity": str, "--recompute-method": str, "--recompute-num-layers": int,
                  "--bf16": None, "--fp16": None, "--use-distributed-optimizer": None, "--use-megatron-fsdp": None,
                  "--data-parallel-sharding-strategy": str, "--ckpt-format": str}
"""The Megatron-LM flags :func:`write_config` writes and :func:`read_config` reads (None: a switch)."""

WORLD_LINE = "world size"
"""Header line of a Megatron-LM file stating its ranks (``# world size: 8 ranks (dp 2 x tp 2 x pp 2)``):
Megatron-LM takes the data-parallel size from the launch, so the file says what to launch."""


def _read_megatron(text: str, source: str) -> TrainerConfig:
    tokens = [t for line in text.splitlines() if not line.lstrip().startswith("#") for t in shlex.split(line)]
    args: dict[str, object] = {}
    i = 0
    while i < len(tokens):
        flag = tokens[i]
        if flag not in MEGATRON_FLAGS:
            raise PlanError(f"{source}: {flag}: not a Megatron-LM flag TAG reads; expected some of {list(MEGATRON_FLAGS)}")
        kind = MEGATRON_FLAGS[flag]
        args[flag] = True if kind is None else kind(tokens[i + 1])
        i += 1 if kind is None else 2
    tp, pp = args.get("--tensor-model-parallel-size", 1), args.get("--pipeline-model-parallel-size", 1)
    b, batch = args["--micro-batch-size"], args["--global-batch-size"]
    layers = args.get("--num-layers")
    stages = None
    if "--pipeline-model-parallel-layout" in args:
        text_ = str(args["--pipeline-model-parallel-layout"]).removeprefix("E").removesuffix("L")
        stages = tuple(int(s.removeprefix("t*")) for s in text_.split("|"))
    elif pp > 1 and layers is not None and layers % pp == 0:
        stages = (layers // pp,) * pp
    # Megatron-LM takes the data-parallel size from the launch (world / (tp * pp)): the header
    # states the world size (WORLD_LINE), as torchrun's --nnodes x --nproc-per-node must
    world = next((int(line.split(":", 1)[1].split()[0]) for line in text.splitlines()
                  if line.startswith(f"# {WORLD_LINE}:")), None)
    if world is None or world % (tp * pp):
        raise PlanError(f"{source}: '# {WORLD_LINE}: N': expected a header line stating the world size, a multiple "
                        f"of tp*pp = {tp * pp}")
    dp = world // (tp * pp)
    zero = 0 if "--use-distributed-optimizer" not in args else \
        {"optim_grads": 2, "optim_grads_params": 3}.get(str(args.get("--data-parallel-sharding-strategy")), 1) \
        if "--use-megatron-fsdp" in args else 1
    lay = Layout(dp=dp, tp=tp, pp=pp, micro=_micro(batch, b * dp, source, "--micro-batch-size"),
                 sp=int("--sequence-parallel" in args), recompute=int(args.get("--recompute-granularity") == "full"),
                 vocab=int(tp > 1 and "--sequence-parallel" not in args), stages=stages)
    return TrainerConfig(_sharded(lay, zero), batch, "bf16" if "--bf16" in args else "fp16" if "--fp16" in args
                         else "fp32", layers)


def _read_deepspeed(cfg: dict, source: str) -> TrainerConfig:
    batch, b, gas = (int(cfg[k]) for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                           "gradient_accumulation_steps"))
    if batch % (b * gas):
        raise PlanError(f"{source}: train_batch_size: {batch} is not train_micro_batch_size_per_gpu * "
                        f"gradient_accumulation_steps ({b} * {gas}) times a data-parallel size")
    pipe = cfg.get("pipeline", {})
    lay = Layout(dp=batch // (b * gas), tp=max(1, int(cfg.get("tensor_parallel", {}).get("autotp_size", 1))),
                 pp=int(pipe.get("stages", 1)), micro=gas, recompute=int(int(pipe.get("activation_checkpoint_interval", 0)) > 0))
    prec = "bf16" if cfg.get("bf16", {}).get("enabled") else "fp16" if cfg.get("fp16", {}).get("enabled") else "fp32"
    return TrainerConfig(_sharded(lay, int(cfg.get("zero_optimization", {}).get("stage", 0))), batch, prec)


@dataclass
class Export:
    """A plan exported to a trainer (:func:`tag.planner.export_plan`)."""

    trainer: str
    text: str
    """The configuration file's contents."""
    layout: Layout
    """The layout the trainer runs (:func:`for_trainer`)."""
    problems: list[str] = field(default_factory=list)
    """What of the plan the trainer cannot express, one line each (empty: the file is the plan)."""
    notes: list[str] = field(default_factory=list)
    """What the trainer runs otherwise than TAG's executor, expressed all the same."""
    plan_time_s: float | None = None
    """The plan's simulated iteration time (s)."""
    layout_time_s: float | None = None
    """The simulated iteration time (s) of :attr:`layout` (None: out of memory)."""

    @property
    def exact(self) -> bool:
        """True when the file states the plan itself."""
        return not self.problems

    def write(self, path) -> None:
        """Write :attr:`text` to ``path`` atomically."""
        write_atomic(path, self.text.encode())

    def lines(self) -> list[str]:
        """What ``tag plan --export`` prints: the first problem and the layout costed beside the
        plan, then the notes."""
        def ms(x):
            return "out of memory" if x is None else f"{x * 1e3:.3f} ms"
        head = (f"{self.trainer}: {spell(self.layout)}: {ms(self.layout_time_s)} simulated "
                f"(TAG's plan: {ms(self.plan_time_s)})")
        if self.problems:
            more = f" (and {len(self.problems) - 1} more)" if len(self.problems) > 1 else ""
            head = f"{self.trainer} cannot express this plan: {self.problems[0]}{more}; nearest layout " + \
                head.split(": ", 1)[1]
        return [head] + [f"  note: {n}" for n in self.notes]


__all__ = ["Export", "TRAINERS", "TrainerConfig", "for_trainer", "kinds_note", "order_note", "plan_layout", "read_config", "spell",
           "write_config"]
