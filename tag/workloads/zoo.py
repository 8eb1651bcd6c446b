"""Built-in workloads: small, randomly initialised models addressed as ``name[:key=value,...]``.

All zoo models have dropout disabled, are built offline from configs (no weight downloads), are
deterministic given a seed, and are wrapped in :class:`LossWrapper` (parameters ``model.<...>``).
Transformers use the eager attention implementation. Defaults are tiny (a CPU forward+backward
at the default batch takes well under a second); scale them up with overrides.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from tag.errors import WorkloadError
from tag.workloads.factory import LossWrapper
from tag.workloads.vision import MLP, NORMS, RESNET_LAYOUTS, VGG, VGG_LAYOUTS, ResNet

Value = int | float | bool | str
#: ``sample(batch, generator) -> inputs`` draws a batch of random inputs.
Sampler = Callable[[int, torch.Generator], tuple]
Builder = Callable[[Mapping[str, Value]], tuple[nn.Module, Sampler]]


@dataclass(frozen=True)
class ZooEntry:
    """One zoo model: default config (override keys and their types), default batch, builder.

    ``build(cfg)`` validates ``cfg`` (raising ValueError with a one-line reason) and returns the
    loss-returning model and a sampler of random inputs for a given batch size.
    """

    name: str
    description: str
    defaults: Mapping[str, Value]
    batch: int
    build: Builder
    choices: Mapping[str, tuple[Value, ...]] = field(default_factory=lambda: MappingProxyType({}))

    def summary(self) -> str:
        """One line: description, default overrides and default batch."""
        opts = ",".join(f"{k}={_fmt(v)}" for k, v in self.defaults.items())
        return f"{self.description}; defaults {opts}; batch {self.batch}"


def _fmt(v: Value) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _positive(cfg: Mapping[str, Value], *keys: str) -> None:
    for k in keys:
        _require(cfg[k] > 0, f"{k} must be > 0, got {cfg[k]}")


def _tokens(vocab: int, seq: int) -> Sampler:
    """Sampler of (input_ids [B, seq], labels [B, seq]) int64 uniform in [0, vocab)."""
    def sample(b: int, g: torch.Generator) -> tuple:
        ids = torch.randint(0, vocab, (b, seq), generator=g)
        return ids, torch.randint(0, vocab, (b, seq), generator=g)
    return sample


def _images(image: int, classes: int) -> Sampler:
    """Sampler of (images [B, 3, image, image] float32 N(0,1), labels [B] int64 in [0, classes))."""
    def sample(b: int, g: torch.Generator) -> tuple:
        x = torch.randn(b, 3, image, image, generator=g)
        return x, torch.randint(0, classes, (b,), generator=g)
    return sample


def _transformer_checks(cfg: Mapping[str, Value]) -> None:
    _positive(cfg, *(k for k in ("n_layer", "n_embd", "n_head", "vocab", "seq", "image", "patch", "classes")
                     if k in cfg))
    _require(cfg["n_embd"] % cfg["n_head"] == 0,
             f"n_embd ({cfg['n_embd']}) must be divisible by n_head ({cfg['n_head']})")


def _hf() -> Any:
    """Import transformers lazily, offline (no hub access for configs or weights)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers
    return transformers


def _build_gpt2(cfg: Mapping[str, Value]) -> tuple[nn.Module, Sampler]:
    _transformer_checks(cfg)
    hf = _hf()
    v = cfg["vocab"]
    conf = hf.GPT2Config(
        vocab_size=v, n_positions=cfg["seq"], n_embd=cfg["n_embd"], n_layer=cfg["n_layer"],
        n_head=cfg["n_head"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        summary_first_dropout=0.0, bos_token_id=v - 1, eos_token_id=v - 1, pad_token_id=v - 1,
        use_cache=False, attn_implementation="eager",
    )
    lm = hf.GPT2LMHeadModel(conf)
    lm.loss_type = "ForCausalLM"  # the class name does not match HF's loss registry; avoids a warning
    model = LossWrapper(lm, ("input_ids", "labels"), {"use_cache": False})
    return model, _tokens(v, cfg["seq"])


def _build_bert(cfg: Mapping[str, Value]) -> tuple[nn.Module, Sampler]:
    _transformer_checks(cfg)
    hf = _hf()
    v = cfg["vocab"]
    conf = hf.BertConfig(
        vocab_size=v, hidden_size=cfg["n_embd"], num_hidden_layers=cfg["n_layer"],
        num_attention_heads=cfg["n_head"], intermediate_size=4 * cfg["n_embd"],
        max_position_embeddings=cfg["seq"], hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        pad_token_id=0, bos_token_id=None, eos_token_id=None, attn_implementation="eager",
    )
    model = LossWrapper(hf.BertForMaskedLM(conf), ("input_ids", "labels"))
    return model, _tokens(v, cfg["seq"])


def _build_vit(cfg: Mapping[str, Value]) -> tuple[nn.Module, Sampler]:
    _transformer_checks(cfg)
    _require(cfg["image"] % cfg["patch"] == 0,
             f"image ({cfg['image']}) must be divisible by patch ({cfg['patch']})")
    hf = _hf()
    conf = hf.ViTConfig(
        image_size=cfg["image"], patch_size=cfg["patch"], num_channels=3, hidden_size=cfg["n_embd"],
        num_hidden_layers=cfg["n_layer"], num_attention_heads=cfg["n_head"],
        intermediate_size=4 * cfg["n_embd"], hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        num_labels=cfg["classes"], problem_type="single_label_classification",
        attn_implementation="eager",
    )
    model = LossWrapper(hf.ViTForImageClassification(conf), ("pixel_values", "labels"))
    return model, _images(cfg["image"], cfg["classes"])


def _build_mlp(cfg: Mapping[str, Value]) -> tuple[nn.Module, Sampler]:
    _positive(cfg, "hidden", "in_dim", "classes")
    _require(cfg["layers"] >= 0, f"layers must be >= 0, got {cfg['layers']}")
    d, c = cfg["in_dim"], cfg["classes"]

    def sample(b: int, g: torch.Generator) -> tuple:
        return torch.randn(b, d, generator=g), torch.randint(0, c, (b,), generator=g)

    return LossWrapper(MLP(d, cfg["hidden"], cfg["layers"], c)), sample


def _build_resnet(cfg: Mapping[str, Value]) -> tuple[nn.Module, Sampler]:
    _require(cfg["depth"] in RESNET_LAYOUTS,
             f"depth must be one of {sorted(RESNET_LAYOUTS)}, got {cfg['depth']}")
    _positive(cfg, "width", "classes")
    _require(cfg["image"] >= 8, f"image must be >= 8, got {cfg['image']}")
    net = ResNet(cfg["depth"], cfg["width"], cfg["image"], cfg["classes"], cfg["norm"])
    return LossWrapper(net), _images(cfg["image"], cfg["classes"])


def _build_vgg(cfg: Mapping[str, Value]) -> tuple[nn.Module, Sampler]:
    _require(cfg["depth"] in VGG_LAYOUTS, f"depth must be one of {sorted(VGG_LAYOUTS)}, got {cfg['depth']}")
    _positive(cfg, "width", "classes", "hidden", "image")
    _require(cfg["image"] % 32 == 0, f"image must be a multiple of 32, got {cfg['image']}")
    net = VGG(cfg["depth"], cfg["width"], cfg["image"], cfg["classes"], cfg["hidden"], cfg["bn"])
    return LossWrapper(net), _images(cfg["image"], cfg["classes"])


def zoo_entries() -> dict[str, ZooEntry]:
    """A fresh ``name -> ZooEntry`` table of all built-in workloads."""
    mp = MappingProxyType
    entries = [
        ZooEntry("mlp", "MLP classifier (cross-entropy on random features)",
                 mp({"layers": 3, "hidden": 256, "in_dim": 64, "classes": 10}), 32, _build_mlp),
        ZooEntry("gpt2", "GPT-2 causal LM (HF transformers, next-token loss on random tokens)",
                 mp({"n_layer": 2, "n_embd": 128, "n_head": 4, "vocab": 1000, "seq": 64}), 8, _build_gpt2),
        ZooEntry("bert", "BERT masked LM (HF transformers, MLM loss on random labels at every position)",
                 mp({"n_layer": 2, "n_embd": 128, "n_head": 4, "vocab": 1000, "seq": 64}), 8, _build_bert),
        ZooEntry("vit", "ViT image classifier (HF transformers, cross-entropy on random images)",
                 mp({"n_layer": 2, "n_embd": 128, "n_head": 4, "image": 32, "patch": 8, "classes": 10}),
                 8, _build_vit),
        ZooEntry("resnet", "ResNet-18/34/50/101 classifier (norm=bn|gn|none; split-batch equality needs "
                 "gn or none)", mp({"depth": 18, "width": 16, "image": 32, "classes": 10, "norm": "bn"}),
                 8, _build_resnet, mp({"norm": NORMS})),
        ZooEntry("vgg", "VGG-11/13/16/19 classifier (bn=true adds BatchNorm, breaking split-batch equality)",
                 mp({"depth": 11, "width": 16, "image": 32, "classes": 10, "hidden": 256, "bn": False}),
                 8, _build_vgg),
    ]
    return {e.name: e for e in entries}


def list_zoo() -> dict[str, str]:
    """``name -> one-line description`` (with default overrides and batch) of every zoo model."""
    return {name: e.summary() for name, e in zoo_entries().items()}


def _parse_value(spec: str, key: str, text: str, default: Value, choices: tuple[Value, ...]) -> Value:
    """Parse ``text`` as the type of ``default`` (int, float, bool or one of ``choices``)."""
    t = text.strip()
    low = t.lower()
    try:
        if isinstance(default, bool):
            bools = {"true": True, "1": True, "yes": True, "on": True,
                     "false": False, "0": False, "no": False, "off": False}
            return bools[low]
        if isinstance(default, int):
            return int(t)
        if isinstance(default, float):
            return float(t)
    except (KeyError, ValueError):
        kind = type(default).__name__
        raise WorkloadError(f"workload {spec!r}: bad value {text!r} for {key!r}; expected {kind}") from None
    if choices and t not in choices:
        raise WorkloadError(f"workload {spec!r}: bad value {text!r} for {key!r}; expected one of "
                            f"{', '.join(map(str, choices))}")
    return t


def parse_overrides(spec: str, entry: ZooEntry, text: str) -> dict[str, Value]:
    """``"k=v,k2=v2"`` -> full config (defaults updated); unknown/duplicate keys raise WorkloadError."""
    cfg = dict(entry.defaults)
    seen: set[str] = set()
    valid = ", ".join(entry.defaults)
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, eq, val = (s.strip() for s in item.partition("="))
        if not eq or not key or not val:
            raise WorkloadError(f"workload {spec!r}: bad override {item!r}; expected key=value with "
                                f"key one of {valid}")
        if key not in cfg:
            raise WorkloadError(f"workload {spec!r}: unknown override {key!r} for {entry.name}; "
                                f"valid keys: {valid}")
        if key in seen:
            raise WorkloadError(f"workload {spec!r}: override {key!r} given twice")
        seen.add(key)
        cfg[key] = _parse_value(spec, key, val, entry.defaults[key], entry.choices.get(key, ()))
    return cfg


def canonical_name(entry: ZooEntry, cfg: Mapping[str, Value]) -> str:
    """``name`` plus the non-default overrides in default-key order, e.g. ``gpt2:n_layer=12``."""
    diff = [f"{k}={_fmt(cfg[k])}" for k in entry.defaults if cfg[k] != entry.defaults[k]]
    return entry.name + (":" + ",".join(diff) if diff else "")


def suggest(spec: str, name: str) -> str:
    """Error text for spec ``spec`` naming an unknown zoo model ``name``, with close matches."""
    names = list(zoo_entries())
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    return (f"workload {spec!r}: unknown zoo model {name!r}; expected one of {', '.join(names)} "
            f"(name[:key=value,...]) or a factory package.module:function / file.py:function{hint}")


@dataclass(frozen=True)
class ZooResult:
    """A built zoo workload: canonical name, model, inputs, batch size, input builder."""

    name: str
    model: nn.Module
    inputs: tuple
    batch_size: int
    make_inputs: Callable[[int], tuple]


def load_zoo(spec: str, name: str, overrides: str, batch: int | None, seed: int) -> ZooResult:
    """Build zoo model ``name`` with ``overrides`` (``"k=v,..."``) under ``seed``.

    Parameters are initialised under ``torch.manual_seed(seed)`` inside a forked RNG (the global
    RNG is untouched); inputs come from a ``torch.Generator`` seeded with ``seed``, so
    ``make_inputs(b)`` is deterministic and ``make_inputs(batch_size)`` equals ``inputs``.
    """
    entry = zoo_entries()[name]
    cfg = parse_overrides(spec, entry, overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            model, sample = entry.build(cfg)
        except ValueError as e:
            raise WorkloadError(f"workload {spec!r}: {e}") from e
    model.train()

    def make_inputs(b: int) -> tuple:
        return sample(b, torch.Generator().manual_seed(seed))

    b = entry.batch if batch is None else batch
    return ZooResult(canonical_name(entry, cfg), model, make_inputs(b), b, make_inputs)
