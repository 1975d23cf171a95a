"""One flat buffer of a unit: the shard this rank owns and, while the unit runs, the whole buffer.

The owned shard (``shard``, in the parameters' own dtype) is the master copy of this rank's part of
the unit's weights: its rows of each parameter, laid end to end (``shardwire.engine.packing``). The
user sees it as FSDP2 shows its parameters: each original parameter stays registered under its name
as an ``nn.Parameter`` holding a DTensor of the parameter's full shape, split by rows over the
layout's mesh (``Shard(0)``; a 0-dim one ``Replicate()``), whose local tensor is a view of its rows in
the shard (empty where this rank holds none). So ``model.named_parameters()`` keeps the model's names
and shapes, torch's tools (``clip_grad_norm_``, optimizers, ``get_state_dict``, DCP) see the whole
parameters they describe, and an optimizer's in-place update lands in the shard the next all-gather
sends. After backward each parameter's ``.grad`` is a DTensor of the same placement viewing this
rank's share of the reduced gradient. A parameter replaced after ``shard`` would be cut off from all
of that, which ``check_parameters`` refuses before each forward.

The all-gather fills the gathered buffer rank by rank; ``copy_out`` copies it into the parameter-major
buffer (a single tensor kept for the unit's lifetime, the same one where the two orders coincide)
that the module attributes view while the unit is gathered, shadowing the registered parameters, so
tensors autograd saved during forward see the data gathered again for backward. Both storages are
allocated for each gather and released when the unit is resharded. A gradient of the parameter-major
buffer is packed back rank by rank for its reduce-scatter. Which ranks the shard is cut for, and
which hold the same shard, is the layout's (``shardwire.engine.layout``): under ``hybrid_secondary``
the buffer also keeps, from a unit's forward to its backward, this rank's part of the gathered
buffer within its group (the secondary shard), which backward gathers from; under ``hybrid`` each
reduced share is all-reduced with the other groups' before it lands, unless the groups sync every H
steps instead: then the buffer keeps the outer optimizer's state of its shard (``outer``,
``shardwire.engine.outer``). With a quantized ``Wire``, gathers and reductions that cross nodes
carry the buffer quantized, and the buffer keeps the error-feedback residuals of its gradients'
quantization (and of its syncs').

On CUDA each buffer belongs to the stream that fills it: the gathered storage and the cast of the
shard are allocated where all-gathers run, the parameter-major copy where computation runs, a
gradient's packing, its accumulation under ``no_sync`` and its reduced share where reductions run. A
gradient autograd made on the compute stream stays alive with its reduce-scatter until the compute
stream has waited for it (``land``), so its memory is reused only after that; one kept for
accumulation is recorded to the reduce stream instead. So the caching allocator never gives a
buffer's memory to one stream while another still uses it, and the reductions in flight bound the
gradients held.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor, _DTensorSpec, _TensorMeta
from torch.utils.dlpack import from_dlpack, to_dlpack

from shardwire.comm.communicator import Pending
from shardwire.comm.wire import Wire
from shardwire.engine.layout import Layout
from shardwire.engine.outer import OuterState
from shardwire.engine.packing import Held, Packing, ParamSlot
from shardwire.engine.released import ReleasedParameter

# What the gradient's copy-in runs inside: a profiler's span, or nothing.
Span = Callable[[], contextlib.AbstractContextManager]


class FlatParam:
    def __init__(
        self,
        name: str,
        packing: Packing,
        shard: torch.Tensor,
        owners: list[list[tuple[nn.Module, str]]],
        *,
        requires_grad: bool,
        compute_dtype: torch.dtype,
        reduce_dtype: torch.dtype,
        layout: Layout,
        wire: Wire,
    ):
        self.name = name
        self.packing = packing
        self.shard = shard
        self.requires_grad = requires_grad
        self.rank = rank = layout.shard.rank  # in the shard group
        self._held = [packing.held(slot, rank) for slot in packing.slots]
        self._specs = [_spec(slot, shard.dtype, layout) for slot in packing.slots]
        self._local_shapes = [packing.local_shape(slot, rank) for slot in packing.slots]
        self.params = [self._parameter(held, spec, shape)
                       for held, spec, shape in zip(self._held, self._specs, self._local_shapes)]
        # For each slot, the module attribute dicts (and names) that expose that parameter.
        self._owners = [[(module.__dict__, attr) for module, attr in slot] for slot in owners]
        # What check_parameters compares, one row per place a parameter is registered (a tied one has
        # several): its name there, the parameter, the DTensor's storage, its local part's address,
        # and the registry (the module's _parameters) and key it must still be found under.
        self._registered = [
            (name, param, param.untyped_storage()._cdata, param._local_tensor.data_ptr(), module._parameters, attr)
            for slot, param, places in zip(packing.slots, self.params, owners)
            for name, (module, attr) in zip(slot.names, places)
        ]
        self.compute_dtype = compute_dtype
        self.reduce_dtype = reduce_dtype
        self._layout = layout
        self._comm = layout.shard
        self._param_codec = wire.param_codec
        self._grad_codec = wire.grad_codec if requires_grad else None
        # Error feedback: what quantizing this buffer's gradients lost on their way across nodes,
        # kept for the next step, by the reduction it belongs to (none where nothing is quantized).
        self.residuals: dict[str, torch.Tensor] = {}
        if self._grad_codec is not None and wire.error_feedback:
            pieces = {"reduce_scatter": self._comm.residual_for(packing.padded_numel)}
            if layout.gradient_replicas is not None:
                pieces["all_reduce"] = layout.gradient_replicas.residual_for(packing.shard_numel, all_reduce=True)
            self.residuals = {which: residual for which, residual in pieces.items() if residual is not None}
        # Sync every H steps: the anchor, the outer momentum and the sync in flight of this shard.
        self.outer: OuterState | None = None
        if layout.diloco is not None and requires_grad:
            residual = None
            if layout.diloco.codec is not None:
                residual = layout.across_groups.residual_for(packing.shard_numel, all_reduce=True)
                if residual is not None:
                    self.residuals["sync"] = residual
            self.outer = OuterState(name, shard, layout.across_groups, layout.diloco, residual)
        # The all-gather's output (rank-major), and the parameter-major buffer the modules view: one
        # tensor where the two orders coincide. Each gets its memory as it is filled (_fill): a unit
        # made on the meta device is sharded while its values are whole, and buffers allocated here
        # would hold another unit's worth of memory at that peak.
        self._gathered = torch.empty(0, dtype=compute_dtype, device=shard.device)
        self._by_param = (self._gathered if packing.ordered_alike
                          else torch.empty(0, dtype=compute_dtype, device=shard.device))
        self._copied_out = True  # the gathered buffer's contents are in the parameter-major one
        self._secondary: torch.Tensor | None = None  # hybrid_secondary, from forward to backward
        self._placeholders = [
            ReleasedParameter(slot.shape, compute_dtype, slot.names[0], name) for slot in packing.slots
        ]
        self._said_unused: set[str] = set()  # parameters a backward did not reach, said once
        self._views: list[torch.Tensor] = []
        self._accumulated: torch.Tensor | None = None  # gradient summed under no_sync, as reduced
        self.free()

    def _parameter(self, held: Held, spec: _DTensorSpec, local_shape: torch.Size) -> nn.Parameter:
        """The user's handle on a parameter: a DTensor of its full shape over its rows in the shard.

        Its local tensor is a storage of its own over those rows' memory (DLPack's alias, which keeps
        the shard alive), not a view at an offset into the shard's: torch gives a DTensor its local
        tensor's storage offset, into a storage the DTensor does not have, so one over such a view
        (and every DTensor derived from it: ``state_dict()``'s, ``detach()``'s) could not be saved
        with ``torch.save`` or copied with ``copy.deepcopy``."""
        local = from_dlpack(to_dlpack(self.shard[held.at : held.at + held.numel])).view(local_shape)
        return nn.Parameter(DTensor(local, spec, requires_grad=False), requires_grad=self.requires_grad)

    @property
    def shard_range(self) -> tuple[int, int]:
        """The [start, end) of the gathered buffer this rank's shard is."""
        return self.packing.shard_range(self.rank)

    def held_parts(self) -> Iterator[tuple[ParamSlot, nn.Parameter, Held]]:
        """Each parameter's slot, its DTensor, and what this rank holds of it."""
        yield from zip(self.packing.slots, self.params, self._held)

    def check_parameters(self) -> None:
        """Refuse a change to the parameters since ``shard`` that the engine cannot honour and would
        otherwise silently ignore. The engine computes with the gathered buffer, fills it from the shard
        and gives gradients to the parameters it made, so each parameter must still be the one registered
        under its name (not a new ``nn.Parameter``), still view its part of the shard (not a copy put in
        through ``.data``, a ``.double()`` or a ``.to(device)``), and keep its ``requires_grad``
        (trainable and frozen parameters live in separate buffers, only the trainable one reduced).

        It runs before every forward, over every parameter, so the common case is four cheap tests per
        place a parameter is registered: its registration, its flag, its storage and an address.
        ``.data = ...`` on a DTensor leaves its local part as it was and gives the DTensor another
        storage (torch then computes with neither); a conversion or a move (``model.to``, which swaps
        a DTensor's contents whole) gives its local part another address, which a part in another
        dtype or on another device cannot share. Only a failing test looks closer, to say what changed.
        """
        trainable = self.requires_grad
        for name, param, storage, local, registry, attr in self._registered:
            if (registry.get(attr) is not param or param.requires_grad is not trainable
                    or param.untyped_storage()._cdata != storage or param._local_tensor.data_ptr() != local):
                raise RuntimeError(self._describe_change(name, param, registry.get(attr)))

    def _describe_change(self, name: str, param: nn.Parameter, registered: object) -> str:
        """What happened to parameter ``name`` since ``shard``, and what to do instead, in one line."""
        since = "after shardwire.shard"
        now = registered if isinstance(registered, torch.Tensor) else param
        now = now._local_tensor if isinstance(now, DTensor) else now
        if now.device != self.shard.device or now.dtype != self.shard.dtype:
            moved = f"moved to {now.device}" if now.device != self.shard.device else f"converted to {now.dtype}"
            return (f"parameter {name!r} was {moved} {since} (model.to, .double(), .half() or .data = ...): its "
                    f"unit keeps its shard as a {self.shard.dtype} tensor on {self.shard.device}, so the change "
                    f"would never take effect. Move or convert the model before sharding it, and choose the "
                    f"dtype units compute in with shard(mixed_precision=...)")
        if registered is not param:
            what = "deleted" if registered is None else f"replaced by a new {type(registered).__name__}"
            return (f"parameter {name!r} was {what} {since}: its sharded unit keeps computing with the flat "
                    f"buffer it was sharded into, so the change would never take effect or train. Change "
                    f"parameters before sharding the model; to set their values afterwards, load them with "
                    f"model.load_state_dict on the whole sharded model (assign=True too: it copies them in)")
        if param.requires_grad != self.requires_grad:
            return (f"requires_grad of {name!r} was set to {param.requires_grad} {since}: sharding puts trainable "
                    f"and frozen parameters in separate buffers (only the trainable one is reduced), so set "
                    f"requires_grad before sharding the model")
        return (f"parameter {name!r} no longer views its unit's shard: its .data was replaced {since} (by "
                f"model.to_empty, among others), so an optimizer would update a detached copy while the model "
                f"never changes. Update parameters in place (param.copy_(...) under torch.no_grad()), or load "
                f"values with model.load_state_dict; to initialise a model built on the meta device, pass the "
                f"initialisation to shardwire.shard(model, init=...) instead of to_empty after it")

    @property
    def gathered_nbytes(self) -> int:
        return self.packing.padded_numel * self._gathered.element_size()

    def gather(self, *, backward: bool = False) -> Pending:
        """Allocate the gathered buffer and start the all-gather that fills it: from the shards, or,
        for backward, from the secondary shards kept at forward, if any. ``copy_out`` once it has
        arrived."""
        if backward and self._secondary is not None:
            comm, source, self._secondary = self._layout.secondary, self._secondary, None
        else:
            comm, source = self._comm, None
        with comm.gather_stream():
            if source is None:
                # a group of one's gather is a copy that casts: the shard goes in as it is
                source = self.shard.detach() if comm.alone else self.shard.detach().to(self.compute_dtype)
            self._fill(self._gathered)
            self._copied_out = self.packing.ordered_alike
            return comm.all_gather(self._gathered, source, tag=self.name, codec=self._param_codec)

    @property
    def needs_copy_out(self) -> bool:
        """A gather has arrived (or is arriving) in the gathered buffer and is not copied out yet."""
        return not self._copied_out

    def copy_out(self) -> None:
        """Copy the arrived gather into the parameter-major buffer, and release the gathered one."""
        if self._copied_out:
            return
        self._fill(self._by_param)
        self.packing.copy_out(self._gathered, self._by_param)
        self._gathered.untyped_storage().resize_(0)
        self._copied_out = True

    def _fill(self, buffer: torch.Tensor) -> None:
        """Give ``buffer`` (one of the two gathered buffers, its memory released by ``free``) its
        memory again; its first time, its shape too."""
        storage = buffer.untyped_storage()
        storage.resize_(self.gathered_nbytes)
        if buffer.numel() != self.packing.padded_numel:
            buffer.set_(storage, 0, (self.packing.padded_numel,))

    def keep_secondary(self) -> None:
        """Keep this rank's part of the gathered buffer within its group, for backward to gather
        from (``hybrid_secondary``; a no-op in other layouts). Call it while the buffer is gathered."""
        within = self._layout.secondary
        if within is not None:
            ranks = self.packing.world_size // within.world
            self._secondary = self.packing.ranks_part(self._by_param, within.rank * ranks, (within.rank + 1) * ranks)

    def drop_secondary(self) -> None:
        self._secondary = None

    def free(self) -> None:
        self._gathered.untyped_storage().resize_(0)
        self._by_param.untyped_storage().resize_(0)
        self._copied_out = True
        self._point_modules_at(self._placeholders)

    def show(self, on_grad: Callable[[tuple[torch.Tensor, ...]], None] | None) -> None:
        """Point every owning module attribute at a view of the parameter-major buffer.

        With ``on_grad``, the views come out of ``_Views`` over a fresh autograd leaf on the buffer's
        storage, whose backward hands the views' gradients to ``on_grad`` once all of them are
        complete, which is the moment this buffer's backward has ended. The leaf gets its own
        version counter, so refilling the storage before backward is not mistaken for an in-place
        change of a saved tensor.
        """
        leaf = torch.empty(0, dtype=self._by_param.dtype, device=self._by_param.device)
        leaf.set_(self._by_param.untyped_storage(), 0, self._by_param.shape)
        if on_grad is None:
            self._views = self.packing.views(leaf)
        else:
            self._views = list(_Views.apply(leaf.requires_grad_(True), self.packing,
                                            lambda grads: on_grad(self._unused_as_zeros(grads))))
        self._point_modules_at(self._views)

    def _unused_as_zeros(self, grads: tuple[torch.Tensor | None, ...]) -> tuple[torch.Tensor, ...]:
        """The gradients of a backward, zeros for a parameter it did not reach (None). Every rank
        reduces the whole buffer, whichever parameters it used (an expert that this rank's tokens
        were not routed to): its zeros add nothing to the average, as under DDP. Where no rank used
        it, torch would leave its ``.grad`` None; here it holds zeros, which weight decay and momentum
        still act on, so this rank says so, once for each parameter."""
        unused = [slot.names[0] for slot, grad in zip(self.packing.slots, grads) if grad is None]
        if not unused:
            return grads
        news = [name for name in unused if name not in self._said_unused]
        if news:
            self._said_unused.update(news)
            warnings.warn(
                f"parameter(s) {', '.join(map(repr, news[:3]))}{' ...' if len(news) > 3 else ''} got no gradient in a "
                f"backward on rank {self._layout.world.rank}: this rank adds zeros to their average. Where no rank "
                f"reaches one, its .grad is zeros where torch would leave it None, and an optimizer's weight decay and "
                f"momentum still move it: freeze a parameter the model never uses (requires_grad_(False)) before shard",
                stacklevel=1)
        return tuple(torch.zeros(slot.shape, dtype=self.compute_dtype, device=self.shard.device) if grad is None
                     else grad for slot, grad in zip(self.packing.slots, grads))

    def reveal(self) -> None:
        """Point the modules back at the views of the last ``show`` (the buffer was gathered again
        for backward, where recomputation of checkpointed activations reads them)."""
        self._point_modules_at(self._views)

    def _point_modules_at(self, tensors: list[torch.Tensor]) -> None:
        for tensor, owners in zip(tensors, self._owners):
            for attrs, name in owners:
                attrs[name] = tensor

    def accumulate(self, grads: tuple[torch.Tensor, ...]) -> None:
        """Keep this backward's gradients, in the reduction's layout and dtype, for a later, reducing
        backward (``no_sync``)."""
        with self._comm.reduce_stream(uses=grads):
            full = self._gathered_gradient(grads)
            self._accumulated = full if self._accumulated is None else self._accumulated.add_(full)

    def reduce(self, grads: tuple[torch.Tensor, ...], copying: Span = contextlib.nullcontext
               ) -> tuple[list[Pending], torch.Tensor]:
        """Start reducing this backward's gradients of the parameters (plus any accumulated ones),
        copied in rank by rank in the reduce dtype (inside ``copying``).

        A reduce-scatter over the ranks that split the buffer and, under ``hybrid``, an all-reduce
        of the share with the other groups, which starts once the share is complete; the result is
        the average over every rank. Returns the collectives and the tensor that will hold this
        rank's share; ``land`` hands that share to the parameters' gradients.
        """
        with self._comm.reduce_stream():
            with copying():
                full = self._gathered_gradient(grads)
            if self._accumulated is not None:
                full, self._accumulated = self._accumulated.add_(full), None
            # a group of one's share is the whole buffer: reduced in place, without a copy
            share = full if self._comm.alone else torch.empty(self.packing.shard_numel, dtype=self.reduce_dtype,
                                                              device=full.device)
            scattered = self._comm.reduce_scatter(
                share, full, tag=self.name, average=True, holding=grads, codec=self._grad_codec,
                residual=self.residuals.get("reduce_scatter"))
            across = self._layout.gradient_replicas
            if across is None:
                return [scattered], share
            between = across.all_reduce(share, tag=self.name, op="avg", after=scattered, codec=self._grad_codec,
                                        residual=self.residuals.get("all_reduce"))
            return [scattered, between], share

    def _gathered_gradient(self, grads: tuple[torch.Tensor, ...]) -> torch.Tensor:
        full = torch.empty(self.packing.padded_numel, dtype=self.reduce_dtype, device=grads[0].device)
        return self.packing.as_gathered(grads, full)

    def land(self, pendings: list[Pending], share: torch.Tensor) -> None:
        """Wait for the collectives from ``reduce`` and hand the share to the parameters' gradients.

        A parameter without a gradient gets a DTensor viewing its rows of the share (no copy), one
        that has a gradient (accumulation across backward passes without ``zero_grad``) gets them
        added. Every parameter gets one, as under FSDP2, its rows empty on a rank that holds none:
        every rank's optimizer then steps, and keeps state for, every parameter, so their state
        dicts hold the same entries. The training waits for the collectives here (which bounds the
        gradients in flight), and the addition runs where reductions run."""
        for pending in pendings:
            pending.wait()
        with self._comm.reduce_stream():
            share = share.to(self.shard.dtype)
            for param, held, spec, shape in zip(self.params, self._held, self._specs, self._local_shapes):
                local = share[held.at : held.at + held.numel].view(shape)
                if param.grad is None:
                    param.grad = DTensor(local, spec, requires_grad=False)
                elif isinstance(param.grad, DTensor):
                    param.grad._local_tensor.add_(local)
                else:
                    param.grad.add_(DTensor(local, spec, requires_grad=False))


class _Views(torch.autograd.Function):
    """The parameters' views of the parameter-major buffer; its backward hands the views' gradients
    (None for a view no computation used) to ``on_grad`` as they are, which copies them in rank by
    rank for the reduce-scatter: one copy, where a gradient of the whole buffer would take two."""

    @staticmethod
    def forward(ctx, by_param: torch.Tensor, packing: Packing, on_grad: Callable) -> tuple[torch.Tensor, ...]:
        ctx.on_grad = on_grad
        ctx.set_materialize_grads(False)  # a view no computation used: None, not zeros
        return tuple(packing.views(by_param))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor) -> tuple[None, None, None]:
        ctx.on_grad(grads)
        return None, None, None


def _spec(slot: ParamSlot, dtype: torch.dtype, layout: Layout) -> _DTensorSpec:
    """The DTensor placement of a parameter of ``slot`` in ``dtype`` on the layout's mesh."""
    strides = tuple(math.prod(slot.shape[i + 1:]) for i in range(len(slot.shape)))
    return _DTensorSpec(layout.mesh, layout.placements(slot.replicated),
                        tensor_meta=_TensorMeta(torch.Size(slot.shape), strides, dtype))

