"""The ``tag`` command line: help, JSON output, and one-line errors with exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tag.cli import COMMANDS, build_parser


def tag(*args: str, check: bool = False) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tag", *args], capture_output=True, text=True, check=check,
                          env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})


def test_every_command_has_help():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert set(sub.choices) <= set(COMMANDS)
    assert {"inspect", "topology"} <= set(sub.choices)
    for name, p in sub.choices.items():
        assert p.format_help().strip(), name
    r = tag("--help")
    assert r.returncode == 0 and "inspect" in r.stdout


def test_train_help_states_the_config_defaults():
    """`tag train --help` repeats LoopConfig's defaults by hand (importing tag.training.config would
    load torch_geometric on every command's start-up); they must not drift apart."""
    from tag.training.config import LoopConfig
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    helps = {a.dest: a.help for a in sub.choices["train"]._actions}
    cfg = LoopConfig()
    # run_dir: runs/predictor of the checkout (tests run from one), or of the user's data folder
    assert cfg.run_dir.endswith("runs/predictor") and "runs/predictor" in helps["run_dir"]
    stated = {"rounds": cfg.rounds, "epochs": cfg.train.epochs,
              "workers": cfg.gen.workers, "playouts": cfg.gen.playouts_per_step, "seed": cfg.gen.seed,
              "samples": " ".join(map(str, cfg.samples_per_round)), "wandb": cfg.wandb,
              "large_fraction": cfg.gen.large_fraction, "label_children": cfg.gen.label_children,
              "large_inputs": cfg.gen.large_inputs,
              "coarse_above": cfg.coarse_above}
    for dest, value in stated.items():
        assert f"default {value}" in helps[dest], (dest, helps[dest])


def test_inspect_json():
    r = tag("inspect", "--model", "mlp", "--batch", "16", "--groups", "3", "--json", check=True)
    s = json.loads(r.stdout)
    for key in ("num_ops", "num_groups", "flops_fwd_bwd", "param_bytes"):
        assert key in s
    assert s["num_groups"] == 3 and s["batch_size"] == 16 and s["flops_fwd_bwd"] > 0 and s["precision"] == "fp32"
    r = tag("inspect", "--model", "mlp", "--batch", "16", "--groups", "3", "--precision", "bf16", check=True)
    assert "(batch 16, bf16, optimizer adam)" in r.stdout.splitlines()[0]  # the header says what was captured


def test_topology_show():
    r = tag("topology", "show", "topologies/tag-testbed.yaml", check=True)
    assert "V100" in r.stdout and "22.4 Gbit/s" in r.stdout


@pytest.mark.parametrize("args, needle", [
    (["inspect", "--model", "gtp2"], "did you mean gpt2"),
    (["inspect", "--model", "no_such_pkg.mod:make"], "no_such_pkg"),
    (["inspect", "--model", "mlp:layers=-1"], "layers"),
    (["inspect", "--model", "mlp", "--batch", "0"], "--batch"),
    (["topology", "show", "no/such/file.yaml"], "no/such/file.yaml"),
])
def test_bad_input_is_one_line(args, needle):
    r = tag(*args)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert needle in lines[0]
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("text, field", [
    ("name: x\nmachines: []\nnetwork: {bandwidth: 1 GB/s}\n", "machines"),
    ("name: x\nmachines: [{name: a, gpu: V100-SXM2-16GB, count: 0}]\n", "count"),
    ("name: x\nmachines: [{name: a, gpu: V100-SXM2-16GB, count: 2, intra_bandwidth: 10 GB/z}]\n", "intra_bandwidth"),
    ("name: x\nmachines: [{name: a, gpu: V100-SXM2-16GB, count: 1}, {name: a, gpu: T4, count: 1}]\n"
     "network: {bandwidth: 1 GB/s}\n", "name"),
])
def test_bad_topology_file(tmp_path, text, field):
    path = tmp_path / "topo.yaml"
    path.write_text(text)
    r = tag("topology", "show", str(path))
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "topo.yaml" in lines[0] and field in lines[0], r.stderr


def test_debug_shows_traceback():
    r = tag("--debug", "inspect", "--model", "gtp2")
    assert r.returncode != 0 and "Traceback" in r.stderr


@pytest.mark.parametrize("argv, code", [(["--version"], 0), (["inspect", "--model", "gtp2"], 2)])
def test_entry_is_main_then_freezes_the_objects(argv, code, monkeypatch, capsys):
    """``python -m tag`` and the installed script run tag.cli.entry: main's exit code, and the
    objects frozen so that the collection at interpreter exit skips them."""
    import gc

    from tag.cli import entry

    monkeypatch.setattr(sys, "argv", ["tag", *argv])
    assert gc.get_freeze_count() == 0
    try:
        assert entry() == code
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
    assert ("error" in capsys.readouterr().err) == (code == 2)
