"""Built-in workloads: small, randomly initialised models addressed as ``name[:key=value,...]``.

Zoo models are built offline from configs (no weight downloads), are deterministic given a seed,
and are wrapped in :class:`LossWrapper` (parameters ``model.<...>``). Dropout is off unless asked
for: the transformers take ``dropout=p`` (probability in [0, 1), default 0), set on every dropout
their Hugging Face config has (:data:`DROPOUT_FIELDS`).
Transformers take ``attn=eager|sdpa|eager_fused_softmax`` (Hugging Face's ``attn_implementation``):
the plain names default to ``eager`` (matmul, softmax, matmul: [B, heads, L, L] probabilities kept
for the backward), the real-size :data:`PRESETS` to ``sdpa`` (``F.scaled_dot_product_attention``,
one fused op; Hugging Face's own default); ``eager_fused_softmax`` is ``eager`` with Megatron-LM's
fused softmax (:func:`fused_softmax_attention`). Defaults are tiny (a CPU forward+backward at the
default batch takes well under a second); scale them up with overrides.
"""

from __future__ import annotations

import contextlib
import difflib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from tag.errors import WorkloadError
from tag.io import total_ram_bytes
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
    p = cfg["dropout"]
    _require(isinstance(p, float) and 0.0 <= p < 1.0, f"dropout must be a probability in [0, 1), got {p}")
    _require(cfg["n_embd"] % cfg["n_head"] == 0,
             f"n_embd ({cfg['n_embd']}) must be divisible by n_head ({cfg['n_head']})")


def _hf() -> Any:
    """Import transformers lazily, offline (no hub access for configs or weights), with
    :data:`FUSED_SOFTMAX` registered as an attention implementation (and its mask as ``eager``'s)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

    transformers.AttentionInterface.register(FUSED_SOFTMAX, fused_softmax_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(FUSED_SOFTMAX, eager_mask)
    return transformers


DROPOUT_FIELDS = {
    "gpt2": ("attn_pdrop", "resid_pdrop", "embd_pdrop"),
    "bert": ("hidden_dropout_prob", "attention_probs_dropout_prob"),
    "vit": ("hidden_dropout_prob", "attention_probs_dropout_prob"),
    "llama": ("attention_dropout",),
}
"""Hugging Face config fields that a transformer's ``dropout`` key sets (all to the same
probability): GPT-2 drops out the attention probabilities, the attention and MLP outputs and the
embeddings (as Megatron-LM's attention_dropout and hidden_dropout); BERT and ViT the probabilities
and hidden states; Llama's config has attention dropout only (``summary_first_dropout``, GPT-2's
classification head, is not on the LM's path and stays 0)."""


def _dropout(family: str, cfg: Mapping[str, Value]) -> dict[str, float]:
    """``{HF config field: probability}`` of ``family``'s :data:`DROPOUT_FIELDS` at ``cfg["dropout"]``."""
    return dict.fromkeys(DROPOUT_FIELDS[family], float(cfg["dropout"]))


FUSED_SOFTMAX = "eager_fused_softmax"
"""The ``attn`` value of :func:`fused_softmax_attention`."""
ATTENTION = ("eager", "sdpa", FUSED_SOFTMAX)
"""Values of the transformers' ``attn`` key: Hugging Face ``attn_implementation`` names."""


def fused_softmax_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, scaling: float | None = None,
                            dropout: float = 0.0, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention written out as Megatron-LM runs it: scores ``q k^T * scaling`` [B, heads, L, S],
    the mask added, a softmax, the product with V; ``query`` [B, heads, L, d], ``key``/``value``
    [B, kv heads, S, d] (kv heads repeated to ``heads`` as Llama's ``repeat_kv`` does).

    Hugging Face's ``eager`` runs the softmax in FP32 under autocast (CUDA autocast's list) and
    casts the probabilities back, so its backward keeps both: 6 bytes an element of [B, heads, L,
    S] in bf16/fp16. Megatron-LM's ``FusedScaleMaskSoftmax`` (megatron/model/fused_softmax.py,
    whose CUDA kernels compute in FP32 and read and write fp16/bf16) returns, and keeps for its
    backward, the probabilities in the input's dtype, which its ``bmm`` with V reads too: 2 bytes
    an element. Here the mask (Hugging Face's additive FP32 ``[B, 1, L, S]``, a constant) is cast
    to the scores' dtype and the softmax is ``torch.softmax(x, -1, dtype=x.dtype)``, which CUDA
    autocast runs in ``x``'s dtype (:data:`tag.graph.precision.OPT_DTYPE_OPS`); in fp32 the values
    are ``eager``'s. The products are ``bmm`` over [B * heads, ., .], as Megatron-LM's
    ``baddbmm``/``bmm``, so the softmax's backward and the second product's read the one
    probabilities tensor (a graph tensor is one saved value; ``eager``'s ``matmul`` reads a view of
    it). Megatron's kernel also folds the scale and the causal mask in (it reads the scores once);
    here they stay the separate elementwise ops ``eager`` has (under ``CostModel(runtime="megatron")``
    one fused run with the softmax, :data:`tag.cost.gpu.RUNTIMES`).
    Returns (output [B, L, heads, d], probabilities [B, heads, L, S])."""
    b, heads, length, d = query.shape
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:  # grouped-query attention: every kv head serves `groups` query heads
        kv, s = key.shape[1], key.shape[2]
        key = key[:, :, None].expand(b, kv, groups, s, d).reshape(b, kv * groups, s, d)
        value = value[:, :, None].expand(b, kv, groups, s, d).reshape(b, kv * groups, s, d)
    source = key.shape[2]
    q = query.reshape(b * heads, length, d)
    k, v = key.reshape(b * heads, source, d), value.reshape(b * heads, source, d)
    scores = torch.bmm(q, k.transpose(1, 2)) * (d**-0.5 if scaling is None else scaling)  # [B * heads, L, S]
    if attention_mask is not None:
        scores = scores.view(b, heads, length, source) + attention_mask.to(scores.dtype)
        scores = scores.view(b * heads, length, source)
    probs = torch.softmax(scores, dim=-1, dtype=scores.dtype)
    probs = nn.functional.dropout(probs, p=dropout, training=module.training)
    out = torch.bmm(probs, v).view(b, heads, length, d).transpose(1, 2).contiguous()
    return out, probs.view(b, heads, length, source)


def _build_gpt2(cfg: Mapping[str, Value]) -> tuple[nn.Module, Sampler]:
    _transformer_checks(cfg)
    hf = _hf()
    v = cfg["vocab"]
    conf = hf.GPT2Config(
        vocab_size=v, n_positions=cfg["seq"], n_embd=cfg["n_embd"], n_layer=cfg["n_layer"],
        n_head=cfg["n_head"], **_dropout("gpt2", cfg),
        summary_first_dropout=0.0, bos_token_id=v - 1, eos_token_id=v - 1, pad_token_id=v - 1,
        use_cache=False, attn_implementation=cfg["attn"],
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
        max_position_embeddings=cfg["seq"], **_dropout("bert", cfg),
        pad_token_id=0, bos_token_id=None, eos_token_id=None, attn_implementation=cfg["attn"],
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
        intermediate_size=4 * cfg["n_embd"], **_dropout("vit", cfg),
        num_labels=cfg["classes"], problem_type="single_label_classification",
        attn_implementation=cfg["attn"],
    )
    model = LossWrapper(hf.ViTForImageClassification(conf), ("pixel_values", "labels"))
    return model, _images(cfg["image"], cfg["classes"])


def _build_llama(cfg: Mapping[str, Value]) -> tuple[nn.Module, Sampler]:
    _transformer_checks(cfg)
    _positive(cfg, "n_kv_head", "ffn")
    _require(cfg["n_head"] % cfg["n_kv_head"] == 0,
             f"n_head ({cfg['n_head']}) must be divisible by n_kv_head ({cfg['n_kv_head']})")
    hf = _hf()
    v = cfg["vocab"]
    conf = hf.LlamaConfig(
        vocab_size=v, hidden_size=cfg["n_embd"], intermediate_size=cfg["ffn"],
        num_hidden_layers=cfg["n_layer"], num_attention_heads=cfg["n_head"],
        num_key_value_heads=cfg["n_kv_head"], max_position_embeddings=cfg["seq"],
        **_dropout("llama", cfg), tie_word_embeddings=False, use_cache=False, attn_implementation=cfg["attn"],
    )
    model = LossWrapper(hf.LlamaForCausalLM(conf), ("input_ids", "labels"), {"use_cache": False})
    return model, _tokens(v, cfg["seq"])


#: Builders whose model is ``n_layer`` identical transformer layers between an embedding and a head
#: (HF's ``nn.ModuleList`` of one layer class, one config): graphs of them may be captured by layer
#: folding (:mod:`tag.graph.fold`, which proves each fold all the same).
FOLDABLE = (_build_gpt2, _build_bert, _build_vit, _build_llama)


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
    attn = mp({"attn": ATTENTION})
    entries = [
        ZooEntry("mlp", "MLP classifier (cross-entropy on random features)",
                 mp({"layers": 3, "hidden": 256, "in_dim": 64, "classes": 10}), 32, _build_mlp),
        ZooEntry("gpt2", "GPT-2 causal LM (HF transformers, next-token loss on random tokens)",
                 mp({"n_layer": 2, "n_embd": 128, "n_head": 4, "vocab": 1000, "seq": 64, "attn": "eager",
                     "dropout": 0.0}), 8,
                 _build_gpt2, attn),
        ZooEntry("bert", "BERT masked LM (HF transformers, MLM loss on random labels at every position)",
                 mp({"n_layer": 2, "n_embd": 128, "n_head": 4, "vocab": 1000, "seq": 64, "attn": "eager",
                     "dropout": 0.0}), 8,
                 _build_bert, attn),
        ZooEntry("vit", "ViT image classifier (HF transformers, cross-entropy on random images)",
                 mp({"n_layer": 2, "n_embd": 128, "n_head": 4, "image": 32, "patch": 8, "classes": 10,
                     "attn": "eager", "dropout": 0.0}), 8, _build_vit, attn),
        ZooEntry("llama", "Llama causal LM (HF transformers LlamaConfig, random weights, next-token loss)",
                 mp({"n_layer": 2, "n_embd": 128, "n_head": 4, "n_kv_head": 4, "ffn": 344, "vocab": 1000,
                     "seq": 64, "attn": "eager", "dropout": 0.0}), 8, _build_llama, attn),
        ZooEntry("resnet", "ResNet-18/34/50/101/152 classifier (norm=bn|gn|none; split-batch equality needs "
                 "gn or none)", mp({"depth": 18, "width": 16, "image": 32, "classes": 10, "norm": "bn"}),
                 8, _build_resnet, mp({"norm": NORMS})),
        ZooEntry("vgg", "VGG-11/13/16/19 classifier (bn=true adds BatchNorm, breaking split-batch equality)",
                 mp({"depth": 11, "width": 16, "image": 32, "classes": 10, "hidden": 256, "bn": False}),
                 8, _build_vgg),
    ]
    table = {e.name: e for e in entries}
    for name, base, what, overrides, batch in PRESETS:
        b = table[base]
        table[name] = ZooEntry(name, f"{what} ({b.name} preset)", mp({**b.defaults, **overrides}), batch,
                               b.build, b.choices)
    return table


#: Models at the sizes people train: (name, zoo base, what, overrides of the base, default batch).
#: The transformers use fused attention (``attn=sdpa``, :data:`SDPA`), as Hugging Face builds them
#: by default; ``<preset>:attn=eager`` gives the materialised [B, heads, L, L] probabilities
#: (``attn=eager_fused_softmax``: kept in the training precision, as Megatron-LM's fused softmax).
#: Shapes follow the published configurations (GPT-2: Radford et al. 2019; BERT: Devlin et al. 2019;
#: ViT: Dosovitskiy et al. 2021; ResNet: He et al. 2016; VGG: Simonyan & Zisserman 2015; Llama-2 7B,
#: 13B and 70B: Touvron et al. 2023, and TinyLlama-1.1B for the 1B shape). Build them with
#: ``load_workload(..., abstract=True)`` to capture without allocating their weights.
SDPA = {"attn": "sdpa"}
PRESETS: tuple[tuple[str, str, str, dict[str, Value], int], ...] = (
    ("gpt2-small", "gpt2", "GPT-2 small",
     {"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab": 50257, "seq": 1024, **SDPA}, 8),
    ("gpt2-medium", "gpt2", "GPT-2 medium",
     {"n_layer": 24, "n_embd": 1024, "n_head": 16, "vocab": 50257, "seq": 1024, **SDPA}, 8),
    ("gpt2-large", "gpt2", "GPT-2 large",
     {"n_layer": 36, "n_embd": 1280, "n_head": 20, "vocab": 50257, "seq": 1024, **SDPA}, 8),
    ("gpt2-xl", "gpt2", "GPT-2 XL",
     {"n_layer": 48, "n_embd": 1600, "n_head": 25, "vocab": 50257, "seq": 1024, **SDPA}, 8),
    ("bert-base", "bert", "BERT base",
     {"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab": 30522, "seq": 512, **SDPA}, 8),
    ("bert-large", "bert", "BERT large",
     {"n_layer": 24, "n_embd": 1024, "n_head": 16, "vocab": 30522, "seq": 512, **SDPA}, 8),
    ("vit-b16", "vit", "ViT-B/16 at 224",
     {"n_layer": 12, "n_embd": 768, "n_head": 12, "image": 224, "patch": 16, "classes": 1000, **SDPA}, 32),
    ("vit-l16", "vit", "ViT-L/16 at 224",
     {"n_layer": 24, "n_embd": 1024, "n_head": 16, "image": 224, "patch": 16, "classes": 1000, **SDPA}, 32),
    ("resnet50", "resnet", "ResNet-50 at 224", {"depth": 50, "width": 64, "image": 224, "classes": 1000}, 32),
    ("resnet101", "resnet", "ResNet-101 at 224", {"depth": 101, "width": 64, "image": 224, "classes": 1000}, 32),
    ("resnet152", "resnet", "ResNet-152 at 224", {"depth": 152, "width": 64, "image": 224, "classes": 1000}, 32),
    ("vgg16", "vgg", "VGG-16 at 224", {"depth": 16, "width": 64, "image": 224, "classes": 1000, "hidden": 4096}, 32),
    ("vgg19", "vgg", "VGG-19 at 224", {"depth": 19, "width": 64, "image": 224, "classes": 1000, "hidden": 4096}, 32),
    ("llama-1b", "llama", "Llama 1.1B (TinyLlama shape)",
     {"n_layer": 22, "n_embd": 2048, "n_head": 32, "n_kv_head": 4, "ffn": 5632,
      "vocab": 32000, "seq": 2048, **SDPA}, 4),
    ("llama-7b", "llama", "Llama-2 7B shape",
     {"n_layer": 32, "n_embd": 4096, "n_head": 32, "n_kv_head": 32, "ffn": 11008,
      "vocab": 32000, "seq": 2048, **SDPA}, 4),
    ("llama-13b", "llama", "Llama-2 13B shape",
     {"n_layer": 40, "n_embd": 5120, "n_head": 40, "n_kv_head": 40, "ffn": 13824,
      "vocab": 32000, "seq": 2048, **SDPA}, 4),
    ("llama-70b", "llama", "Llama-2 70B shape (grouped-query attention, 8 key-value heads)",
     {"n_layer": 80, "n_embd": 8192, "n_head": 64, "n_kv_head": 8, "ffn": 28672,
      "vocab": 32000, "seq": 2048, **SDPA}, 4),
)


def zoo_params(name: str) -> int:
    """Trainable parameters of zoo model ``name`` at its defaults (built on the meta device)."""
    entry = zoo_entries()[name]
    with torch.device("meta"):
        model, _ = entry.build(entry.defaults)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def list_zoo(*, presets: bool = False) -> dict[str, str]:
    """``name -> one-line description`` (with default overrides and batch) of every zoo model;
    the real-size :data:`PRESETS` too when ``presets``."""
    skip = set() if presets else {p[0] for p in PRESETS}
    return {name: e.summary() for name, e in zoo_entries().items() if name not in skip}


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
    blocks: int | None = None
    """Identical transformer layers (``n_layer``) of a model built from them, else None."""


INPUT_MEMORY_FRACTION = 0.5
"""Largest share of the machine's memory that a batch of example inputs, made for real (capture
without ``abstract``, profiling, every rank of ``tag execute``), may take: beyond it the batch is
refused before it is made (`gpt2:seq=100000000` used to be sampled until the machine ran out)."""


DEPTH_KEYS = ("n_layer", "layers")
"""Overrides that multiply a zoo model's modules (its layers); bounded by :func:`check_build_memory`."""
BUILD_BYTES_PER_OBJECT = 64 * 2**10
"""Host memory per module, parameter or buffer of a zoo model, built on the meta device, captured,
grouped and unrolled, rounded up: `/usr/bin/time tag inspect --model M:n_layer=N --no-cache` peaks
at 536 / 821 MB for gpt2 at N = 50 / 400 (0.82 MB a layer of 25 objects) and 561 / 1012 MB for
llama (1.29 MB a layer of 22: 59 KiB each; 2026-11-29)."""
MODEL_MEMORY_FRACTION = 0.5
"""Largest share of the machine's memory a zoo model's layers may take by that estimate: beyond it
the model is refused before it is built (`gpt2:n_layer=100000` grew until the machine ran out)."""
CHECKED_DEPTH = 64
"""Layers up to which no estimate is made (two small builds saved; far below any bound)."""


def check_build_memory(spec: str, entry: ZooEntry, cfg: Mapping[str, Value]) -> None:
    """One-line WorkloadError where the model's layers (:data:`DEPTH_KEYS`) would take more than
    :data:`MODEL_MEMORY_FRACTION` of this machine's memory to build and capture: its modules,
    parameters and buffers per layer, counted on two small builds on the meta device, times the
    layers, times :data:`BUILD_BYTES_PER_OBJECT`; checked before it is built."""
    key = next((k for k in DEPTH_KEYS if k in cfg), None)
    depth = cfg.get(key) if key is not None else None
    if not isinstance(depth, int) or depth <= CHECKED_DEPTH:
        return

    def objects(n: int) -> int:
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            model, _ = entry.build({**cfg, key: n})
        return sum(1 for _ in model.modules()) + sum(1 for _ in model.parameters()) + sum(1 for _ in model.buffers())

    try:
        two, three = objects(2), objects(3)
    except (ValueError, RuntimeError, MemoryError):
        return  # (the build itself then says what is wrong)
    per = max(three - two, 1)
    need = (two - 2 * per + per * depth) * BUILD_BYTES_PER_OBJECT
    ram = total_ram_bytes()
    if need > MODEL_MEMORY_FRACTION * ram:
        raise WorkloadError(f"workload {spec!r}: {key}={depth} needs about {need / 2**30:.1f} GiB of this machine's "
                            f"memory to build and capture ({per} modules, parameters and buffers a layer, about "
                            f"{BUILD_BYTES_PER_OBJECT // 2**10} KiB each); expected at most {MODEL_MEMORY_FRACTION:g} "
                            f"of its {ram / 2**30:.1f} GiB (fewer layers)")


def load_zoo(spec: str, name: str, overrides: str, batch: int | None, seed: int, *,
             abstract: bool = False, blocks: int | None = None) -> ZooResult:
    """Build zoo model ``name`` with ``overrides`` (``"k=v,..."``) under ``seed``.

    Parameters are initialised under ``torch.manual_seed(seed)`` inside a forked RNG (the global
    RNG is untouched); inputs come from a ``torch.Generator`` seeded with ``seed``, so
    ``make_inputs(b)`` is deterministic and ``make_inputs(batch_size)`` equals ``inputs``.
    ``abstract``: the model and inputs are built on the meta device (no weights allocated).
    ``blocks``: build it with this many transformer layers instead (``n_layer``; for layer
    folding, :mod:`tag.graph.fold`).
    """
    entry = zoo_entries()[name]
    cfg = parse_overrides(spec, entry, overrides)
    if blocks is not None:
        cfg["n_layer"] = blocks
    check_build_memory(spec, entry, cfg)
    with torch.random.fork_rng(devices=[]), (torch.device("meta") if abstract else contextlib.nullcontext()):
        torch.manual_seed(seed)
        try:
            model, sample = entry.build(cfg)
        except ValueError as e:
            raise WorkloadError(f"workload {spec!r}: {e}") from e
        except (RuntimeError, MemoryError) as e:  # sizes torch cannot hold, e.g. mlp:hidden=100000000000
            raise WorkloadError(f"workload {spec!r}: building the model failed ({type(e).__name__}: "
                                f"{' '.join(str(e).split())[:200]}); expected smaller sizes") from e
    model.train()

    def make_inputs(b: int) -> tuple:
        with torch.device("meta"):  # shapes and dtypes first: nothing allocated
            shapes = tuple(sample(b, torch.Generator().manual_seed(seed)))
        if abstract:
            return shapes
        nbytes, ram = sum(t.numel() * t.element_size() for t in shapes), total_ram_bytes()
        if nbytes > INPUT_MEMORY_FRACTION * ram:
            raise WorkloadError(f"workload {spec!r}: a batch of {b} is {nbytes / 2**30:.1f} GiB of example inputs; "
                                f"expected at most {INPUT_MEMORY_FRACTION:g} of this machine's "
                                f"{ram / 2**30:.1f} GiB (a smaller batch, seq or image)")
        return sample(b, torch.Generator().manual_seed(seed))

    b = entry.batch if batch is None else batch
    return ZooResult(canonical_name(entry, cfg), model, make_inputs(b), b, make_inputs,
                     cfg["n_layer"] if entry.build in FOLDABLE else None)
