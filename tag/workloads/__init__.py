"""Workloads: a model whose ``forward(*inputs)`` returns the training loss, plus example inputs.

``load_workload(spec, batch, seed)`` accepts

* a zoo name with optional overrides, ``name[:key=value,...]`` (see :func:`list_zoo`), e.g.
  ``gpt2:n_layer=12,n_embd=768`` or ``resnet:depth=50,width=64,image=64``;
* a user factory ``package.module:function`` or ``path/to/file.py:function`` returning
  ``(model, inputs)`` (see :mod:`tag.workloads.factory`).

Every bad spec raises :class:`tag.errors.WorkloadError` with a one-line message.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tag.errors import WorkloadError
from tag.limits import MAX_BATCH
from tag.workloads.factory import LossWrapper, cut_blocks, extract_loss, find_blocks, load_factory, resample
from tag.workloads.zoo import list_zoo, load_zoo, suggest, zoo_entries

__all__ = ["LossWrapper", "Workload", "extract_loss", "is_zoo", "list_zoo", "load_workload", "resample"]


@dataclass
class Workload:
    """A model plus example inputs; ``model(*inputs)`` returns a 0-dim float loss tensor.

    Attributes:
        name: canonical spec, e.g. ``"gpt2:n_layer=2,n_embd=64"`` (zoo: only non-default overrides)
            or the factory spec as given.
        model: loss-returning module (a :class:`LossWrapper`; parameters are ``model.<...>``).
        inputs: tuple of inputs; dim 0 of every tensor is the batch dimension.
        batch_size: global batch size of ``inputs`` (samples).
        make_inputs: ``make_inputs(b)`` builds inputs for global batch ``b`` with the same sequence
            length / image size; deterministic for a given load seed.
    """

    name: str
    model: torch.nn.Module
    inputs: tuple
    batch_size: int
    make_inputs: Callable[[int], tuple]
    blocks: int | None = None
    """Identical transformer layers the model stacks (zoo GPT-2, BERT, ViT, Llama; a factory's
    model with a list of identical blocks, :func:`tag.workloads.factory.find_blocks`), else None."""
    with_blocks: Callable[[int], Workload] | None = None
    """``with_blocks(k)``: the same workload (batch, seed, device) with ``k`` such layers."""
    data: object = None
    """Training data a factory returned (:func:`tag.workloads.factory.check_data`; ``tag run``
    reads it, :mod:`tag.executor.data`); None: the zoo, or a factory returning none."""


def _checked(spec: str, fn: Callable[[int], tuple]) -> Callable[[int], tuple]:
    """Wrap an input builder so a non-positive batch raises WorkloadError."""
    def make_inputs(b: int) -> tuple:
        _check_batch(spec, b)
        return fn(b)
    return make_inputs


def _check_batch(spec: str, batch) -> None:
    """WorkloadError (one line) unless ``batch`` is an integer in 1..:data:`tag.limits.MAX_BATCH`."""
    if isinstance(batch, bool) or not isinstance(batch, int) or not 1 <= batch <= MAX_BATCH:
        raise WorkloadError(f"workload {spec!r}: batch size must be an integer between 1 and {MAX_BATCH}, "
                            f"got {batch!r}")


def is_zoo(spec: str) -> bool:
    """Whether ``spec`` names a zoo model (``name[:key=value,...]``) rather than a factory."""
    return spec.strip().partition(":")[0] in zoo_entries()


def load_workload(spec: str, batch: int | None = None, seed: int = 0, *, abstract: bool = False) -> Workload:
    """Load a zoo model or a user factory (see the module docstring).

    Args:
        spec: ``name[:key=value,...]``, ``package.module:function`` or ``path/to/file.py:function``.
        batch: global batch size of ``inputs``; None uses the zoo default / the factory's own.
        seed: seeds parameter init (zoo, and factories via ``torch.manual_seed``) and inputs.
        abstract: build a zoo model and its inputs on the meta device (shapes and dtypes, no data:
            enough to capture and plan, not to run). A factory decides its own device; one that
            returns a meta-device model is never run eagerly either.
    """
    spec = spec.strip()
    if batch is not None:
        _check_batch(spec, batch)
    head, colon, tail = spec.partition(":")
    if is_zoo(spec):  # zoo names shadow same-named modules; use file.py:function for those
        z = load_zoo(spec, head, tail, batch, seed, abstract=abstract)

        def with_blocks(k: int) -> Workload:
            zk = load_zoo(spec, head, tail, z.batch_size, seed, abstract=abstract, blocks=k)
            return Workload(zk.name, zk.model, zk.inputs, zk.batch_size, _checked(spec, zk.make_inputs), k)

        return Workload(z.name, z.model, z.inputs, z.batch_size, _checked(spec, z.make_inputs), z.blocks,
                        with_blocks if z.blocks is not None else None)
    if not colon or not all(part.isidentifier() for part in tail.split(".")):
        raise WorkloadError(suggest(spec, head))  # e.g. "gtp2" or "resnett:depth=50"
    f = load_factory(spec, batch, seed)
    found = find_blocks(f.model)  # identical blocks: captured by layer folding (tag.graph.fold)
    if found is None:
        return Workload(spec, f.model, f.inputs, f.batch_size, _checked(spec, f.make_inputs), data=f.data)
    path, n = found

    def shortened(k: int) -> Workload:
        return Workload(spec, cut_blocks(f.model, path, k), f.inputs, f.batch_size, _checked(spec, f.make_inputs), k,
                        data=f.data)

    return Workload(spec, f.model, f.inputs, f.batch_size, _checked(spec, f.make_inputs), n, shortened, data=f.data)
