"""Plans as trainers' configurations (:mod:`tag.parallel.export`, ``tag plan --export``): each
exporter round-trips (the written file read back is the layout the trainer runs, whose plan is
rebuilt), every field written is one the trainer reads (names, types and choices recorded from
its source in tests/data/export/), and a plan a trainer cannot express is named with the nearest
layout it can, simulated beside the plan."""

from __future__ import annotations

import copy
import json
import tomllib
from dataclasses import replace
from pathlib import Path

import pytest

from tag.cli import main
from tag.cost.model import CostModel
from tag.errors import PlanError
from tag.parallel import validate_plan
from tag.parallel.export import SHARDED, TRAINERS, for_trainer, read_config, write_config
from tag.parallel.layout import Layout, align_groups, layout_plan, parse_layout
from tag.planner import export_plan
from tag.topology import load_topology

SPEC = "gpt2:n_layer=4,n_embd=64,n_head=4,vocab=100,seq=16"
SCHEMAS = Path(__file__).parent / "data" / "export"
EXACT = ["dp=8", "dp=2,tp=4", "dp=4,pp=2,micro=4,stages=2+2", "dp=2,tp=2,pp=2,micro=2,stages=2+2,recompute=1",
         "dp=2,pp=4,micro=4,stages=1+1+1+1", "dp=4,pp=2,micro=2,stages=3+1"] + \
    (["dp=8,zero=3", "dp=8,zero=1", "dp=4,pp=2,micro=2,zero=1,stages=2+2"] if SHARDED else [])
LACKS = {("torchtitan", 1): "ZeRO stage 1 (torchtitan shards parameters too: FSDP, ZeRO stage 3)"}
"""(trainer, ZeRO stage) -> what the trainer cannot express of a layout of EXACT."""


@pytest.fixture(scope="module")
def a100():
    return load_topology("homogeneous-8xa100")


@pytest.fixture(scope="module")
def aligned(captured, a100):
    """The graph regrouped so that op-groups start at every layer (stages=2+2 and 1+1+1+1 cut
    there, with and without tensor parallelism), and its cost model."""
    g = copy.deepcopy(captured(SPEC, batch=16, groups=16).graph)
    align_groups(g, Layout(dp=2, tp=2, pp=4, stages=(1, 1, 1, 1)))
    return g, CostModel.for_topology(g, a100)


def _kept(trainer: str, layout: Layout) -> Layout:
    """What a trainer's file states of the layout it runs (DeepSpeed cuts stages in code)."""
    return replace(layout, stages=None) if trainer == "deepspeed" else layout


@pytest.mark.parametrize("text", EXACT)
def test_each_exporter_round_trips(aligned, a100, text):
    graph, costs = aligned
    plan = layout_plan(graph, a100, parse_layout(text), costs)
    for trainer in TRAINERS:
        ex = export_plan(plan, graph, a100, trainer, costs=costs)
        lacks = LACKS.get((trainer, getattr(parse_layout(text), "zero", 0)))
        assert ex.problems == ([lacks] if lacks else []) and ex.exact == (lacks is None), (trainer, ex.problems)
        back = read_config(trainer, ex.text, source=trainer)
        assert back.layout == _kept(trainer, ex.layout) and back.batch == 16 and back.precision == "fp32"
        rebuilt = layout_plan(graph, a100, back.layout, costs)
        validate_plan(rebuilt, graph, a100, pipelines=True, tensor_parallel=True)
        if back.layout.stages is not None or back.layout.pp == 1:  # the trainer's own layout, group for group
            assert [g.key() for g in rebuilt.groups] == [g.key() for g in layout_plan(graph, a100, ex.layout, costs).groups]
        same = ex.layout == parse_layout(text)  # the trainer runs the plan itself
        if same:
            assert ex.layout_time_s == ex.plan_time_s
            if back.layout == ex.layout:
                assert [g.key() for g in rebuilt.groups] == [g.key() for g in plan.groups]
        else:  # what it runs otherwise (sequence parallel, vocabulary-parallel head, FSDP) is costed
            assert (ex.notes or ex.problems) and ex.layout_time_s is not None and ex.layout_time_s > 0


def test_megatron_runs_the_plans_without_tensor_parallelism_unchanged(aligned, a100):
    graph, costs = aligned
    for text in ("dp=8", "dp=4,pp=2,micro=4,stages=2+2", "dp=2,pp=4,micro=4,stages=1+1+1+1"):
        ex = export_plan(layout_plan(graph, a100, parse_layout(text), costs), graph, a100, "megatron", costs=costs)
        assert ex.layout == parse_layout(text) and not ex.notes


def test_written_fields_are_the_trainers(aligned, a100):
    """Every field is one the trainer's source reads, of its type (torchtitan's annotations,
    Megatron-LM's argparse actions and choices, DeepSpeed's keys and batch rule)."""
    graph, costs = aligned
    titan = json.loads((SCHEMAS / "torchtitan-v0.2.2.json").read_text())["sections"]
    flags = {}
    for line in (SCHEMAS / "megatron-flags.tsv").read_text().splitlines()[1:]:
        flag, action, _, choices = (line.split("\t") + [""])[:4]
        flags[flag] = (action, choices)
    ds = json.loads((SCHEMAS / "deepspeed-edaa722.json").read_text())["keys"]
    checked = set()
    for text in EXACT + ["dp=4,pp=2,micro=2,schedule=gpipe,stages=2+2"]:
        lay = parse_layout(text)
        for trainer in TRAINERS:
            run = for_trainer(lay, trainer, 16, "fp32")[0]
            for precision in ("fp32", "bf16") + (("fp16",) if trainer != "torchtitan" else ()):
                out = write_config(trainer, run, 16, precision, 4, ("header",))
                if trainer == "torchtitan":
                    for section, values in tomllib.loads(out).items():
                        for name, value in values.items():
                            _check_annotation(titan[section][name], value, f"{section}.{name}")
                            checked.add(f"torchtitan {section}.{name}")
                elif trainer == "megatron":
                    tokens = [t for line in out.splitlines() if not line.startswith("#") for t in line.split()]
                    for i, tok in enumerate(tokens):
                        if tok.startswith("--"):
                            action, choices = flags[tok]
                            has_value = i + 1 < len(tokens) and not tokens[i + 1].startswith("--")
                            assert has_value == (action == "_StoreAction"), (tok, action)
                            assert not choices or tokens[i + 1] in choices, (tok, choices)
                            checked.add(f"megatron {tok}")
                else:
                    cfg = json.loads(out)
                    for key, value in _flat(cfg):
                        assert key in ds and type(value).__name__ == ds[key][1], (key, value)
                        checked.add(f"deepspeed {key}")
                    assert cfg["train_batch_size"] == cfg["train_micro_batch_size_per_gpu"] * \
                        cfg["gradient_accumulation_steps"] * run.dp
    assert {"torchtitan parallelism.tensor_parallel_degree", "torchtitan parallelism.module_fqns_per_model_part",
            "megatron --pipeline-model-parallel-layout", "megatron --recompute-granularity", "megatron --bf16",
            "deepspeed tensor_parallel.autotp_size", "deepspeed fp16.loss_scale"} <= checked


def _flat(d: dict, prefix: str = ""):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _flat(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def _check_annotation(annotation: str, value, where: str) -> None:
    """``value`` is of torchtitan's field annotation (``int``, ``Literal['a', 'b']``, ``str``,
    ``list[...] | None``, ``float | int``)."""
    if annotation.startswith("Literal["):
        assert value in eval(annotation.removeprefix("Literal"))[0:], (where, value)  # the listed strings
    elif annotation.startswith("list"):
        assert isinstance(value, list), where
    else:
        kinds = {"int": int, "str": str, "float": float, "bool": bool}
        assert isinstance(value, tuple(kinds[a.strip()] for a in annotation.split("|") if a.strip() in kinds)), where


def test_inexpressible_plans_are_named_with_the_nearest_layout(aligned, a100):
    graph, costs = aligned
    plan = layout_plan(graph, a100, Layout(dp=8), costs)
    uneven = copy.deepcopy(plan)
    for g in uneven.groups:
        g.shares = [0.25, 0.25, 0.125, 0.125, 0.0625, 0.0625, 0.0625, 0.0625]
    placed = copy.deepcopy(plan)
    placed.groups[3] = replace(placed.groups[3], devices=[0, 1, 2, 3], shares=[0.25] * 4)
    for bad, feature in ((uneven, "uneven batch shares (0.250, 0.250, 0.125"),
                         (placed, "stage 0's op-groups run on 2 different device sets (per-group placement)")):
        validate_plan(bad, graph, a100)
        ex = export_plan(bad, graph, a100, "megatron", costs=costs)
        assert ex.problems[0].startswith(feature) and not ex.exact
        assert ex.layout == Layout(dp=8)  # the plan's degrees, even and uniform
        assert ex.plan_time_s > 0 and ex.layout_time_s > 0 and ex.plan_time_s != ex.layout_time_s
        assert ex.lines()[0].startswith(f"megatron cannot express this plan: {feature}")
        assert read_config("megatron", ex.text).layout == Layout(dp=8)
        assert f"# not expressed: {feature}" in ex.text


def test_a_stage_cut_inside_a_layer_moves_to_the_nearest_layer(captured, a100):
    graph = captured(SPEC, batch=16, groups=16).graph
    costs = CostModel.for_topology(graph, a100)
    plan = layout_plan(graph, a100, parse_layout("dp=2,pp=4,micro=4"), costs)  # stages from groups 0, 2, 7, 12
    ex = export_plan(plan, graph, a100, "torchtitan", costs=costs)
    assert ex.problems[0] == "stage 1 begins inside a layer (op-group 2); trainers cut stages between layers"
    assert ex.layout.stages is not None and sum(ex.layout.stages) == 4 and ex.layout_time_s > 0
    assert read_config("torchtitan", ex.text).layout == ex.layout


def test_schedules_and_precisions_a_trainer_lacks():
    gpipe = parse_layout("dp=4,pp=2,micro=2,schedule=gpipe")
    assert for_trainer(gpipe, "torchtitan", 16, "bf16")[1] == []
    run, problems, _ = for_trainer(gpipe, "megatron", 16, "bf16")
    assert problems == ["the gpipe schedule (megatron runs 1f1b)"] and run.schedule == "1f1b"
    run, problems, _ = for_trainer(parse_layout("dp=8,micro=1"), "deepspeed", 12, "fp32")
    assert problems == ["batch 12 does not split into dp*micro = 8*1 equal micro-batches"] and run is None
    with pytest.raises(PlanError, match=r"^export: precision: torchtitan trains in fp32 or bf16, the plan is fp16"):
        for_trainer(gpipe, "torchtitan", 16, "fp16")
    for trainer in TRAINERS:
        for precision in ("fp32", "bf16"):
            text = write_config(trainer, for_trainer(gpipe, trainer, 16, precision)[0], 16, precision, 4)
            assert read_config(trainer, text).precision == precision


def test_unreadable_files_are_one_line(tmp_path):
    for trainer, text, message in (
            ("megatron", "--tensor-model-parallel-size 2\n--foo 1\n", r"^f: --foo: not a Megatron-LM flag TAG reads"),
            ("megatron", "--micro-batch-size 1\n--global-batch-size 8\n", r"^f: '# world size: N': expected"),
            ("deepspeed", "{\"train_batch_size\": 10, \"train_micro_batch_size_per_gpu\": 3, "
                          "\"gradient_accumulation_steps\": 1}", r"^f: train_batch_size: 10 is not"),
            ("deepspeed", "{", r"^f: not deepspeed's format"),
            ("torchtitan", "[parallelism]\n[training]\nlocal_batch_size = 2\n", r"^f: torchtitan: a missing or malformed")):
        with pytest.raises(PlanError, match=message) as e:
            read_config(trainer, text, source="f")
        assert "\n" not in str(e.value)


def test_tag_plan_export(tmp_path, capsys):
    out = tmp_path / "args.txt"
    assert main(["plan", "--model", "gpt2:n_layer=2,n_embd=64,n_head=4,vocab=100,seq=16", "--batch", "8",
                 "--topology", "local-cpu2", "--budget", "2", "--pipelines", "off", "--compression", "off",
                 "--export", "megatron", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"megatron configuration written to {out}" in printed
    back = read_config("megatron", out.read_text())
    assert back.batch == 8 and back.layout.devices == 2
    assert main(["plan", "--model", "mlp", "--topology", "local-cpu2", "--export", "slurm", str(tmp_path / "x")]) == 2
    assert "--export: 'slurm': expected a trainer, one of torchtitan, megatron, deepspeed" in capsys.readouterr().err


def test_a_plan_of_no_layer_shape_gets_the_fastest_layout_the_trainer_runs(captured, a100):
    """Eight stages of a four-layer model: no layer cut holds them, so the nearest layout is the
    grid's fastest one the trainer runs (stages between layers)."""
    graph = captured(SPEC, batch=16, groups=16).graph
    costs = CostModel.for_topology(graph, a100)
    plan = layout_plan(graph, a100, parse_layout("dp=1,pp=8,micro=4"), costs)
    ex = export_plan(plan, graph, a100, "megatron", costs=costs)
    assert ex.problems[-1] == "no layout of the plan's own degrees runs on megatron"
    assert ex.layout.devices == 8 and ex.layout.pp <= 4 and ex.layout_time_s < ex.plan_time_s
    assert read_config("megatron", ex.text).layout == ex.layout


def test_a_layout_on_some_devices_says_where_ranks_run(aligned, a100):
    graph, costs = aligned
    ex = export_plan(layout_plan(graph, a100, parse_layout("dp=4,order=dgx:4-7"), costs), graph, a100, "deepspeed",
                     costs=costs)
    assert ex.exact and ex.layout == Layout(dp=4) and ex.layout_time_s == ex.plan_time_s
    assert ex.notes == ["rank r runs on the r-th device of dgx:4-7 (4 of homogeneous-8xa100's 8 devices): "
                        "launch the ranks so"]


def test_mixed_gpu_kinds_export_with_even_samples(aligned):
    """A stage of two GPU kinds with even shares is what the trainers run (a note says so), and so
    are speed-proportional shares that round to the same samples per device (A100 and V100 on
    this small model: 2 of the 16 samples each)."""
    graph, _ = aligned
    mixed = load_topology("mixed-a100-v100")
    costs = CostModel.for_topology(graph, mixed)
    even = export_plan(layout_plan(graph, mixed, Layout(dp=8), costs), graph, mixed, "deepspeed", costs=costs)
    assert even.exact and even.notes == ["stage 0 mixes A100-40GB and V100-SXM2-16GB: the trainer gives every "
                                         "device the same samples, as even shares do"]
    prop_plan = layout_plan(graph, mixed, Layout(dp=8, prop=1), costs)
    assert len({round(x, 9) for x in prop_plan.groups[0].shares}) > 1  # not even shares, even samples
    prop = export_plan(prop_plan, graph, mixed, "deepspeed", costs=costs)
    assert prop.exact and prop.layout == Layout(dp=8) and prop.notes == even.notes


def test_tag_simulate_exports_a_layout(tmp_path, capsys):
    out = tmp_path / "ds.json"
    assert main(["simulate", "--model", "gpt2:n_layer=2,n_embd=64,n_head=4,vocab=100,seq=16", "--batch", "8",
                 "--topology", "homogeneous-8xa100", "--layout", "dp=4,tp=2", "--export", "deepspeed", str(out),
                 "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    summary = printed["export"]
    assert summary["exact"] and summary["layout"] == "dp=4,tp=2,pp=1,micro=1"
    assert summary["layout_time_s"] == summary["plan_time_s"] == printed["iteration_time_s"] > 0  # the layout simulated
    assert read_config("deepspeed", out.read_text()).layout == Layout(dp=4, tp=2)
