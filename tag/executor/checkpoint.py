"""``tag run``'s checkpoints: ``torch.distributed.checkpoint`` (DCP), complete or never read.

A checkpoint of step ``N`` is the folder ``DIR/step-0000000N``::

    __R_0.distcp        rank R's part (DCP: each rank writes the tensors the save plan gives it;
                        a tensor replicated on several ranks is written by one of them)
    .metadata           DCP's index of every tensor (written by rank 0 once every rank's part is)
    train_state.json    step, samples and batches read, LR schedule, losses, plan and topology
    manifest.json       every other file's bytes and SHA-256: written last

The ranks write into ``DIR/step-0000000N.partial``; after DCP's save returns on every rank (its
metadata written), each rank hashes its own files, rank 0 writes ``train_state.json`` and then
``manifest.json`` and renames the folder to its final name (one ``rename``: atomic), and every
rank waits for that before training on. A folder without the final name or without
``manifest.json`` is never read: a run killed while writing leaves a ``.partial`` folder, which
:func:`latest` skips and the next save of that step replaces.

The state, keyed by parameter FQN (state-dict name) so that a run can resume under another plan
(DCP reshards: each rank asks for the FQNs it holds, wherever they were written; a tensor-parallel
shard, a sub-grid of its parameter DCP cannot express, is written whole and cut on load,
:class:`Shards`; a sharded bucket's slices of the flat parameters too, :func:`sharded_state`):
``param/FQN``, ``optim/FQN/KEY`` (the optimizer's per-parameter state: Adam's ``step``,
``exp_avg``, ``exp_avg_sq``; SGD's ``momentum_buffer``), ``rng/rankR/I`` (rank ``R``'s random
stream, read back only under the same plan and world size; elsewhere the streams restart from
the seed) and, fp16, ``scaler/scale``, ``scaler/good_steps``, ``scaler/skipped`` (the dynamic loss
scaler's state, :mod:`tag.executor.scaling`; every rank holds the same, DCP writes it once; read
back under any plan). Reading: DCP reads tensors with ``torch.load(weights_only=True)``, and its
``.metadata``, a pickle, is read by :class:`SafeReader` with an unpickler allowing DCP's
metadata classes and torch's dtypes only (DCP's own reader unpickles anything).
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from ..errors import TagError
from ..io import read_json, write_json

STEP_DIR = re.compile(r"^step-(\d{8})$")
MANIFEST = "manifest.json"
STATE = "train_state.json"
SCALER = "scaler/"
"""Key prefix of the fp16 loss scaler's state (:meth:`tag.executor.scaling.LossScaler.state`)."""


class CheckpointError(TagError):
    """A checkpoint that cannot be read (missing, partial, corrupted, another model's)."""


def step_dir(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def partial_dir(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"step-{step:08d}.partial"


def complete_steps(root: str | os.PathLike) -> list[Path]:
    """Committed checkpoint folders of ``root`` (final name and a manifest), oldest first."""
    p = Path(root)
    if not p.is_dir():
        return []
    found = [(int(m.group(1)), d) for d in p.iterdir() if (m := STEP_DIR.match(d.name)) and (d / MANIFEST).is_file()]
    return [d for _, d in sorted(found)]


def latest(root: str | os.PathLike) -> Path | None:
    """The latest committed checkpoint of ``root`` (None if there is none)."""
    steps = complete_steps(root)
    return steps[-1] if steps else None


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def file_digests(folder: Path, names) -> dict[str, list]:
    """name -> [bytes, SHA-256] of the files ``names`` of ``folder``."""
    return {n: [(folder / n).stat().st_size, sha256(folder / n)] for n in names}


def verify(path: str | os.PathLike) -> dict:
    """The ``train_state.json`` of the checkpoint folder ``path`` once every file its manifest
    names has the bytes and SHA-256 written there; CheckpointError (one line naming the file)
    otherwise: a partial folder (no manifest), a missing, truncated or altered file."""
    p = Path(path)
    if not p.is_dir():
        raise CheckpointError(f"{p}: no such checkpoint folder; expected DIR/step-NNNNNNNN written by tag run")
    if not (p / MANIFEST).is_file():
        raise CheckpointError(f"{p}: partial checkpoint (no {MANIFEST}: its writing was interrupted); "
                              "expected a complete one")
    files = read_json(p / MANIFEST, CheckpointError, "checkpoint manifest")
    entries = files.get("files") if isinstance(files, dict) else None
    if not isinstance(entries, dict) or STATE not in entries or not all(
            Path(n).name == n and n not in (".", "..") and isinstance(v, list) and len(v) == 2
            and isinstance(v[0], int) and isinstance(v[1], str) for n, v in entries.items()):
        raise CheckpointError(f"{p / MANIFEST}: expected {{\"files\": {{file name: [bytes, sha256]}}}} naming {STATE}")
    for name, (size, digest) in entries.items():
        f = p / name
        if not f.is_file():
            raise CheckpointError(f"{f}: missing from the checkpoint (its manifest lists it)")
        if f.stat().st_size != size:
            raise CheckpointError(f"{f}: corrupted checkpoint: {f.stat().st_size} bytes, its manifest says {size}")
        if sha256(f) != digest:
            raise CheckpointError(f"{f}: corrupted checkpoint: its SHA-256 differs from its manifest's")
    state = read_json(p / STATE, CheckpointError, "checkpoint training state")
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise CheckpointError(f"{p / STATE}: expected the training state tag run writes (an integer step)")
    return state


def resolve_resume(root: str | None, resume: str | None) -> tuple[Path, dict] | None:
    """The checkpoint to resume from and its training state: ``resume`` ``"latest"`` is the latest
    committed one of ``root`` (None: the run starts afresh), else a checkpoint folder; verified
    (:func:`verify`)."""
    if resume is None:
        return None
    if resume == "latest":
        if root is None:
            raise CheckpointError("--resume: expected --checkpoint-dir (where to find the latest checkpoint) "
                                  "or a checkpoint folder")
        path = latest(root)
        if path is None:
            return None
    else:
        path = Path(resume)
    return path.absolute(), verify(path)


# ---- the ranks' state --------------------------------------------------------------------
@dataclass
class Shards:
    """How a rank holding parts of parameters (a tensor-parallel shard, :mod:`tag.executor.tensor_parallel`)
    is checkpointed: the group's full parameters and optimizer state are written (the same on every
    member: DCP writes them once), and each member reads its part back from them, so the keys stay
    parameter FQNs whatever the plan."""

    kept: dict[str, list[torch.Tensor]]
    """FQN of each split parameter -> the indices this member keeps per dim."""
    gather: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]
    """Every member's ``{FQN: part}`` -> ``{FQN: full}`` (collective over the group; replicated
    names come back as they are)."""


def rank_state(rt, rank: int, shards: Shards | None = None) -> dict[str, torch.Tensor]:
    """This rank's part of the checkpoint: its parameters and their optimizer state by FQN (with
    ``shards``: gathered in full), and its random stream (:attr:`RankRuntime._rng`)."""
    s = rt.schedule
    params: dict[str, torch.Tensor] = {}
    states: dict[str, dict[str, torch.Tensor]] = {}  # optimizer state key -> FQN -> tensor
    opt_state = rt.optimizer.state if rt.optimizer is not None else {}
    buckets = _sharded_buckets(rt)
    held = {id(p) for bk in buckets for p in bk.params}
    for ph, p in rt.params.items():
        fqn = s.param_target[ph]
        if id(p) in held:  # (a sharded bucket's: below)
            continue
        params[fqn] = p.detach()
        for k, v in opt_state.get(p, {}).items():
            if isinstance(v, torch.Tensor):
                states.setdefault(k, {})[fqn] = v
    if shards is not None:  # (in the same order on every member: the gathers are collective)
        params = shards.gather({n: t.cpu() for n, t in params.items()})
        for k in sorted(states):
            whole = {n: t for n, t in states[k].items() if t.dim() > 0}  # (Adam's step: a replicated scalar)
            states[k].update(shards.gather({n: t.cpu() for n, t in whole.items()}))
    for bk in buckets:
        sharded_state(rt, bk, params, states)
    out = {f"param/{n}": t for n, t in params.items()}
    out.update({f"optim/{n}/{k}": t for k, d in states.items() for n, t in d.items()})
    for i, t in enumerate(rt._rng):
        out[f"rng/rank{rank}/{i}"] = t
    if getattr(rt, "scaler", None) is not None:  # fp16: the dynamic loss scale, the same on every rank
        out.update({f"{SCALER}{k}": v for k, v in rt.scaler.state().items()})
    return out


def _sharded_buckets(rt) -> list:
    """The sharded buckets of a rank of sharded data parallelism (:class:`tag.executor.sharded.ShardedRank`),
    in schedule order (the same on every member of a shard group); none elsewhere."""
    from .sharded import ShardedRank

    hook = getattr(rt, "hook", None)
    return [hook.buckets[i] for i in sorted(hook.buckets)] if isinstance(hook, ShardedRank) else []


def _whole(bk, shard: torch.Tensor) -> list[torch.Tensor]:
    """A bucket's shards of one kind (parameters, Adam's ``exp_avg``...) all-gathered over its shard
    group and cut into its parameters' whole tensors (collective over the shard group)."""
    import torch.distributed as dist

    flat = shard.detach()
    if bk.size > 1:
        flat = torch.empty(bk.padded, dtype=shard.dtype, device=shard.device)
        dist.all_gather_into_tensor(flat, shard.detach().contiguous(), group=bk.shard_pg)
    return [t.cpu() for t in bk.split(flat)]


def sharded_state(rt, bk, params: dict, states: dict) -> None:
    """A sharded bucket's part of the checkpoint, added to ``params`` (FQN -> tensor) and
    ``states`` (optimizer key -> FQN -> tensor): its shards of the flat parameters and of their
    optimizer state gathered over the shard group and written as whole tensors under the
    parameters' FQNs, like any plan's (every member holds them, DCP writes them once), so the
    checkpoint resumes under any plan. A shard's elements (row ``i`` of the bucket's flat layout,
    :class:`tag.executor.sharded._Bucket`) cross its parameters' boundaries: a slice of a flattened parameter is not one
    block of the parameter, which DCP's chunks are (the same reason as a tensor-parallel shard's);
    so the state is gathered, transiently whole on each member at a checkpoint."""
    names = [rt.schedule.param_target[ph] for ph in bk.names]
    params.update(zip(names, _whole(bk, bk.shard)))
    opt = rt.optimizer.state.get(bk.shard, {}) if rt.optimizer is not None else {}
    for k in sorted(opt):
        v = opt[k]
        if not isinstance(v, torch.Tensor):
            continue
        whole = [v] * len(names) if v.dim() == 0 else _whole(bk, v)  # (Adam's step: one scalar)
        states.setdefault(k, {}).update(zip(names, whole))


def save(root: Path, step: int, rt, rank: int, world: int, train_state: dict, before_commit=None,
         shards: Shards | None = None) -> Path:
    """Write step ``step``'s checkpoint (every rank calls it; collective), then commit it (see the
    module docstring); returns the committed folder. ``before_commit()``: called once this rank's
    part is written, before the manifest (testing: a rank killed there leaves a partial folder)."""
    import torch.distributed as dist

    tmp, final = partial_dir(root, step), step_dir(root, step)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a killed run's leftover of this step
        shutil.rmtree(final, ignore_errors=True)  # (resumed before this step: replaced)
        tmp.mkdir(parents=True)
    dist.barrier()
    dcp.save(rank_state(rt, rank, shards), storage_writer=dcp.FileSystemWriter(tmp, thread_count=1))
    mine = file_digests(tmp, sorted(f.name for f in tmp.glob(f"__{rank}_*.distcp")))
    if before_commit is not None:
        before_commit()
    every: list = [None] * world
    dist.all_gather_object(every, mine)
    if rank == 0:
        write_json(tmp / STATE, train_state)
        files = {k: v for d in every for k, v in d.items()}
        files.update(file_digests(tmp, [".metadata", STATE]))
        write_json(tmp / MANIFEST, {"step": step, "files": files})
        _fsync_dir(tmp)
        os.rename(tmp, final)
        _fsync_dir(Path(root))
    dist.barrier()  # committed before anyone trains on (or is stopped)
    return final


def prune(root: Path, keep: int) -> None:
    """Remove all but the ``keep`` latest committed checkpoints (rank 0, after a commit)."""
    for old in complete_steps(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def _fsync_dir(p: Path) -> None:
    fd = os.open(p, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load(path: Path, rt, rank: int, same_plan: bool, shards: Shards | None = None) -> None:
    """Load a verified checkpoint into runtime ``rt``: the parameters it holds and their optimizer
    state (whichever ranks wrote them; with ``shards``, this member's part of each split one), and,
    with ``same_plan``, its random stream. Collective."""
    from .tensor_parallel import select

    reader = SafeReader(path)
    meta = reader.read_metadata().state_dict_metadata
    s = rt.schedule
    kept = shards.kept if shards is not None else {}
    buckets = _sharded_buckets(rt)
    held = {id(p) for bk in buckets for p in bk.params}
    want: dict[str, torch.Tensor] = {}
    opt_keys: list[tuple[torch.Tensor, str, str]] = []  # (parameter, optimizer state key, checkpoint key)
    parts: list[tuple[torch.Tensor, str, str]] = []  # (this rank's part, checkpoint key of the whole, FQN)

    def whole(key: str) -> torch.Tensor:
        if key not in meta:
            raise CheckpointError(f"{path}: holds no parameter {key[len('param/'):]!r}; expected a checkpoint of "
                                  "the same model")
        want[key] = torch.empty(tuple(meta[key].size), dtype=meta[key].properties.dtype)
        return want[key]

    for ph, p in rt.params.items():
        fqn = s.param_target[ph]
        key = f"param/{fqn}"
        whole(key)
        if id(p) in held:  # (a sharded bucket's: its shard is cut from the whole tensors below)
            continue
        if fqn in kept:  # read whole, then this member's part
            parts.append((p.detach(), key, fqn))
        else:
            want[key] = p.detach()
        for k in meta:
            if k.startswith(f"optim/{fqn}/"):
                whole(k)
                opt_keys.append((p, k.rsplit("/", 1)[1], k))
    for bk in buckets:
        fqns = [s.param_target[ph] for ph in bk.names]
        for k in {k.rsplit("/", 1)[1] for k in meta if k.startswith(f"optim/{fqns[0]}/")}:
            if all(f"optim/{f}/{k}" in meta for f in fqns):
                for f in fqns:
                    whole(f"optim/{f}/{k}")
                opt_keys.append((bk.shard, k, [f"optim/{f}/{k}" for f in fqns]))
    scaler = getattr(rt, "scaler", None)
    scaler_keys = [f"{SCALER}{k}" for k in scaler.state()] if scaler is not None else []
    if scaler_keys and all(k in meta for k in scaler_keys):  # (a checkpoint of a run without fp16: the initial scale)
        want.update({k: torch.empty((), dtype=meta[k].properties.dtype) for k in scaler_keys})
    rng_keys = [f"rng/rank{rank}/{i}" for i in range(len(rt._rng))]
    if same_plan and all(k in meta for k in rng_keys):
        for k, t in zip(rng_keys, rt._rng):
            want[k] = t.clone()
    try:
        with torch.no_grad():
            dcp.load(want, storage_reader=reader)
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - DCP wraps a reader's failure per rank
        first = (str(e).strip().splitlines() or [type(e).__name__])[-1]
        raise CheckpointError(f"{path}: cannot read the checkpoint: {first[:300]}") from None
    with torch.no_grad():
        for dst, key, fqn in parts:
            dst.copy_(select(want[key], kept[fqn]))
        for bk in buckets:
            flat = _shard_of(bk, [want[f"param/{s.param_target[ph]}"] for ph in bk.names])
            bk.shard.copy_(flat)
            if bk.level < 3:  # (ZeRO-1/2 hold the full parameters too)
                bk.set_full([want[f"param/{s.param_target[ph]}"] for ph in bk.names])
    if rt.optimizer is not None and opt_keys:
        index = {id(p): i for i, p in enumerate(p for g in rt.optimizer.param_groups for p in g["params"])}
        sd = rt.optimizer.state_dict()
        state: dict[int, dict] = {}
        for p, k, key in opt_keys:
            if isinstance(key, list):  # a sharded bucket's: its shard of the whole tensors (a scalar as it is)
                v = want[key[0]] if want[key[0]].dim() == 0 else _shard_of(_bucket_of(buckets, p), [want[x] for x in key])
            else:
                fqn = key[len("optim/"):].rsplit("/", 1)[0]
                v = select(want[key], kept[fqn]) if fqn in kept and want[key].dim() > 0 else want[key]
            state.setdefault(index[id(p)], {})[k] = v
        rt.optimizer.load_state_dict({"state": state, "param_groups": sd["param_groups"]})
    if same_plan and rng_keys[0] in want:
        rt._rng = tuple(want[k] for k in rng_keys)
    if scaler_keys and scaler_keys[0] in want:
        scaler.load({k[len(SCALER):]: want[k] for k in scaler_keys})


def _bucket_of(buckets: list, shard: torch.Tensor):
    return next(bk for bk in buckets if bk.shard is shard)


def _shard_of(bk, tensors: list[torch.Tensor]) -> torch.Tensor:
    """This member's shard of a bucket, cut from its parameters' whole tensors (of one kind)."""
    return bk.shard_of(tensors)


# ---- reading DCP's metadata without running code ------------------------------------------
_ALLOWED = {
    "torch.distributed.checkpoint.metadata": None,  # every class of the module
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.distributed.checkpoint.planner": {"WriteItemType", "LoadItemType"},
    "torch": {"Size"},
    "torch.serialization": {"_get_layout"},  # a layout by name ("torch.strided")
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},  # StorageMeta.checkpoint_id
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata``: its dataclasses, ``torch.Size``, torch's dtype, layout and
    memory-format constants and paths (the globals DCP's metadata of torch 2.13 names, 2026-11-29);
    any other global is refused."""

    def find_class(self, module: str, name: str):
        allowed = _ALLOWED.get(module, set())
        if module in _ALLOWED and (allowed is None or name in allowed):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not DCP metadata")


class SafeReader(dcp.FileSystemReader):
    """DCP's file-system reader whose ``.metadata`` is read by :class:`_MetadataUnpickler`."""

    def read_metadata(self, *args, **kwargs):
        from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

        path = Path(self.path) / ".metadata"
        try:
            meta = _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
        except (OSError, pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as e:
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise CheckpointError(f"{path}: not DCP metadata: {why}") from None
        if not isinstance(meta, Metadata):
            raise CheckpointError(f"{path}: not DCP metadata: a {type(meta).__name__}")
        if getattr(meta, "storage_meta", None) is None:
            meta.storage_meta = StorageMeta()
        meta.storage_meta.load_id = self.load_id
        return meta
