"""Typed, validated configuration of predictor training (saved resolved in every run folder)."""

from __future__ import annotations

import types
import typing
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..data.dataset import PolicyTarget
from ..data.generate import GenConfig
from ..errors import TagError
from ..gnn.model import NetConfig
from ..io import output_dir, read_json

RECIPE_GEN = {"large_fraction": 0.25, "label_children": 8, "large_inputs": "full"}
"""Labelling of the shipped predictor (2026-11-27, evaluation/results/planner-bench-mix/ at 167c2e8): a
quarter of the pairs at scale, their models at published input sizes (512 tokens, 224x224 images),
every action of the 8 labelled decisions simulated."""
RECIPE_COARSE_ABOVE = 32
"""Encoding of the shipped predictor: clusters above 32 devices (every pair at scale) on the machine
graph (:data:`tag.gnn.features.COARSE_ABOVE` stays the threshold of checkpoints that record none)."""


class ConfigError(TagError):
    """A training configuration value is invalid."""


@dataclass
class TrainConfig:
    """Supervised fitting of the network to MCTS labels."""

    epochs: int = 6
    """Epochs per round."""
    lr: float = 2e-3
    """AdamW learning rate."""
    weight_decay: float = 1e-4
    """AdamW weight decay."""
    batch_size: int = 32
    """Decisions per minibatch."""
    value_weight: float = 0.5
    """Weight of the value regression loss relative to the policy cross-entropy."""
    val_fraction: float = 0.1
    """Fraction of decisions held out for validation."""
    grad_clip: float = 1.0
    """Gradient-norm clip."""
    seed: int = 0
    """Seed of initialisation, shuffling and the split."""
    max_steps: int | None = None
    """Stop after this many optimiser steps in total (tests); None = all epochs."""

    def __post_init__(self):
        _check(self.epochs >= 1, "train.epochs", self.epochs, ">= 1")
        _check(self.lr > 0, "train.lr", self.lr, "> 0")
        _check(self.weight_decay >= 0, "train.weight_decay", self.weight_decay, ">= 0")
        _check(self.batch_size >= 1, "train.batch_size", self.batch_size, ">= 1")
        _check(self.value_weight >= 0, "train.value_weight", self.value_weight, ">= 0")
        _check(0 <= self.val_fraction < 1, "train.val_fraction", self.val_fraction, "in [0, 1)")
        _check(self.grad_clip > 0, "train.grad_clip", self.grad_clip, "> 0")
        _check(self.seed >= 0, "train.seed", self.seed, ">= 0")
        _check(self.max_steps is None or self.max_steps >= 1, "train.max_steps", self.max_steps, ">= 1 or null")


@dataclass
class LoopConfig:
    """The AlphaZero-style loop: generate -> train -> regenerate with the new network."""

    run_dir: str = field(default_factory=lambda: str(output_dir("runs/predictor")))
    """Run folder: data, checkpoints, config, logs (default ``runs/predictor`` in the checkout, or in
    the user's data folder for an installed package: :func:`tag.io.output_dir`)."""
    rounds: int = 3
    """Generate/train rounds; round 0 is labelled by uniform-prior MCTS (bootstrap). The shipped
    predictor is the third round's network (a fourth, measured 2026-11-27, was worse on the small
    held-out pairs: evaluation/results/planner-bench-mix/ at 167c2e8)."""
    samples_per_round: list[int] = field(default_factory=lambda: [240, 80])
    """Pairs labelled in each round (the last value repeats for later rounds)."""
    net: NetConfig = field(default_factory=NetConfig)
    """Network shape."""
    gen: GenConfig = field(default_factory=lambda: GenConfig(**RECIPE_GEN))
    """Labelling (``gen.samples`` is overridden per round); default :class:`GenConfig`'s with
    :data:`RECIPE_GEN`. A ``gen`` object in a config file is a whole :class:`GenConfig`: the fields
    it leaves out take :class:`GenConfig`'s defaults (so a run folder's ``config.json`` of before a
    field existed resumes as it was labelled)."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Fitting."""
    target: PolicyTarget = field(default_factory=PolicyTarget)
    """How the policy targets are made from the labelling searches."""
    wandb: str = "offline"
    """``offline`` (default; logs under ``run_dir/wandb``), ``online`` or ``disabled``."""
    project: str = "tag-predictor"
    """wandb project."""
    export: str | None = None
    """Copy the final checkpoint here (e.g. ``tag/gnn/predictor.pt``)."""
    coarse_above: int = RECIPE_COARSE_ABOVE
    """Clusters of more devices are encoded with one device node per machine in training and, as
    the checkpoint records it (``meta["coarse_above"]``), by the predictor."""
    plan_head: bool = True
    """After the last round, fit the network's plan head (its prior over plan-level pipeline
    decisions) on every round's labelled pairs (:mod:`tag.training.plan_head`); False leaves
    those decisions to the search's fixed prior. Once, not after every round: the labelling
    searches have no plan-level decisions (:func:`tag.data.generate.label_pair`), so a head fitted
    after round r would change none of round r+1's labels nor its training (measured 2026-11-27:
    ``evaluation/results/planner-bench-planhead/README.md at 6262d00``)."""

    def __post_init__(self):
        _check(self.rounds >= 1, "rounds", self.rounds, ">= 1")
        _check(bool(self.samples_per_round) and all(s >= 1 for s in self.samples_per_round),
               "samples_per_round", self.samples_per_round, "a non-empty list of positive integers")
        _check(isinstance(self.coarse_above, int) and self.coarse_above >= 1, "coarse_above", self.coarse_above,
               "a positive integer")
        _check(self.wandb in ("offline", "online", "disabled"), "wandb", self.wandb,
               "one of offline, online, disabled")

    def samples(self, r: int) -> int:
        s = self.samples_per_round
        return s[min(r, len(s) - 1)]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict, *, source: str = "config") -> LoopConfig:
        """The config of ``d`` (a ``config.json``'s object); :class:`ConfigError`, one line
        starting with ``source``, for an unknown field, a value of the wrong JSON type or out of
        range."""
        if not isinstance(d, dict):
            raise ConfigError(f"{source}: expected a JSON object of LoopConfig fields, got {_json_kind(d)}")
        kw = dict(d)
        try:
            _check_fields(cls, d, "")
            for key, typ in (("net", NetConfig), ("gen", GenConfig), ("train", TrainConfig),
                             ("target", PolicyTarget)):
                if key in kw:
                    if not isinstance(kw[key], dict):
                        raise ConfigError(f"{key}: expected a JSON object of {typ.__name__} fields, "
                                          f"got {_json_kind(kw[key])}")
                    _check_fields(typ, kw[key], f"{key}.")
                    kw[key] = typ(**kw[key])
            return cls(**kw)
        except (ValueError, ConfigError) as e:
            raise ConfigError(f"{source}: {e}") from None

    def save(self, path) -> None:
        from ..io import write_json
        write_json(path, self.to_dict())

    def changed_from(self, started: LoopConfig) -> list[tuple[str, object, object]]:
        """``(dotted field name, started's value, this one's)`` where this config differs from
        ``started`` (the config a run folder was started with) in what the run computes: every
        field but :data:`RESUME_FREE`."""
        old, new = _flat(started.to_dict()), _flat(self.to_dict())
        return [(k, old.get(k), v) for k, v in new.items() if k not in RESUME_FREE and old.get(k, _MISSING) != v]

    @classmethod
    def load(cls, path) -> LoopConfig:
        p = Path(path)
        d = read_json(p, ConfigError, "config")
        return cls.from_dict(d, source=str(p))


RESUME_FREE = frozenset({"run_dir", "rounds", "wandb", "project", "export", "plan_head", "gen.workers"})
"""Fields a run may be resumed under changed: where the run folder is, how many rounds it goes to,
logging, the copy of the final checkpoint, whether the plan head is fitted after the last round,
and the number of labelling processes (each pair is labelled by its own seed, whoever labels it).
Any other change would mix rounds made under different settings in one run."""

_MISSING = object()


def _flat(d: dict, prefix: str = "") -> dict:
    """``{"gen": {"seed": 0}} -> {"gen.seed": 0}``."""
    out: dict = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _check(ok: bool, name: str, value, expected: str) -> None:
    if not ok:
        raise ConfigError(f"{name}: expected {expected}, got {value!r}")


def _check_fields(cls, d: dict, prefix: str) -> None:
    """ConfigError unless every key of ``d`` is a field of dataclass ``cls`` whose value has the
    field's JSON type (an integer for ``int``, a number for ``float``, never ``true``/``false``
    for either; a nested config is checked by its own class)."""
    hints = typing.get_type_hints(cls)
    for k, v in d.items():
        if k not in hints:
            raise ConfigError(f"{prefix}{k}: unknown field; expected one of {sorted(hints)}")
        hint = hints[k]
        if isinstance(hint, type) and hasattr(hint, "__dataclass_fields__"):
            continue
        if not _conforms(v, hint):
            raise ConfigError(f"{prefix}{k}: expected {_spell(hint)}, got {_json_kind(v)} {v!r}"[:300])


def _conforms(value, hint) -> bool:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(_conforms(value, h) for h in typing.get_args(hint))
    if typing.get_origin(hint) is list:
        return isinstance(value, list) and all(_conforms(v, typing.get_args(hint)[0]) for v in value)
    if hint is type(None):
        return value is None
    if hint in (int, float) and isinstance(value, bool):
        return False
    return isinstance(value, (int, float) if hint is float else hint)


def _spell(hint) -> str:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_spell(h) for h in typing.get_args(hint))
    if typing.get_origin(hint) is list:
        return f"a list of {_spell(typing.get_args(hint)[0]).split(' ', 1)[1]}s"
    return {int: "an integer", float: "a number", str: "a string", bool: "a boolean",
            type(None): "null"}.get(hint, str(hint))


def _json_kind(value) -> str:
    """The JSON name of ``value``'s type (``null``, ``boolean``, ``string``, ``list``, ...)."""
    return {type(None): "null", bool: "boolean", int: "integer", float: "number", str: "string",
            list: "list", dict: "object"}.get(type(value), type(value).__name__)
