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

Mixed precision (bf16 / fp16), ZeRO-3: as FSDP2 under ``MixedPrecisionPolicy(param_dtype=bf16)``
(torch 2.13's torch/distributed/fsdp/_fully_shard/_fsdp_param.py ``FSDPParam.all_gather_inputs``
casts the local shard to ``param_dtype`` before the all-gather; _fsdp_collectives.py
``foreach_all_gather`` copies the inputs in on the gather's stream and gathers a unit's mixed
dtypes as bytes), each gather casts the rank's shard of the weights autocast reads only through a
low-precision cast (:func:`tag.graph.precision.low_gathered_params`: the matmuls' weights and
biases) and gathers those in it, 2 bytes an element, the others (norm weights, an embedding table)
in fp32; a bucket with both is one ``uint8`` all-gather, copied out into a buffer per dtype
(:class:`_Part`). The unsharded weights are then bf16 views of the gathered buffer, and the
graph's casts of them return them as they are (:func:`tag.executor.fuse.cast_as_needed`, as
autocast reads a ``param_dtype`` parameter): no fp32 copy and no second bf16 copy while the group
runs. Cast element by element, the gathered casts are the casts of the gathered fp32 weights, bit
for bit (the parameters after training equal ZeRO-2's, tests/test_sharded_casts.py). Saved and
sent parameters are gathered in fp32. The gradients are reduce-scattered in fp32: the graph's
gradient of an fp32 master weight is fp32 (autocast's cast backward upcasts the bf16 gradient
before the sum over its uses), as FSDP2 with ``reduce_dtype=torch.float32`` (torchtitan's
``mixed_precision_reduce`` default). FSDP2's own default ``reduce_dtype=None`` reduce-scatters in
the gradient's dtype, ``param_dtype`` there (_fsdp_collectives.py ``foreach_reduce``:
``reduce_dtype = reduce_dtype or grad_dtype``), half the bytes but summed in bf16, which the
equality with single-process training would not survive.

Mixed precision, ZeRO-1/2: the updated shards are all-gathered by the same rule, the cast-only
weights' shards cast to the low precision before the gather (2 bytes an element), the others in
fp32, as the frameworks gather their low-precision model weights after the step: DeepSpeed's
ZeRO-1/2 (deepspeedai/DeepSpeed edaa722, deepspeed/runtime/zero/stage_1_and_2.py ``step``: the
fp32 partition copied into ``bit16_partitions[partition_id]``, then ``all_gather_dp_groups`` of
``bit16_groups_flat``) and Megatron-LM's distributed optimizer (NVIDIA/Megatron-LM d98e8a6,
megatron/core/optimizer/distrib_optimizer.py ``_copy_main_params_to_model_params``: the fp32 main
shards copied into the bucket's ``param_data``, the model parameters' dtype, which the parameter
all-gather then moves). Such a bucket's shard is the fp32 master copy, a tensor of its own in the
flat layout above (:attr:`_Bucket.own_shard`), and the gathered values are copied into the full
fp32 parameters: the others' shards arrive rounded to bf16 / fp16, which changes nothing the
graph computes (every read of those weights is a cast to that dtype, and the cast of a rounded
value is the value), while the optimizer steps the exact master shard; the parameters saved are
gathered from the master shards in fp32. The device holds that shard besides the full parameters
(``P / S`` more than a view's; the simulator counts it, :mod:`tag.sim.sharded`).

A weight tied across pipeline stages (:class:`tag.parallel.schedule.Tied`: its gradient
all-reduced over both stages' replicas by a bucket of its own) is read whole by both stages; on a
rank whose group holding the copy is sharded it is a level-1 bucket over that group's shard
groups (:meth:`ShardedRank._tied_group`): its optimizer state and step sharded, the updated shards
all-gathered after the step.

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

import torch
import torch.distributed as dist

from ..graph.precision import LOW_DTYPE, low_gathered_params
from ..parallel.schedule import Bucket
from ..parallel.sharded import shard_groups, shard_size
from .optim import make_optimizer
from .runtime import ExecutionError
from .strategies import Execution, RankHook, register_execution

EMPTY = torch.empty(0)
"""What a ZeRO-3 parameter holds between uses (its storage freed)."""


class _Part:
    """Parameters of a bucket gathered in one dtype: positions ``idx`` (in :attr:`_Bucket.names`)
    concatenated and padded to a multiple of the shard group's size, ``chunk`` elements a member."""

    def __init__(self, dtype: torch.dtype, idx: list[int], numel: list[int], shard: int):
        self.dtype, self.idx = dtype, idx
        self.numel = [numel[i] for i in idx]
        self.padded = -(-sum(self.numel) // shard) * shard
        self.chunk = self.padded // shard


class _Bucket:
    """One sharded gradient bucket on one rank: its parameters' flat layout and shard.

    The flat layout is rank-major: member ``i`` of the shard group owns row ``i`` of ``[S, chunk]``,
    the concatenation of its chunk of each :class:`_Part` (one part, the parameters in bucket
    order, unless a ZeRO-3 bucket gathers some in the low precision: those first, the rest after).
    With one part it is the parameters' concatenation padded to a multiple of ``S``."""

    def __init__(self, index: int, bucket, level: int, devices: list[int], shard: int, rank: int, params: dict,
                 names: list[str], numel: dict[str, int], offload: str | None = None,
                 low: frozenset[str] = frozenset(), low_dtype: torch.dtype | None = None):
        self.index, self.bucket, self.level = index, bucket, level
        self.offload = offload
        self.names = names
        """Parameter placeholders, in the order of the bucket's flat gradient."""
        self.numel = [numel[n] for n in names]
        self.total = sum(self.numel)
        self.size = shard
        self.params = [params[n] for n in names]
        self.dtype = self.params[0].dtype
        """The parameters' (master) dtype: the shard's, its gradient's and the optimizer's."""
        cast = [i for i, n in enumerate(names) if n in low] if low_dtype is not None else []
        rest = [i for i in range(len(names)) if i not in set(cast)]
        self.parts = [_Part(dt, idx, self.numel, shard) for dt, idx in ((low_dtype, cast), (self.dtype, rest)) if idx]
        """Under mixed precision: the parameters gathered in the low precision (every read a cast
        to it, :func:`tag.graph.precision.low_gathered_params`) and the rest."""
        self.own_shard = level == 3 or bool(cast)
        """The shard a tensor of its own (ZeRO-3; ZeRO-1/2 gathering some parameters in the low
        precision, whose full fp32 parameters then hold the others' shards rounded to it): not a
        view of the full parameters' slice."""
        self.chunk = sum(pt.chunk for pt in self.parts)
        self.padded = self.chunk * shard
        groups = [devices[i:i + shard] for i in range(0, len(devices), shard)]
        mine = next(grp for grp in groups if rank in grp)
        self.index_in_group = mine.index(rank)
        self.shard_members = mine
        self.cross_members = [grp[self.index_in_group] for grp in groups] if len(groups) > 1 else None
        self.shard_pg = None
        self.cross_pg = None
        self.shapes = [p.shape for p in self.params]
        flat = self._flat_params()
        lo = self.index_in_group * self.chunk
        if not self.own_shard:  # ZeRO-1/2: the parameters become views of the flat buffer, the shard its slice
            self.write([flat], views=True)
            self.shard = torch.nn.Parameter(flat[lo:lo + self.chunk])
        else:
            self.shard = torch.nn.Parameter(flat[lo:lo + self.chunk].clone())
        """This rank's shard of the flat parameters, which the optimizer steps (the master copy):
        ZeRO-1/2 a view of the full parameters' own slice (stepped in place), else a tensor of its
        own (:attr:`own_shard`; ZeRO-3's full parameters are freed); offloaded: in host memory."""
        self.device_shard = self.shard
        """The shard the gathers read: the device's copy of an offloaded shard, else :attr:`shard`
        (None: an offloaded ZeRO-1/2 shard of its own, copied to the device for each gather)."""
        self._synced_version = -1  # (offloaded: the host shard's version the device copy holds)
        self._stream = None  # (CUDA: the side stream of the host copies)
        if offload:
            self._to_host()

    def _flat_params(self) -> torch.Tensor:
        return self._rank_major([p.detach().reshape(-1) for p in self.params])

    def _rank_major(self, values: list[torch.Tensor]) -> torch.Tensor:
        """[padded] the flat layout (class docstring) of ``values`` (one 1-D tensor a parameter, in
        bucket order), padding zero."""
        v0 = values[0]
        flats = []
        for pt in self.parts:
            flat = torch.zeros(pt.padded, dtype=v0.dtype, device=v0.device)
            off = 0
            for i, n in zip(pt.idx, pt.numel):
                flat[off:off + n].copy_(values[i])
                off += n
            flats.append(flat)
        if len(flats) == 1:
            return flats[0]
        out = torch.empty(self.size, self.chunk, dtype=v0.dtype, device=v0.device)
        col = 0
        for pt, flat in zip(self.parts, flats):
            out[:, col:col + pt.chunk].copy_(flat.view(self.size, pt.chunk))
            col += pt.chunk
        return out.view(-1)

    # ---- offload: the host shard and the device's copy ------------------------------------
    def _to_host(self) -> None:
        """Move the shard the optimizer steps to host memory (pinned on CUDA), the device keeping a
        copy (ZeRO-3's gathers read it at every use); a ZeRO-1/2 shard of its own (:attr:`own_shard`)
        is copied to the device for each gather after the step instead, the device holding the full
        parameters only, as with a view."""
        dev = self.shard.detach()
        host = torch.empty(dev.shape, dtype=dev.dtype, pin_memory=dev.is_cuda)
        host.copy_(dev)
        self.device_shard, self.shard = dev, torch.nn.Parameter(host)
        self._synced_version = self.shard._version
        if dev.is_cuda:
            self._stream = torch.cuda.Stream(device=dev.device)
        if self.level < 3 and self.own_shard:
            self.device_shard = None

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)`` across host and device: on CUDA on the side stream after what the
        compute stream issued, ``non_blocking`` (pinned host memory), the compute stream waiting
        for it; on a CPU rank a plain copy."""
        if self._stream is None:
            dst.copy_(src)
            return
        main = torch.cuda.current_stream(dst.device if dst.is_cuda else src.device)
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
        if self.offload and self.device_shard is not None and self.shard._version != self._synced_version:
            with torch.no_grad():
                self._copy(self.device_shard, self.shard.detach())
            self._synced_version = self.shard._version

    def _gather_source(self) -> torch.Tensor:
        """The shard the gathers read: the device's (copy of the) shard, or a transient device copy
        of the host shard (:meth:`_to_host`)."""
        if self.device_shard is not None:
            return self.device_shard.detach()
        out = torch.empty(self.shard.shape, dtype=self.shard.dtype, device=self.params[0].device)
        with torch.no_grad():
            self._copy(out, self.shard.detach())
        return out

    def gather(self, async_op: bool = False, low: bool = True):
        """The full parameters, one flat buffer a :class:`_Part`: the shards all-gathered over the
        shard group (blocking), or with ``async_op`` a :class:`_Gathering` (a prefetch). ``low``:
        each part in its gather dtype (under mixed precision the shard of the cast-only parameters
        cast before the gather, 2 bytes an element moved: ZeRO-3's held so, as FSDP2's
        ``param_dtype``, ZeRO-1/2's copied into the full fp32 parameters), else all in the master
        dtype (the parameters saved or sent)."""
        self.refresh_device()
        src, col, pieces = self._gather_source(), 0, []
        for pt in self.parts:
            pieces.append(src[col:col + pt.chunk].to(pt.dtype if low else self.dtype))  # (no copy in its dtype)
            col += pt.chunk
        if len(pieces) == 1:
            inp = pieces[0]
        else:  # (mixed dtypes: one gather of the bytes, FSDP2's uint8 all-gather, _fsdp_collectives.py)
            inp = torch.cat([x.contiguous().view(torch.uint8) for x in pieces])
        out = torch.empty(inp.numel() * self.size, dtype=inp.dtype, device=inp.device)
        if self.size == 1:  # (one device, offloaded: nothing to gather)
            out.copy_(inp)
            work = _Done()
        else:
            work = dist.all_gather_into_tensor(out, inp, group=self.shard_pg, async_op=async_op) or _Done()
        done = _Gathering(self, out, [x.dtype for x in pieces], work)
        return done if async_op else done.result()

    def values(self, flats: list[torch.Tensor]) -> list[torch.Tensor]:
        """The parameters (views, shaped, in bucket order) of :meth:`gather`'s buffers."""
        out: list = [None] * len(self.names)
        for pt, flat in zip(self.parts, flats):
            off = 0
            for i, n in zip(pt.idx, pt.numel):
                out[i] = flat[off:off + n].view(self.shapes[i])
                off += n
        return out

    def split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """The parameters (shaped, in bucket order) of ``flat``, a tensor in the flat layout (the
        shards of one kind all-gathered: parameters, an optimizer moment)."""
        if len(self.parts) == 1:
            return self.values([flat])
        rows, col, flats = flat.view(self.size, self.chunk), 0, []
        for pt in self.parts:
            flats.append(rows[:, col:col + pt.chunk].reshape(-1))
            col += pt.chunk
        return self.values(flats)

    def shard_of(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """This member's shard of ``tensors`` (one of kind a parameter, whole, in bucket order)."""
        lo = self.index_in_group * self.chunk
        return self._rank_major([t.reshape(-1) for t in tensors])[lo:lo + self.chunk].clone()

    def write(self, flats: list[torch.Tensor], views: bool) -> None:
        """The full parameters from :meth:`gather`'s buffers: copied in (``views`` False), or views
        of them (ZeRO-3's gathered buffers, freed with them; a low-precision part's parameters
        then have its dtype until freed)."""
        for p, value in zip(self.params, self.values(flats)):
            if views:
                p.data = value
            else:
                p.data.copy_(value)

    def set_full(self, tensors: list[torch.Tensor]) -> None:
        """ZeRO-1/2: the full parameters from whole tensors (bucket order; a checkpoint's)."""
        for p, t in zip(self.params, tensors):
            p.data.copy_(t.reshape(p.shape))

    def free(self) -> None:
        for p in self.params:
            p.data = EMPTY.to(p.device, p.dtype)

    def padded_flat(self, flat: torch.Tensor) -> torch.Tensor:
        """The flat layout (class docstring) of ``flat``, the parameters' gradients concatenated in
        bucket order (the schedule's bucket)."""
        if len(self.parts) > 1:
            return self._rank_major(list(torch.split(flat[:self.total], self.numel)))
        if flat.numel() == self.padded:
            return flat
        out = flat.new_zeros(self.padded)
        out[:flat.numel()] = flat
        return out


class _Gathering:
    """A gather in flight: :meth:`result` waits for it and returns the parts' flat buffers
    (several parts: copied out of the byte buffer, as FSDP2's ``foreach_all_gather_copy_out``)."""

    def __init__(self, bucket: _Bucket, out: torch.Tensor, dtypes: list[torch.dtype], work):
        self.bucket, self.out, self.dtypes, self.work = bucket, out, dtypes, work

    def result(self) -> list[torch.Tensor]:
        self.work.wait()
        parts = self.bucket.parts
        if len(parts) == 1:
            return [self.out]
        rows = self.out.view(self.bucket.size, -1)  # [S, bytes a member]
        out, col = [], 0
        for pt, dt in zip(parts, self.dtypes):
            nb = pt.chunk * torch.empty(0, dtype=dt).element_size()
            out.append(rows[:, col:col + nb].contiguous().view(dt).reshape(-1))
            col += nb
        return out


class ShardedRank(RankHook):
    """One rank's sharded state (module docstring); active once the distributed comm's first
    bucket sync calls :meth:`bucket_sync`."""

    def __init__(self, plan, rank: int, low: frozenset[str] = frozenset(), low_dtype: torch.dtype | None = None):
        super().__init__(0)
        self.plan = plan
        self.rank = rank
        self.low, self.low_dtype = low, low_dtype
        """Placeholders of the parameters ZeRO-3 gathers in ``low_dtype`` (:class:`_Bucket`)."""
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
        self._gather_bytes: dict[int, int] = {}  # ZeRO-3 bucket index -> bytes its last gather for a segment returned
        self._step_gather_bytes: dict[int, int] = {}  # ZeRO-1/2 bucket index -> bytes its last gather after a step

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
                                      names, s.param_numel, gp.offload, self.low, self.low_dtype)
        for i, b in enumerate(s.buckets):  # a weight tied across stages: ZeRO-1 over the holding group's shard groups
            gp = self._tied_group(rt, b.groups[0])
            if gp is not None:
                self.buckets[i] = _Bucket(i, b, 1, list(gp.devices), shard_size(gp), rt.rank, rt.params,
                                          list(rt._synced(b.groups[0])), s.param_numel)
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
        rt.hold_shards(make_optimizer(rt.optimizer_name, [*rest, *shards], "cpu" if host else rt.device), held)
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

    def _tied_group(self, rt, group: int):
        """The plan group whose copy of the tied weight of sync group ``group`` (negative) this rank
        holds, where that group is sharded (``zero*`` over several devices, not offloaded: as
        :func:`tag.sim.engine._zero`); else None (held whole). Both stages read the weight and its
        gradient is all-reduced over both, so each stage's copy is ZeRO-1 over its own group's
        shard groups (Megatron-LM's distributed optimizer shards each stage's embedding over its
        data-parallel group): the weight and the summed gradient whole, the optimizer state and
        the step sharded, the updated shards all-gathered after the step."""
        if group >= 0:
            return None
        t = next((t for t in rt.schedule.tied.values() if t.group == group), None)
        if t is None or t.param not in rt.params:
            return None
        for u in (t.owner, t.grad_unit, *sorted(t.holders)):
            gp = self.plan.groups[u[0]]
            if rt.rank in gp.devices:
                ok = gp.sync.startswith("zero") and not gp.offload and len(gp.devices) > 1
                return gp if ok else None
        return None

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
            full = bk.values(bk.gather(low=False))  # (sent as the master dtype: the receiver's graph reads it so)
            for j in sent:
                value = full[j].clone()
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
            flats = hit.result() if hit is not None else bk.gather()
            self._gather_bytes[i] = sum(x.numel() * x.element_size() for x in flats)
            bk.write(flats, views=True)
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
        for i, bk in self.buckets.items():
            if bk.level < 3:
                flats = bk.gather()
                self._step_gather_bytes[i] = sum(x.numel() * x.element_size() for x in flats)
                bk.write(flats, views=False)
        self.stale = False

    # ---- saving -------------------------------------------------------------------------
    def param_state(self) -> object:
        """Gathers the full parameters (every rank saving calls it, in the same order)."""
        if not self.active:
            return None
        self._refresh()
        return {bk.names[j]: t.clone() for bk in self.buckets.values() if bk.own_shard
                for j, t in enumerate(bk.values(bk.gather(low=False)))}

    def full_params(self, gathered: list) -> dict[str, torch.Tensor]:
        params, state = gathered[0]
        if not state:
            return dict(params)
        target = {ph: name for ph, name in zip(self._names(), self._targets())}
        return {**params, **{target[ph]: t.cpu() for ph, t in state.items()}}

    def state_bytes(self, rt) -> dict[str, int]:
        """With ZeRO-3 buckets: ``zero3_gather_bytes``, what the last gather for a segment of each
        returned (padding included: one gather of every bucket, in its gather dtypes); with ZeRO-1/2
        buckets: ``step_gather_bytes``, what the gather of their updated shards after the last step
        returned (the same way). With
        offloaded buckets: ``device_state_bytes`` (the parameters the rank holds between
        iterations and its device shards) and ``host_state_bytes`` (its host shards, their
        gradients and the optimizer state of those shards)."""
        out = {"zero3_gather_bytes": sum(self._gather_bytes.values())} if self._gather_bytes else {}
        if self._step_gather_bytes:
            out["step_gather_bytes"] = sum(self._step_gather_bytes.values())
        off = [bk for bk in self.buckets.values() if bk.offload]
        if not off:
            return out

        def nbytes(t) -> int:
            return 0 if t is None else t.numel() * t.element_size()

        state = rt.optimizer.state if rt.optimizer is not None else {}
        host = sum(nbytes(bk.shard) + nbytes(bk.shard.grad) + sum(nbytes(v) for v in state.get(bk.shard, {}).values()
                                                                 if isinstance(v, torch.Tensor) and v.dim() > 0)
                   for bk in off)
        device = sum(nbytes(p) for p in rt.params.values()) + sum(nbytes(bk.device_shard) for bk in off
                                                                  if bk.own_shard)  # (else a view)
        return {**out, "device_state_bytes": device, "host_state_bytes": host}

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


class ShardedExecution(Execution):
    """The plan's own schedule, one rank per device; ranks of sharded groups get a :class:`ShardedRank`."""

    low: frozenset[str] = frozenset()
    """Placeholders of the parameters ZeRO-3 gathers in :attr:`low_dtype` (None: fp32 training)."""
    low_dtype: torch.dtype | None = None

    def hook(self, rank: int) -> RankHook | None:
        """Every rank's, those outside sharded groups too: each makes every shard group's process
        group (:func:`shard_process_groups`); one without sharded buckets runs as without it."""
        return ShardedRank(self.plan, rank, self.low, self.low_dtype)


def _factory(plan, graph) -> Execution:
    out = ShardedExecution(plan)
    out.low_dtype = LOW_DTYPE.get(graph.precision)
    out.low = frozenset(graph.tensors[graph.params[k].tensor].name for k in low_gathered_params(graph))
    return out


for _name in ("zero1", "zero2", "zero3"):
    register_execution(_name, _factory)

__all__ = ["ShardedExecution", "ShardedRank"]
