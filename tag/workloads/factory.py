"""User workloads: ``package.module:function`` or ``path/to/file.py:function`` factories.

The factory is called as ``function()``, or ``function(batch_size=B)`` when it has a parameter
named ``batch_size``, and must return ``(model, inputs)`` with ``model(*inputs)`` producing a loss.
The model is wrapped in :class:`LossWrapper` so that the workload's forward returns a scalar.

It may return ``(model, inputs, data)``: the training data ``tag run`` reads
(:mod:`tag.executor.data`), either a map-style dataset (``len(data)`` samples, ``data[i]`` one
sample: a tensor or a tuple of tensors shaped as one row of each input, without the batch dim;
``torch.utils.data.Dataset`` is one), or a callable ``data(step, start, stop)`` returning rows
``start..stop-1`` of global batch ``step`` (a tuple of tensors, dim 0 = ``stop - start``).
Planning and ``tag execute`` use ``inputs`` only.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tag.errors import WorkloadError

#: Batch size passed to a factory whose ``batch_size`` parameter has no default and no batch is given.
DEFAULT_FACTORY_BATCH = 8

LOSS_EXPECTED = (
    "expected model(*inputs) to return a scalar loss tensor, an object with a .loss tensor, "
    "a float tensor (its mean is used) or a tuple whose first element is one of these"
)


def _one_line(text: object) -> str:
    """Collapse whitespace/newlines so an error message is a single line."""
    return " ".join(str(text).split())


def _describe(obj: object) -> str:
    """Short description of an unexpected value for error messages."""
    if isinstance(obj, torch.Tensor):
        return f"tensor(dtype={obj.dtype}, shape={tuple(obj.shape)})"
    if isinstance(obj, Mapping):
        return f"{type(obj).__name__} with keys {sorted(map(str, obj.keys()))}"
    return type(obj).__name__


def extract_loss(out: Any) -> torch.Tensor:
    """The scalar loss in a model output; raises :class:`WorkloadError` (without spec) if none.

    Accepts a 0-dim float tensor, any float tensor (mean taken), an object with a ``.loss`` tensor
    attribute or a ``"loss"`` mapping key (HF ``ModelOutput``), or a tuple/list whose first element
    is one of those.
    """
    if isinstance(out, (tuple, list)) and len(out) > 0:
        out = out[0]
    if not isinstance(out, torch.Tensor):
        loss = getattr(out, "loss", None)
        if loss is None and isinstance(out, Mapping):
            loss = out.get("loss")
        if not isinstance(loss, torch.Tensor):
            raise WorkloadError(f"{LOSS_EXPECTED}, got {_describe(out)}")
        out = loss
    if not out.is_floating_point():
        raise WorkloadError(f"{LOSS_EXPECTED}, got {_describe(out)}")
    return out if out.dim() == 0 else out.mean()


class LossWrapper(nn.Module):
    """Wraps ``model`` so that ``forward(*inputs)`` returns its scalar training loss.

    The wrapped model is the submodule ``model`` (parameter names are ``model.<...>``). When
    ``input_names`` is given, the positional inputs are passed as those keyword arguments instead,
    together with the constant keyword arguments ``extra_kwargs`` (e.g. ``use_cache=False``).
    """

    def __init__(self, model: nn.Module, input_names: Sequence[str] | None = None,
                 extra_kwargs: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self.model = model
        self.input_names = tuple(input_names) if input_names is not None else None
        self.extra_kwargs = dict(extra_kwargs or {})

    def forward(self, *inputs: Any) -> torch.Tensor:
        """inputs: the workload's inputs (dim 0 = batch) -> 0-dim float loss tensor."""
        if self.input_names is None:
            out = self.model(*inputs, **self.extra_kwargs)
        else:
            out = self.model(**dict(zip(self.input_names, inputs)), **self.extra_kwargs)
        return extract_loss(out)


def batch_of(inputs: tuple) -> int:
    """Common dim-0 size of the tensor inputs; raises ValueError if missing or inconsistent."""
    sizes = {t.shape[0] for t in inputs if isinstance(t, torch.Tensor) and t.dim() > 0}
    if any(isinstance(t, torch.Tensor) and t.dim() == 0 for t in inputs):
        raise ValueError("every tensor input needs a batch dimension (dim 0), got a 0-dim tensor")
    if not sizes:
        raise ValueError("inputs contain no tensor with a batch dimension")
    if len(sizes) > 1:
        raise ValueError(f"tensor inputs disagree on the batch size (dim 0): {sorted(sizes)}")
    return sizes.pop()


def resample(inputs: tuple, batch: int) -> tuple:
    """Inputs for another batch size by slicing (smaller) or cyclically repeating (larger) dim 0.

    Sample ``i`` of the result is sample ``i % B`` of ``inputs``; non-tensor inputs pass unchanged.
    """
    n = batch_of(inputs)
    idx = torch.arange(batch) % n
    return tuple(t[idx] if isinstance(t, torch.Tensor) else t for t in inputs)


@dataclass(frozen=True)
class FactoryResult:
    """A loaded user factory: wrapped model, inputs, their batch size, and the input builder."""

    model: LossWrapper
    inputs: tuple
    batch_size: int
    make_inputs: Callable[[int], tuple]
    data: Any = None
    """The training data the factory returned third (:func:`check_data`), or None."""


def _import_target(spec: str, target: str) -> Any:
    """Import ``module`` or ``file.py`` and return the object ``module`` refers to."""
    if target.endswith(".py") or "/" in target or "\\" in target:
        path = Path(target).expanduser().resolve()
        if not path.is_file():
            raise WorkloadError(f"workload {spec!r}: factory file {str(path)!r} does not exist; "
                                "expected path/to/file.py:function")
        digest = hashlib.sha1(str(path).encode()).hexdigest()[:10]
        name = f"_tag_user_{path.stem}_{digest}"
        if name in sys.modules:
            return sys.modules[name]
        mspec = importlib.util.spec_from_file_location(name, path)
        if mspec is None or mspec.loader is None:
            raise WorkloadError(f"workload {spec!r}: cannot load {str(path)!r} as a Python module")
        module = importlib.util.module_from_spec(mspec)
        sys.modules[name] = module
        try:
            with _user_code(spec, f"executing {str(path)!r}"):
                mspec.loader.exec_module(module)
        except Exception as e:
            del sys.modules[name]
            if isinstance(e, WorkloadError):
                raise
            raise WorkloadError(f"workload {spec!r}: executing {str(path)!r} raised "
                                f"{type(e).__name__}: {_one_line(e)}") from e
        return module
    try:
        with _user_code(spec, f"importing module {target!r}"):
            return importlib.import_module(target)
    except WorkloadError:
        raise
    except ModuleNotFoundError as e:
        raise WorkloadError(f"workload {spec!r}: cannot import module {target!r} ({_one_line(e)}); "
                            "expected an importable package.module:function") from e
    except Exception as e:
        raise WorkloadError(f"workload {spec!r}: importing module {target!r} raised "
                            f"{type(e).__name__}: {_one_line(e)}") from e


def resolve_factory(spec: str) -> Callable[..., Any]:
    """The callable named by ``module:function`` / ``file.py:function`` (``function`` may be dotted)."""
    target, _, attr = spec.rpartition(":")
    if not target or not attr:
        raise WorkloadError(f"workload {spec!r}: expected package.module:function or "
                            "path/to/file.py:function")
    obj = _import_target(spec, target)
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise WorkloadError(f"workload {spec!r}: module {target!r} has no attribute {attr!r}; "
                                "expected a callable returning (model, inputs)")
        obj = getattr(obj, part)
    if not callable(obj):
        raise WorkloadError(f"workload {spec!r}: {attr!r} is a {type(obj).__name__}, expected a callable "
                            "returning (model, inputs)")
    return obj


@contextlib.contextmanager
def _user_code(spec: str, what: str):
    """Run a user's factory, module or model: what it prints goes to stderr (stdout carries
    ``--json`` output, which a factory's print() broke), and ``sys.exit()`` in it is a
    WorkloadError (one line, exit 2; ``sys.exit(0)`` ended ``tag plan`` silently with 0)."""
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    except SystemExit as e:
        raise WorkloadError(f"workload {spec!r}: {what} called sys.exit({e.code!r}); expected it to return "
                            + ("(model, inputs)" if what == "the factory" else "normally")) from None


def check_data(spec: str, data: Any) -> Any:
    """``data`` if it is a training data source (a map-style dataset: ``__len__`` and
    ``__getitem__``; or a callable ``data(step, start, stop)``), else WorkloadError (one line)."""
    if data is None or callable(data) or (hasattr(data, "__len__") and hasattr(data, "__getitem__")):
        return data
    raise WorkloadError(f"workload {spec!r}: the factory's third value is a {type(data).__name__}; expected training "
                        "data: a dataset (len(data), data[i] -> one sample) or a callable data(step, start, stop)")


def _call(spec: str, fn: Callable[..., Any], batch: int | None, seed: int) -> tuple[nn.Module, tuple, Any]:
    """Call the factory under ``torch.manual_seed(seed)`` and validate ``(model, inputs[, data])``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            with _user_code(spec, "the factory"):
                out = fn() if batch is None else fn(batch_size=batch)
        except WorkloadError:
            raise
        except Exception as e:
            raise WorkloadError(f"workload {spec!r}: factory raised {type(e).__name__}: "
                                f"{_one_line(e)}") from e
    expected = "expected the factory to return (model: torch.nn.Module, inputs: tuple of tensors[, data])"
    if not (isinstance(out, (tuple, list)) and len(out) in (2, 3)):
        raise WorkloadError(f"workload {spec!r}: {expected}, got {_describe(out)}")
    model, inputs, data = (*out, None) if len(out) == 2 else out
    data = check_data(spec, data)
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    if not isinstance(model, nn.Module) or not isinstance(inputs, (tuple, list)):
        raise WorkloadError(f"workload {spec!r}: {expected}, got ({_describe(model)}, {_describe(inputs)})")
    _check_no_none(spec, model, inputs)
    try:
        n = batch_of(tuple(inputs))
    except ValueError as e:
        raise WorkloadError(f"workload {spec!r}: {e}; {expected}") from e
    if batch is not None and n != batch:
        raise WorkloadError(f"workload {spec!r}: factory called with batch_size={batch} returned inputs "
                            f"with batch {n}; expected dim 0 of every tensor input to be the batch")
    return model, tuple(inputs), data


def _check_no_none(spec: str, model: nn.Module, inputs) -> None:
    """WorkloadError naming the first input that is None, and the parameter of ``model.forward``
    it lands on: the capture exports tensors, and a None one failed building the backward graph
    ("'NoneType' object has no attribute 'requires_grad'", with no word of which input)."""
    at = next((i for i, t in enumerate(inputs) if t is None), None)
    if at is None:
        return
    try:
        params = [p for p in inspect.signature(model.forward).parameters.values()
                  if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    name = f" ({params[at].name} of {type(model).__name__}.forward)" if at < len(params) else ""
    raise WorkloadError(f"workload {spec!r}: inputs[{at}]{name} is None; expected a tensor at every position "
                        "(leave optional arguments out, or pass them by keyword from a wrapper module's forward)")


def _has_no_data(model: nn.Module, inputs: tuple) -> bool:
    """Whether the model or inputs are on the meta device: running them eagerly fails on the
    first op that reads a value (``Tensor.item()``, data-dependent branches)."""
    tensors = [*model.parameters(), *model.buffers(), *(t for t in inputs if isinstance(t, torch.Tensor))]
    return any(t.is_meta for t in tensors)


def check_loss(spec: str, model: nn.Module, inputs: tuple) -> None:
    """Run one no-grad forward to check that ``model(*inputs)`` is a loss; restores all buffers."""
    buffers = list(model.buffers())
    saved = [b.detach().clone() for b in buffers]
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]), _user_code(spec, "model(*inputs)"):
            model(*inputs)
    except WorkloadError as e:
        if str(e).startswith(f"workload {spec!r}: "):  # (_user_code's own line)
            raise
        raise WorkloadError(f"workload {spec!r}: {e}") from e
    except Exception as e:
        raise WorkloadError(f"workload {spec!r}: model(*inputs) raised {type(e).__name__}: "
                            f"{_one_line(e)}; {LOSS_EXPECTED}") from e
    finally:
        with torch.no_grad():
            for b, v in zip(buffers, saved):
                b.copy_(v)


def _shape_of(block: nn.Module) -> tuple:
    """What makes two blocks identical for layer folding: their submodules' types in order and
    their parameters' and buffers' names, shapes and dtypes."""
    return (tuple(type(m).__name__ for m in block.modules()),
            tuple((n, tuple(t.shape), t.dtype) for n, t in block.named_parameters()),
            tuple((n, tuple(t.shape), t.dtype) for n, t in block.named_buffers()))


def find_blocks(model: nn.Module) -> tuple[str, int] | None:
    """``(path, count)`` of the longest ``nn.ModuleList`` or ``nn.Sequential`` in ``model`` whose
    children (at least two) are identical blocks (:func:`_shape_of`: transformers' ``model.layers``,
    ``transformer.h``, ``encoder.layer``, timm-style ``blocks``), the first of equal length in
    module order; None if there is none."""
    best: tuple[str, int] | None = None
    for path, m in model.named_modules():
        if not isinstance(m, (nn.ModuleList, nn.Sequential)) or len(m) < 2 or (best and len(m) <= best[1]):
            continue
        first = _shape_of(m[0])
        if all(type(b) is type(m[0]) and _shape_of(b) == first for b in list(m)[1:]):
            best = (path, len(m))
    return best


def cut_blocks(model: nn.Module, path: str, k: int) -> nn.Module:
    """``model`` with its block list at ``path`` (:func:`find_blocks`) cut to its first ``k``
    blocks: the modules on the way shallow-copied, everything else (the blocks, their parameters
    on whatever device they are) shared, so that it costs nothing on a 7B model."""
    def cut(m: nn.Module, parts: list[str]) -> nn.Module:
        if not parts:
            blocks = list(m)[:k]
            return type(m)(blocks) if isinstance(m, nn.ModuleList) else type(m)(*blocks)
        c = copy.copy(m)
        c._modules = dict(m._modules)  # (copy.copy shares the dict: the original keeps its blocks)
        c._modules[parts[0]] = cut(m._modules[parts[0]], parts[1:])
        return c
    return cut(model, path.split(".") if path else [])


def load_factory(spec: str, batch: int | None, seed: int) -> FactoryResult:
    """Load a user factory workload; see the module docstring for the contract.

    Without a ``batch_size`` parameter, inputs for another batch come from :func:`resample`
    (slice / cyclic repeat along dim 0). With one, the factory is called again (same seed) and
    only its inputs are kept.
    """
    fn = resolve_factory(spec)
    try:
        param = inspect.signature(fn).parameters.get("batch_size")
    except (TypeError, ValueError):
        param = None
    takes_batch = param is not None and param.kind in (
        inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    if takes_batch:
        if batch is None and param.default is inspect.Parameter.empty:
            batch = DEFAULT_FACTORY_BATCH
        model, inputs, data = _call(spec, fn, batch, seed)

        def make_inputs(b: int) -> tuple:
            return _call(spec, fn, b, seed)[1]
    else:
        model, base, data = _call(spec, fn, None, seed)
        inputs = base if batch is None else resample(base, batch)

        def make_inputs(b: int) -> tuple:
            return resample(base, b)

    wrapped = LossWrapper(model)
    if not _has_no_data(wrapped, inputs):  # a meta model is checked by its capture instead
        check_loss(spec, wrapped, inputs)
    return FactoryResult(wrapped, inputs, batch_of(inputs), make_inputs, data)
