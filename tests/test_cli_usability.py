"""Using the ``tag`` command line: fast start-up and --help, --version, defaults in every help,
suggestions, mismatch messages that say what differs, plurals, aligned tables in one unit system,
and stage progress on a terminal only (issue "Hardening", usability)."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tag.cli import COMMANDS, build_parser, main

ROOT = Path(__file__).resolve().parents[1]


def _subparsers():
    parser = build_parser()
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def test_help_loads_no_torch():
    """`tag --help` and every `tag COMMAND --help` import neither torch nor torch_geometric (they
    took ~6 s of every start-up): the import itself is what is checked, not a time."""
    code = ("import sys, contextlib, io\nfrom tag.cli import main, COMMANDS\n"
            "for argv in [['--help'], ['--version']] + [[c, '--help'] for c in COMMANDS]:\n"
            "    with contextlib.redirect_stdout(io.StringIO()):\n"
            "        assert main(argv) == 0, argv\n"
            "print(sorted(m for m in ('torch', 'torch_geometric', 'numpy', 'scipy') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_output_into_a_closed_pipe_is_quiet():
    """`tag topology show X | head -1`: the reader has gone before the output is written; the
    program stops with 128 + SIGPIPE and no traceback (it printed BrokenPipeError's)."""
    for argv in (["topology", "show", "tag-testbed"], ["inspect", "--list"]):
        p = subprocess.Popen([sys.executable, "-m", "tag", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
        p.stdout.close()  # the reader is gone before anything is written
        err = p.stderr.read().decode()
        assert p.wait(timeout=120) == 141 and err == "", (argv, err)


def test_version(capsys):
    import tomllib

    assert main(["--version"]) == 0
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert capsys.readouterr().out.strip() == f"tag {version}"


def test_every_option_with_a_default_shows_it():
    missing = []
    for name, p in _subparsers().items():
        fmt = p._get_formatter()
        for a in p._actions:
            if (not a.option_strings or a.nargs == 0 or a.default is None or a.default is False
                    or a.help == argparse.SUPPRESS):
                continue
            if "default" not in (fmt._get_help_string(a) if a.help else ""):
                missing.append(f"{name} {a.option_strings[0]}")
    assert not missing
    text = _subparsers()["execute"].format_help()
    assert re.search(r"--seed SEED\s+random seed for weights, inputs and every rank's\s+random stream "
                     r"\(dropout masks\) \(default: 0\)", text)
    assert "(default: True)" not in _subparsers()["plan"].format_help()  # flags state no value


def test_unknown_topology_names_the_shipped_ones(capsys):
    assert main(["topology", "show", "local-cpu"]) == 2
    line = capsys.readouterr().err.strip()
    assert "\n" not in line and "'local-cpu2'" in line and "'local-cpu4'" in line
    assert main(["topology", "show", "tag-testbd"]) == 2
    assert "did you mean 'tag-testbed'?" in capsys.readouterr().err
    # a shipped name is shown as its file is (README.md's `tag topology show tag-testbed`), and the
    # help says so
    assert main(["topology", "show", "tag-testbed"]) == 0
    assert capsys.readouterr().out.startswith("Topology 'tag-testbed': 7 machines, 16 devices")
    topology = _subparsers()["topology"]
    show = next(a for a in topology._actions if isinstance(a, argparse._SubParsersAction)).choices["show"]
    assert "shipped topology name" in show.format_help()


@pytest.fixture(scope="module")
def mlp_plan(captured):
    from tag.cost.baselines import data_parallel
    from tag.topology import load_topology

    topo = load_topology("local-cpu2")
    return data_parallel(captured("mlp", batch=8, groups=4).graph, topo), topo


@pytest.mark.parametrize("spec, batch, groups, field, needle", [
    ("mlp", 16, 4, "batch_size", "batch 8 in the plan, 16 given"),
    ("mlp", 8, 3, "groups", "4 op-groups in the plan, 3 given"),
    ("mlp", 16, 3, "batch_size", "batch 8 in the plan, 16 given, 4 op-groups in the plan, 3 given"),
    ("mlp:layers=2", 8, 4, "model", "model 'mlp' in the plan, 'mlp:layers=2' given"),
    ("mlp", 8, 4, "graph_signature", "another --optimizer"),
])
def test_plan_for_another_graph_says_what_differs(captured, mlp_plan, spec, batch, groups, field, needle):
    from tag.errors import PlanError

    plan, topo = mlp_plan
    graph = captured(spec, batch=batch, groups=groups, optimizer="sgd" if field == "graph_signature" else "adam").graph
    with pytest.raises(PlanError) as e:
        plan.validate(graph, topo, source="p.json")
    msg = str(e.value)
    assert msg.startswith(f"p.json: {field}: plan was made for another graph: ") and needle in msg, msg


def test_plurals_and_one_unit_system():
    from tag.topology import format_topology, load_topology
    from tag.topology.units import format_bandwidth, format_bytes, format_count

    assert format_count(1, "machine") == "1 machine" and format_count(2, "machine") == "2 machines"
    text = format_topology(load_topology({"name": "one", "machines": [{"name": "m", "gpu": "T4", "count": 1}]}))
    assert "1 machine, 1 device," in text
    # display sizes: binary prefixes with IEC names, whichever is shorter; rates: decimal
    assert format_bytes(16 * 10**9, digits=3) == "14.9 GiB" and format_bytes(603_000, digits=3) == "589 KiB"
    assert format_bytes(16 * 10**9) == "16 GB"  # exact text for files still round-trips
    assert format_bandwidth(900 * 2**30, digits=4) == "966.4 GB/s"


def test_inspect_table_is_aligned_in_one_unit_system(capsys):
    assert main(["inspect", "--model", "mlp", "--batch", "8", "--groups", "4"]) == 0
    out = capsys.readouterr().out
    assert not re.search(r"\d (KB|MB|GB|TB)\b", out), out  # never decimal sizes beside binary ones
    table = out[out.index("group "):].splitlines()
    header, rule, rows = table[0], table[1], table[2:]
    assert len(rows) == 4 and set(rule) <= {"-", " "}
    # right-aligned numeric columns: every row's params cell ends where the header's "params" ends
    end = header.index("params") + len("params")
    assert all(re.search(r"\d(\.\d+)? (B|KiB|MiB)$", r[:end]) for r in rows), rows


@contextlib.contextmanager
def _terminal_stderr():
    """sys.stderr on a pseudo-terminal (isatty() is true); yields a list that collects what was
    written to it, read by a thread so that the writer never blocks on a full pty buffer."""
    import pty

    master, slave = pty.openpty()  # reports a 0 x 0 window, as some terminals do: the bar still shows
    chunks: list[bytes] = []

    def read():
        with contextlib.suppress(OSError):
            while data := os.read(master, 4096):
                chunks.append(data)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    tty = open(slave, "w", buffering=1)  # noqa: SIM115 - closed below
    saved, sys.stderr = sys.stderr, tty
    text: list[str] = []
    try:
        yield text
    finally:
        sys.stderr = saved
        tty.close()
        reader.join(timeout=10)
        os.close(master)
        text.append(b"".join(chunks).decode(errors="replace"))


PLAN = ["plan", "--model", "mlp", "--batch", "8", "--groups", "2", "--topology", "local-cpu2", "--prior", "uniform",
        "--budget", "6"]


def test_plan_shows_stages_on_a_terminal_only(capsys):
    with _terminal_stderr() as seen:
        assert main(PLAN) == 0
    shown = seen[0]
    for stage in ("capture...", "baselines...", "search", "compression..."):
        assert stage in shown, shown
    assert re.search(r"search: .*\|", shown), shown  # the bar
    with _terminal_stderr() as seen:
        assert main([*PLAN, "--json"]) == 0
    assert seen[0] == ""
    capsys.readouterr()
    assert main(PLAN) == 0  # stderr captured by pytest: not a terminal
    assert capsys.readouterr().err == ""


def test_commands_listed_in_help():
    assert set(_subparsers()) == set(COMMANDS)


def test_validation_table_aligns_long_plan_names():
    """``tag validate``'s table: columns as wide as their widest cell, numbers right-aligned."""
    from tag.executor.validate import ValidationRow, summarize_rows

    rows = [ValidationRow("dp-even", 0.0105, 0.0110, []), ValidationRow("a-very-long-plan-name-indeed", 0.2, 0.19, [])]
    text = summarize_rows("mlp", "local-cpu2", rows, {}).table().splitlines()
    assert text[0].index("predicted ms") > len("a-very-long-plan-name-indeed")
    assert text[2].split() == ["dp-even", "10.50", "11.00", "4.5"] and text[3].endswith(" 5.3")
    assert len({len(line) for line in text[:4]}) == 1  # every row as wide as the header


def test_plan_says_how_to_run_it(tmp_path, capsys):
    """After `plan written to X`: the `tag execute` command that runs it (with the optimizer the
    plan was made for), and for a plan over several machines the --torchrun form (devices too small
    for the model on one: a two-stage pipeline); a plan on one machine of several runs locally."""
    import shlex

    out = tmp_path / "p.json"
    assert main([*PLAN, "--optimizer", "sgd", "--out", str(out)]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("run it: tag execute ") and "--torchrun" not in line, line
    argv = shlex.split(line.removeprefix("run it: tag "))
    assert argv[argv.index("--plan") + 1] == str(out) and argv[argv.index("--optimizer") + 1] == "sgd"
    two = tmp_path / "two.yaml"
    for memory, many in [("2.5 MiB", True), ("1 GiB", False)]:
        gpu = f"{{name: small, tflops: 8, memory: '{memory}', memory_bandwidth: '300 GB/s'}}"
        two.write_text(f"name: two\nmachines:\n  - {{name: a, gpu: {gpu}, count: 1}}\n"
                       f"  - {{name: b, gpu: {gpu}, count: 1}}\nnetwork: {{bandwidth: 10 Mbit/s}}\n")  # (slow: one machine pays where it fits)
        assert main(["plan", "--model", "mlp", "--batch", "8", "--groups", "2", "--topology", str(two), "--prior",
                     "uniform", "--budget", "6", "--out", str(tmp_path / "p2.json"), "--force"]) == 0
        line = capsys.readouterr().out.strip().splitlines()[-1]
        assert line.startswith("run it: ") and ("--run-dir DIR --torchrun HOST0:29500" in line) == many, line


def test_simulate_saves_the_layout_it_costs(tmp_path, capsys):
    """`tag simulate --layout ... --save-plan P`: the plan file `tag execute` runs (a hand-written
    layout could only be costed before, not run); the output rules hold for it."""
    import tag
    from tag.parallel import execution_refusal

    out = tmp_path / "lay.json"
    argv = ["simulate", "--model", "mlp", "--batch", "8", "--groups", "4", "--topology", "local-cpu2",
            "--layout", "pp=2,micro=2", "--save-plan", str(out)]
    assert main(argv) == 0
    assert f"plan written to {out}" in capsys.readouterr().out
    plan = tag.Plan.load(out)
    graph = tag.capture(tag.load_workload("mlp", batch=8), num_groups=4).graph
    topo = tag.load_topology("local-cpu2")
    assert plan.to_dict()["pipeline"] == tag.layout_plan(graph, topo, "pp=2,micro=2").to_dict()["pipeline"]
    assert execution_refusal(plan) is None and plan.predicted_iteration_time_s > 0
    assert main(argv) == 2 and "exists; pass --force" in capsys.readouterr().err
    assert main(["simulate", "--model", "mlp", "--batch", "8", "--groups", "4", "--topology", "local-cpu2",
                 "--plan", str(out), "--save-plan", str(out)]) == 2
    assert "is an input of this command" in capsys.readouterr().err
