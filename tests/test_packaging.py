"""The wheel installs one import name, ``tag``, with the data it reads at run time (the shipped
predictor and topologies); data/, docs/ and evaluation/ stay in the repository."""

from __future__ import annotations

import configparser
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_holds_only_tag_and_its_data(tmp_path):
    # Built from a copy, so the checkout gets no build/ or *.egg-info. Hidden folders (.git, .venv,
    # caches and .hypothesis, which other tests write to meanwhile), runs/ and results stay out.
    src = tmp_path / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "results")
    for entry in ROOT.iterdir():
        if entry.name.startswith(".") or entry.name in ("runs", "build") or entry.name.endswith(".egg-info"):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.copytree(entry, src / entry.name, ignore=ignore)
        else:
            shutil.copy(entry, src / entry.name, follow_symlinks=False)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    (wheel,) = (tmp_path / "dist").glob("tag_planner-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    dist_info = next(n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info"))
    assert {n.split("/")[0] for n in names} == {"tag", dist_info}
    top_level = zipfile.ZipFile(wheel).read(f"{dist_info}/top_level.txt").decode().split()
    assert top_level == ["tag"]
    # what tag reads from its own folder at run time
    assert "tag/gnn/predictor.pt" in names
    shipped = sorted(p.name for p in (ROOT / "tag" / "topology" / "shipped").glob("*.yaml"))
    assert shipped and all(f"tag/topology/shipped/{n}" in names for n in shipped)
    # every subpackage of the checkout is in the wheel (packages are found, not listed)
    packages = sorted(str(p.parent.relative_to(ROOT)) for p in (ROOT / "tag").rglob("__init__.py"))
    assert all(f"{p}/__init__.py" in names for p in packages)
    entry = configparser.ConfigParser()
    entry.read_string(zipfile.ZipFile(wheel).read(f"{dist_info}/entry_points.txt").decode())
    assert entry["console_scripts"]["tag"] == "tag.cli:entry"
