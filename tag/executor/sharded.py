"""How the executor runs sharded data parallelism (``zero1`` / ``zero2`` / ``zero3``,
:mod:`tag.parallel.sharded`): the plan's own data-parallel schedule, each rank with a
:class:`ShardedRank` hook that shards the training state of its gradient buckets.

Per gradient bucket of a sharded group (:attr:`Schedule.buckets <tag.parallel.Schedule.buckets>`:
its groups' parameters in the order :meth:`RankRuntime.bucket_flat
<tag.executor.runtime.RankRuntime.bucket_flat>` concatenates their gradients), the parameters are
one flat buffer padded to a multiple of the shard group's size ``S``; the rank of index ``i`` in
its shard group owns elements ``[i L/S, (i+1) L/S)`` of it, as FSDP2 shards a ``fully_shard``
unit's flat parameter (``FSDPParamGroup``: one ``all_gather_into_tensor`` of the concatenated
shards before use, one ``reduce_scatter_tensor`` of the concatenated gradients after the backward):

* the optimizer (:func:`tag.executor.optim.make_optimizer`, the runtime's own, made over the shard
  parameters instead: ``RankRuntime.optimizer``, so ``ranks.json``'s ``optimizer_state_bytes`` is
  the shard's) steps the rank's shard of every bucket; Adam and SGD are element-wise, so the
  shards' steps are the whole parameter's step cut in pieces;
* gradients: ``zero1`` all-reduces the bucket (the schedule's collective) and takes its shard;
  ``zero2`` / ``zero3`` ``reduce_scatter_tensor`` it over the shard group
  (:meth:`bucket_sync`), then, hybrid sharding, ``all_reduce`` the shard across the shard groups;
* parameters: ``zero1`` / ``zero2`` all-gather the updated shards into the full parameters
  before the next segment runs (or before they are saved); ``zero3`` holds the shards only: before
  a fused segment of the rank's program (:mod:`tag.executor.fuse`) it all-gathers the buckets of
  the parameters the segment reads, and frees them after it. A ZeRO-3 group's forward and
  backward each run as a segment of their own (:meth:`ShardedRank.separate_groups`), so a
  group's parameters are gathered for it alone; when a segment starts, the gather of the next
  segment's parameters is issued (``async_op``: FSDP's prefetch) and waited for when that segment
  starts.

Collectives run on process groups the shard groups create themselves
(``use_local_synchronization``: only members take part), on gloo as on NCCL: torch 2.13's gloo
has ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` (checked 2026-11-29).

Why not FSDP2's ``fully_shard`` directly: it wraps ``nn.Module``s and shards their parameters
as ``DTensor``s, gathering them in module pre-forward / pre-backward hooks of autograd. The executor
replays cuts of the captured *joint* graph (forward and explicit gradient ops, no autograd, no
modules: :mod:`tag.executor.runtime`), so there is no module to wrap and no hook to fire; it uses
the same collectives on the same flat layout instead. torchtitan's SimpleFSDP (FSDP on a traced
graph) inserts the gathers into the graph; here they sit between the fused segments.

Offloaded buckets (``GroupPlan.offload`` ``optimizer``, ZeRO-Offload): the shard the optimizer
steps, its gradient and its optimizer state live in host memory (``_Bucket.shard``, a tensor of
its own, pinned on CUDA); the device keeps a copy of the shard (``_Bucket.device_shard``) for the
gathers. At the sync the reduced gradient shard is copied to the host (on CUDA on a side stream,
``non_blocking``, waited for before the step); the runtime's one optimizer step then updates the
host shards on the CPU (``foreach`` kernels: a CUDA rank's optimizer is ``foreach`` rather than
``fused`` when it steps host tensors); the first gather after a change of the host shard (its
version counter: a step, a checkpoint load) copies it back to the device first (side stream,
``non_blocking``, the compute stream waiting for it). On gloo CPU ranks both copies are CPU
tensors: the copies and the separate state run, not the PCIe transfers (the CUDA path is
written for pinned memory and streams and has not been run here). ``ranks.json`` gives such a
rank's ``device_state_bytes`` (its parameters held between iterations and device shards) and
``host_state_bytes`` (host shards, their gradients and optimizer state). An offloaded group on one
device (no collective, so no schedule bucket) is a bucket of its own: a shard group of one, its
gradient taken at the sync, its gathers a copy.

The in-process runner (:func:`tag.executor.run_virtual`) sums buckets itself and never calls
:meth:`ShardedRank.bucket_sync`: there the hook stays inactive and the ranks train as plain data
parallelism (the same numbers). fp16: the runtime's dynamic loss scale unscales the gradients the
optimizer steps, the shards' here, and the ranks agree whether all are finite by one all-reduce
of the found-inf flag (:mod:`tag.executor.scaling`), as FSDP's ``ShardedGradScaler``.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

from ..parallel.schedule import Bucket
from ..parallel.sharded import shard_groups, shard_size
from .optim import make_optimizer
from .runtime import ExecutionError
from .strategies import Execution, RankHook, register_execution

EMPTY = torch.empty(0)
"""What a ZeRO-3 parameter holds between uses (its storage freed)."""


class _Bucket:
    """One sharded gradient bucket on one rank: its parameters' flat layout and shard."""

    def __init__(self, index: int, bucket, level: int, devices: list[int], shard: int, rank: int, params: dict,
                 names: list[str], numel: dict[str, int], offload: str | None = None):
        self.index, self.bucket, self.level = index, bucket, level
        self.offload = offload
        self.names = names
        """Parameter placeholders, in the order of the bucket's flat gradient."""
        self.numel = [numel[n] for n in names]
        self.total = sum(self.numel)
        self.size = shard
        self.padded = -(-self.total // shard) * shard
        self.chunk = self.padded // shard
        groups = [devices[i:i + shard] for i in range(0, len(devices), shard)]
        mine = next(grp for grp in groups if rank in grp)
        self.index_in_group = mine.index(rank)
        self.shard_members = mine
        self.cross_members = [grp[self.index_in_group] for grp in groups] if len(groups) > 1 else None
        self.shard_pg = None
        self.cross_pg = None
        self.params = [params[n] for n in names]
        self.dtype = self.params[0].dtype
        self.shapes = [p.shape for p in self.params]
        flat = self._flat_params()
        lo = self.index_in_group * self.chunk
        if level < 3:  # ZeRO-1/2: the parameters become views of the flat buffer, the shard its slice (no copy)
            self.write(flat, views=True)
            self.shard = torch.nn.Parameter(flat[lo:lo + self.chunk])
        else:
            self.shard = torch.nn.Parameter(flat[lo:lo + self.chunk].clone())
        """This rank's shard of the flat parameters, which the optimizer steps: ZeRO-1/2 a view of
        the full parameters' own slice (stepped in place), ZeRO-3 a tensor of its own (the full
        parameters are freed); offloaded: in host memory."""
        self.device_shard = self.shard
        """The shard the gathers read: the device's copy of an offloaded shard, else :attr:`shard`."""
        self._synced_version = -1  # (offloaded: the host shard's version the device copy holds)
        self._stream = None  # (CUDA: the side stream of the host copies)
        if offload:
            self._to_host()

    def _flat_params(self) -> torch.Tensor:
        flat = torch.zeros(self.padded, dtype=self.dtype, device=self.params[0].device)
        off = 0
        for p, n in zip(self.params, self.numel):
            flat[off:off + n].copy_(p.detach().reshape(-1))
            off += n
        return flat

    # ---- offload: the host shard and the device's copy ------------------------------------
    def _to_host(self) -> None:
        """Move the shard the optimizer steps to host memory (pinned on CUDA), the device keeping a copy."""
        dev = self.shard.detach()
        host = torch.empty(dev.shape, dtype=dev.dtype, pin_memory=dev.is_cuda)
        host.copy_(dev)
        self.device_shard, self.shard = dev, torch.nn.Parameter(host)
        self._synced_version = self.shard._version
        if dev.is_cuda:
            self._stream = torch.cuda.Stream(device=dev.device)

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)`` across host and device: on CUDA on the side stream after what the
        compute stream issued, ``non_blocking`` (pinned host memory), the compute stream waiting
        for it; on a CPU rank a plain copy."""
        if self._stream is None:
            dst.copy_(src)
            return
        main = torch.cuda.current_stream(self.device_shard.device)
        self._stream.wait_stream(main)
        with torch.cuda.stream(self._stream):
            dst.copy_(src, non_blocking=True)
        main.wait_stream(self._stream)

    def grad_to_host(self, grad: torch.Tensor) -> torch.Tensor:
        """The reduced gradient shard copied to host memory (waited for: the step reads it next)."""
        host = torch.empty(grad.shape, dtype=self.shard.dtype, pin_memory=grad.is_cuda)
        self._copy(host, grad)
        if self._stream is not None:
            self._stream.synchronize()
        return host

    def refresh_device(self) -> None:
        """The device copy from the host shard where the shard changed since (a step, a load)."""
        if self.offload and self.shard._version != self._synced_version:
            with torch.no_grad():
                self._copy(self.device_shard, self.shard.detach())
            self._synced_version = self.shard._version

    def gather(self, async_op: bool = False):
        """The full flat parameters: the shards all-gathered over the shard group (blocking), or
        ``(buffer, work)`` with ``async_op`` (a prefetch)."""
        self.refresh_device()
        out = torch.empty(self.padded, dtype=self.dtype, device=self.device_shard.device)
        if self.size == 1:  # (one device, offloaded: nothing to gather)
            out.copy_(self.device_shard)
            return (out, _Done()) if async_op else out
        work = dist.all_gather_into_tensor(out, self.device_shard.detach(), group=self.shard_pg, async_op=async_op)
        return (out, work) if async_op else out

    def write(self, flat: torch.Tensor, views: bool) -> None:
        """The full parameters from ``flat``: copied in (``views`` False), or views of it (ZeRO-3's
        gathered buffer, freed with them)."""
        off = 0
        for p, n, shape in zip(self.params, self.numel, self.shapes):
            part = flat[off:off + n].view(shape)
            if views:
                p.data = part
            else:
                p.data.copy_(part)
            off += n

    def free(self) -> None:
        for p in self.params:
            p.data = EMPTY.to(p.device, p.dtype)

    def padded_flat(self, flat: torch.Tensor) -> torch.Tensor:
        if flat.numel() == self.padded:
            return flat
        out = flat.new_zeros(self.padded)
        out[:flat.numel()] = flat
        return out


class ShardedRank(RankHook):
    """One rank's sharded state (module docstring); active once the distributed comm's first
    bucket sync calls :meth:`bucket_sync`."""

    def __init__(self, plan, rank: int):
        super().__init__(0)
        self.plan = plan
        self.rank = rank
        self._alone = frozenset(g for g, gp in enumerate(plan.groups) if gp.sync == "zero3" and rank in gp.devices)
        self._prefetched: dict[int, tuple] = {}  # bucket index -> (buffer, work) of a gather in flight
        self.buckets: dict[int, _Bucket] = {}
        """Schedule bucket index -> its sharded state on this rank (sharded groups' buckets)."""
        self.active = False
        self.stale = False
        """ZeRO-1/2: the shards were stepped, the full parameters not yet gathered."""
        self._of_param: dict[int, _Bucket] = {}  # id(parameter) -> its ZeRO-3 bucket
        self._exported: dict[int, list[int]] = {}
        """ZeRO-3 bucket index -> positions (in :attr:`_Bucket.names`) of its parameters a member
        of its shard group sends to another rank."""
        self._kept: dict[int, tuple] = {}  # id(parameter) -> (it, its gathered value): sent ones, for the iteration
        self._target: dict[str, str] = {}  # parameter placeholder -> state-dict name

    # ---- activation ----------------------------------------------------------------------
    def _activate(self, rt) -> None:
        s = rt.schedule
        self._target = dict(s.param_target)
        for i, b in enumerate(s.buckets):
            gp = self.plan.groups[b.groups[0]] if b.groups[0] >= 0 else None
            if gp is None or not gp.sync.startswith("zero") or rt.rank not in gp.devices:
                continue
            names = [ph for g in b.groups for ph in rt._synced(g)]
            if any(ph not in rt.params for ph in names):
                raise ExecutionError(f"rank {self.rank}: bucket of groups {list(b.groups)} holds parameters this "
                                     "rank does not (a tied copy); expected no sharded group beside them")
            self.buckets[i] = _Bucket(i, b, int(gp.sync[4:]), list(gp.devices), shard_size(gp), rt.rank, rt.params,
                                      names, s.param_numel, gp.offload)
        bucketed = {g for b in s.buckets for g in b.groups}
        for g, gp in enumerate(self.plan.groups):  # an offloaded lone device: no collective, a bucket of its own
            names = rt._synced(g)
            if gp.offload and gp.devices == [rt.rank] and g not in bucketed and names:
                self.buckets[-1 - g] = _Bucket(-1 - g, Bucket((g,), None, 0), int(gp.sync[4:]), [rt.rank], 1, rt.rank,
                                               rt.params, list(names), s.param_numel, gp.offload)
        made = shard_process_groups(self.plan, rt.device)
        for bk in self.buckets.values():
            for attr, members in (("shard_pg", bk.shard_members), ("cross_pg", bk.cross_members)):
                if members is not None and len(members) > 1:
                    setattr(bk, attr, made[tuple(members)])
        held = {id(p) for bk in self.buckets.values() for p in bk.params}
        rest = [p for p in rt.params.values() if id(p) not in held]  # (parameters of unsharded groups)
        shards = [bk.shard for bk in self.buckets.values()]
        host = any(bk.offload for bk in self.buckets.values())  # (a host shard: foreach over both devices)
        rt.optimizer = make_optimizer(rt.optimizer_name, [*rest, *shards], "cpu" if host else rt.device)
        rt._grad_keys = [(p, k) for p, k in rt._grad_keys if id(p) not in held]
        sent = {(m.name, m.src) for st in s.steps if st.kind == "transfer" for m in st.moves if m.src != m.dst}
        for i, bk in self.buckets.items():
            if bk.level == 3:
                for p in bk.params:
                    self._of_param[id(p)] = bk
                bk.free()
                out = [j for j, ph in enumerate(bk.names) if any((ph, d) in sent for d in bk.shard_members)]
                if out:
                    self._exported[i] = out
        self.active = True

    def start(self, rt) -> None:
        """Activate before the first iteration (the distributed worker calls it): the shard
        groups' process groups are made while every rank is at the same point (made lazily at the
        first bucket's sync, a stage's ranks of a pipeline waited there for ever, 4 gloo ranks)."""
        if not self.active:
            self._activate(rt)

    def begin_iteration(self, rt) -> None:
        """Before any step: ZeRO-1/2's full parameters from the shards stepped since; ZeRO-3's
        parameters sent to other ranks (a parameter read by another pipeline stage's op: the mlp's
        ``net.2.bias``, read by the stage before its group's): their buckets gathered by every
        member of the shard group, whichever of them sends, those parameters kept (a copy) until
        the sync (:meth:`synced`), the rest freed at once. A sent parameter is read at the
        transfer, outside any of the sender's segments: without this, a ZeRO-1/2 rank sent the
        parameters of the step before and a ZeRO-3 rank its freed, empty, parameter."""
        if not self.active:
            return
        self._refresh()
        for i, sent in self._exported.items():
            bk = self.buckets[i]
            if all(id(bk.params[j]) in self._kept for j in sent):  # (a tag run batch after the step's first)
                continue
            flat, starts = bk.gather(), [0, *itertools.accumulate(bk.numel)]
            for j in sent:
                value = flat[starts[j]:starts[j + 1]].view(bk.shapes[j]).clone()
                bk.params[j].data = value
                self._kept[id(bk.params[j])] = (bk.params[j], value)

    # ---- gradient sync (tag.executor.comm.DistComm) --------------------------------------
    def bucket_sync(self, rt, index: int):
        """How bucket ``index``'s collective runs on this rank: a function starting it on the flat
        gradients (a work handle), or None for the schedule's own (all-reduce)."""
        if not self.active:
            self._activate(rt)
        bk = self.buckets.get(index)
        if bk is None or bk.level == 1:
            return None

        def start(flat: torch.Tensor):
            if bk.size == 1:  # (one device, offloaded: the gradient is its shard)
                bk.grad = bk.padded_flat(flat)
                return _Done()
            bk.grad = torch.empty(bk.chunk, dtype=flat.dtype, device=flat.device)
            return dist.reduce_scatter_tensor(bk.grad, bk.padded_flat(flat), group=bk.shard_pg, async_op=True)

        return start

    def synced(self, rt) -> None:
        """Every bucket's collective of the iteration completed: the shards' gradients (hybrid:
        all-reduced across the shard groups), for the runtime's optimizer step."""
        if not self.active:
            return
        for bk in self.buckets.values():
            if bk.level == 1 or getattr(bk, "grad", None) is None:  # all-reduced by the schedule's collective
                # (or a lone device's, no collective): take the shard
                flat = bk.padded_flat(rt.bucket_flat(bk.bucket))
                bk.grad = flat[bk.index_in_group * bk.chunk:(bk.index_in_group + 1) * bk.chunk].clone()
            elif bk.cross_pg is not None:
                dist.all_reduce(bk.grad, group=bk.cross_pg)
            bk.shard.grad = bk.grad_to_host(bk.grad) if bk.offload else bk.grad.to(bk.shard.dtype)
            bk.grad = None
        for p, _ in self._kept.values():
            p.data = EMPTY.to(p.device, p.dtype)
        self._kept.clear()
        self.stale = True

    # ---- parameters around segments (tag.executor.runtime.RankRuntime.run_segment) ----------
    def separate_groups(self) -> frozenset[int]:
        """This rank's ZeRO-3 groups: each compute step a segment of its own, so that a group's
        parameters are gathered for its forward or backward alone."""
        return self._alone

    def _needs(self, seg, env: dict | None = None) -> list[int]:
        """Buckets of the ZeRO-3 parameters segment ``seg`` reads: held ones, and with ``env`` those
        it reads from ``env`` (a parameter another unit owns, moved by a local transfer: the
        parameter object itself)."""
        held = list(seg.static)
        if env is not None:
            held += [env[k] for k in seg.inputs if k in env]
        return sorted({self._of_param[id(t)].index for t in held if id(t) in self._of_param})

    def before_segment(self, rt, seg) -> list:
        """Gather what the segment reads (waiting for its prefetch where one was issued), then
        issue the gathers of the next segment reading ZeRO-3 parameters (the prefetch, as FSDP's);
        returns what :meth:`after_segment` frees."""
        if not self.active:
            return []
        self._refresh()
        need = self._needs(seg, rt.env)
        for i in need:
            bk = self.buckets[i]
            hit = self._prefetched.pop(i, None)
            if hit is not None:
                hit[1].wait()
                bk.write(hit[0], views=True)
            else:
                bk.write(bk.gather(), views=True)
        starts = sorted(rt.program.segments)
        for start in starts[starts.index(seg.start) + 1:]:  # (within the iteration: the shards change at the step)
            later = self._needs(rt.program.segments[start])
            if later:
                for i in later:
                    if i not in need and i not in self._prefetched:
                        self._prefetched[i] = self.buckets[i].gather(async_op=True)
                break
        return need

    def after_segment(self, rt, gathered: list) -> None:
        for i in gathered:
            self.buckets[i].free()
        for p, value in self._kept.values():  # (a sent parameter stays until the sync)
            p.data = value

    def _refresh(self) -> None:
        """ZeRO-1/2 after a step: the full parameters from the updated shards."""
        if not self.stale:
            return
        for bk in self.buckets.values():
            if bk.level < 3:
                bk.write(bk.gather(), views=False)
        self.stale = False

    # ---- saving -------------------------------------------------------------------------
    def param_state(self) -> object:
        """Gathers the full parameters (every rank saving calls it, in the same order)."""
        if not self.active:
            return None
        self._refresh()
        return {bk.names[j]: t for bk in self.buckets.values() if bk.level == 3
                for j, t in enumerate(_split(bk.gather(), bk.numel, bk.shapes))}

    def full_params(self, gathered: list) -> dict[str, torch.Tensor]:
        params, state = gathered[0]
        if not state:
            return dict(params)
        target = {ph: name for ph, name in zip(self._names(), self._targets())}
        return {**params, **{target[ph]: t.cpu() for ph, t in state.items()}}

    def state_bytes(self, rt) -> dict[str, int]:
        """With offloaded buckets: ``device_state_bytes`` (the parameters the rank holds between
        iterations and its device shards) and ``host_state_bytes`` (its host shards, their
        gradients and the optimizer state of those shards)."""
        off = [bk for bk in self.buckets.values() if bk.offload]
        if not off:
            return {}

        def nbytes(t) -> int:
            return 0 if t is None else t.numel() * t.element_size()

        state = rt.optimizer.state if rt.optimizer is not None else {}
        host = sum(nbytes(bk.shard) + nbytes(bk.shard.grad) + sum(nbytes(v) for v in state.get(bk.shard, {}).values()
                                                                 if isinstance(v, torch.Tensor) and v.dim() > 0)
                   for bk in off)
        device = sum(nbytes(p) for p in rt.params.values()) + sum(nbytes(bk.device_shard) for bk in off
                                                                  if bk.level == 3)  # (ZeRO-1/2's: a view)
        return {"device_state_bytes": device, "host_state_bytes": host}

    def _names(self) -> list[str]:
        return [n for bk in self.buckets.values() for n in bk.names]

    def _targets(self) -> list[str]:
        return [self._target[n] for n in self._names()]



def shard_process_groups(plan, device: torch.device) -> dict[tuple[int, ...], object]:
    """Members -> process group of every shard group and every hybrid cross-group group of
    ``plan``'s sharded groups; every rank of the world calls it, making them in the same order
    (plan order). Not ``use_local_synchronization``: torch 2.13 names such a group by its ranks
    and the number of groups the calling rank belongs to already, which differs between the ranks
    of a pipeline stage whose transfer links differ (4 gloo ranks, dp=2,pp=2,zero=3 on the mlp:
    rank 1 links to ranks 2 and 3, rank 0 to rank 2 alone), so the members met under different
    names and waited for ever in the group's creation. The timeout is the world's on ``device``'s
    backend (a stuck peer is an error)."""
    made: dict[tuple[int, ...], object] = {}
    for gp in plan.groups:
        if not gp.sync.startswith("zero") or len(gp.devices) < 2:
            continue
        groups = shard_groups(gp)
        cross = [list(col) for col in zip(*groups)] if len(groups) > 1 else []
        for members in (*groups, *cross):
            if len(members) > 1 and tuple(members) not in made:
                made[tuple(members)] = dist.new_group(list(members), timeout=world_timeout(device))
    return made


def world_timeout(device: torch.device):
    """The default process group's timeout on ``device``'s backend (``init_process_group``'s;
    None: torch's default)."""
    try:
        return dist.distributed_c10d._get_default_group()._get_backend(device).options._timeout
    except (AttributeError, RuntimeError, ValueError):
        return None


class _Done:
    """A completed collective's work handle (a shard group of one)."""

    def wait(self) -> bool:
        return True


def _split(flat: torch.Tensor, numel: list[int], shapes: list) -> list[torch.Tensor]:
    out, off = [], 0
    for n, shape in zip(numel, shapes):
        out.append(flat[off:off + n].view(shape).clone())
        off += n
    return out


class ShardedExecution(Execution):
    """The plan's own schedule, one rank per device; ranks of sharded groups get a :class:`ShardedRank`."""

    def hook(self, rank: int) -> RankHook | None:
        """Every rank's, those outside sharded groups too: each makes every shard group's process
        group (:func:`shard_process_groups`); one without sharded buckets runs as without it."""
        return ShardedRank(self.plan, rank)


def _factory(plan, graph) -> Execution:
    return ShardedExecution(plan)


for _name in ("zero1", "zero2", "zero3"):
    register_execution(_name, _factory)

__all__ = ["ShardedExecution", "ShardedRank"]
