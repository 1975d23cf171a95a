"""One flat buffer of a unit: the slice this rank owns and, while the unit runs, the whole buffer.

The owned slice (``shard``, in the parameters' own dtype) is the master copy of the unit's weights.
The user sees it through the model's own parameters: each original parameter stays registered under
its name as an ``nn.Parameter`` viewing the part of the slice that falls inside it (flattened; empty
where this rank's slice misses it), so ``model.named_parameters()`` keeps the model's names, an
optimizer's in-place update lands in the buffer the next all-gather sends, and after backward each
parameter's ``.grad`` is a view of this rank's share of the reduced flat gradient; a parameter
replaced after ``shard`` would be cut off from all of that, which ``check_parameters`` refuses before
each forward. The gathered buffer is a single tensor kept for the unit's lifetime; its storage is
allocated before each all-gather and released when the unit is resharded. While gathered, the module
attributes point at views of it, shadowing the registered parameters, so tensors autograd saved
during forward see the data gathered again for backward. Which ranks the slice is cut for, and which
hold the same slice, is the layout's (``shardwire.engine.layout``): under ``hybrid_secondary`` the
buffer also keeps, from a unit's forward to its backward, this rank's part of the gathered buffer
within its group (the secondary shard), which backward gathers from; under ``hybrid`` each reduced
share is all-reduced with the other groups' before it lands, unless the groups sync every H steps
instead: then the buffer keeps the outer optimizer's state of its shard (``outer``,
``shardwire.engine.outer``). With a quantized ``Wire``, gathers and reductions that cross nodes
carry the buffer quantized, and the buffer keeps the error-feedback residuals of its gradients'
quantization (and of its syncs').

On CUDA each buffer belongs to the stream that fills it: the gathered storage and the cast of the
shard are allocated where all-gathers run, a gradient's cast, its accumulation under ``no_sync`` and
its reduced share where reductions run. A gradient autograd made on the compute stream stays alive
with its reduce-scatter until the compute stream has waited for it (``land``), so its memory is
reused only after that; one kept for accumulation is recorded to the reduce stream instead. So the
caching allocator never gives a buffer's memory to one stream while another still uses it, and the
reductions in flight bound the gradients held.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn

from shardwire.comm.communicator import Pending
from shardwire.comm.wire import Wire
from shardwire.engine.layout import Layout
from shardwire.engine.outer import OuterState
from shardwire.engine.packing import Packing, ParamSlot
from shardwire.engine.released import ReleasedParameter


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
        rank = layout.shard.rank
        start, _ = packing.shard_range(rank)
        self.shard_start = start  # where this rank's slice begins in the buffer
        self._parts = [(lo - start, hi - start) for lo, hi in (packing.held(slot, rank) for slot in packing.slots)]
        self.params = [self._parameter(slot, lo, hi) for slot, (lo, hi) in zip(packing.slots, self._parts)]
        # The parameters with a part here and its place in the shard: where each step's gradient goes.
        self._held = [(param, lo, hi) for param, (lo, hi) in zip(self.params, self._parts) if hi > lo]
        # For each slot, the module attribute dicts (and names) that expose that parameter.
        self._owners = [[(module.__dict__, attr) for module, attr in slot] for slot in owners]
        # What check_parameters compares, one row per place a parameter is registered (a tied one has
        # several): its name there, the parameter, the address its part starts at (0 for an empty
        # part), and the registry (the module's _parameters) and key it must still be found under.
        self._registered = [
            (name, param, param.data_ptr(), module._parameters, attr)
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
        if layout.sync is not None and requires_grad:
            residual = None
            if layout.sync.codec is not None:
                residual = layout.replicate.residual_for(packing.shard_numel, all_reduce=True)
                if residual is not None:
                    self.residuals["sync"] = residual
            self.outer = OuterState(name, shard, layout.replicate, layout.sync, residual)
        self._full = torch.empty(packing.padded_numel, dtype=compute_dtype, device=shard.device)
        self._secondary: torch.Tensor | None = None  # hybrid_secondary, from forward to backward
        self._placeholders = [
            ReleasedParameter(slot.shape, compute_dtype, slot.names[0], name) for slot in packing.slots
        ]
        self._views: list[torch.Tensor] = []
        self._accumulated: torch.Tensor | None = None  # unsharded gradient summed under no_sync
        # Gradients landed so far: which buffers were reduced since an optimizer's last step, for
        # shardwire.register_optimizer (sharded_optim_state_dict).
        self.reductions = 0
        self.free()

    def _parameter(self, slot: ParamSlot, lo: int, hi: int) -> nn.Parameter:
        """The user's handle on a parameter: a view of its part of the shard, with its full shape."""
        param = nn.Parameter(self.shard[lo:hi], requires_grad=self.requires_grad)
        param.full_shape = torch.Size(slot.shape)
        return param

    @property
    def shard_range(self) -> tuple[int, int]:
        """The [start, end) of the buffer this rank's slice holds."""
        return self.shard_start, self.shard_start + self.packing.shard_numel

    def held_parts(self) -> Iterator[tuple[ParamSlot, nn.Parameter, tuple[int, int]]]:
        """Each parameter's slot, its view, and the [start, end) of its flattened elements held here."""
        for slot, param, (lo, hi) in zip(self.packing.slots, self.params, self._parts):
            yield slot, param, (self.shard_start + lo - slot.offset, self.shard_start + hi - slot.offset)

    def check_parameters(self) -> None:
        """Refuse a change to the parameters since ``shard`` that the engine cannot honour and would
        otherwise silently ignore. The engine computes with the gathered buffer, fills it from the shard
        and gives gradients to the parameters it made, so each parameter must still be the one registered
        under its name (not a new ``nn.Parameter``), still view its part of the shard (not a copy put in
        through ``.data``, a ``.double()`` or a ``.to(device)``), and keep its ``requires_grad``
        (trainable and frozen parameters live in separate buffers, only the trainable one reduced).

        It runs before every forward, over every parameter, so the common case is three cheap tests per
        place a parameter is registered: its registration, its flag, and the address its part starts
        at, which a part in another dtype or on another device cannot share (it is another tensor), so
        one comparison covers ``.data``, dtype and device. Only a failing test looks closer, to say what
        changed. An empty part starts at no address, so only its registration and flag are tested: it
        holds nothing an optimizer could update.
        """
        trainable = self.requires_grad
        for name, param, address, registry, attr in self._registered:
            if registry.get(attr) is not param or param.data_ptr() != address or param.requires_grad is not trainable:
                raise RuntimeError(self._describe_change(name, param, registry.get(attr)))

    def _describe_change(self, name: str, param: nn.Parameter, registered: object) -> str:
        """What happened to parameter ``name`` since ``shard``, and what to do instead, in one line."""
        since = "after shardwire.shard"
        now = registered if isinstance(registered, torch.Tensor) else param
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
                    f"model.load_state_dict (in place, without assign=True)")
        if param.requires_grad != self.requires_grad:
            return (f"requires_grad of {name!r} was set to {param.requires_grad} {since}: sharding puts trainable "
                    f"and frozen parameters in separate buffers (only the trainable one is reduced), so set "
                    f"requires_grad before sharding the model")
        return (f"parameter {name!r} no longer views its unit's shard: its .data was replaced {since}, so an "
                f"optimizer would update a detached copy while the model never changes. Update parameters in "
                f"place (param.copy_(...) under torch.no_grad()), or load values with model.load_state_dict")

    @property
    def gathered_nbytes(self) -> int:
        return self.packing.padded_numel * self._full.element_size()

    def gather(self, *, backward: bool = False) -> Pending:
        """Allocate the full buffer and start the all-gather that fills it: from the shards, or, for
        backward, from the secondary shards kept at forward, if any."""
        if backward and self._secondary is not None:
            comm, source, self._secondary = self._layout.secondary, self._secondary, None
        else:
            comm, source = self._comm, None
        with comm.gather_stream():
            if source is None:
                source = self.shard.detach().to(self.compute_dtype)
            self._full.untyped_storage().resize_(self.gathered_nbytes)
            return comm.all_gather(self._full, source, tag=self.name, codec=self._param_codec)

    def keep_secondary(self) -> None:
        """Keep this rank's part of the gathered buffer within its group, for backward to gather
        from (``hybrid_secondary``; a no-op in other layouts). Call it while the buffer is gathered."""
        within = self._layout.secondary
        if within is not None:
            size = self.packing.padded_numel // within.world
            self._secondary = self._full[within.rank * size : (within.rank + 1) * size].clone()

    def drop_secondary(self) -> None:
        self._secondary = None

    def free(self) -> None:
        self._full.untyped_storage().resize_(0)
        self._point_modules_at(self._placeholders)

    def show(self, on_grad: Callable[[torch.Tensor], None] | None) -> None:
        """Point every owning module attribute at a view of the gathered buffer.

        With ``on_grad``, the views hang off a fresh autograd leaf over the buffer's storage: autograd
        then sums the gradients of all views into that leaf's single flat gradient and calls
        ``on_grad(leaf)`` once it is complete, which is the moment this buffer's backward has ended.
        The leaf gets its own version counter, so refilling the storage before backward is not
        mistaken for an in-place change of a saved tensor.
        """
        leaf = torch.empty(0, dtype=self._full.dtype, device=self._full.device)
        leaf.set_(self._full.untyped_storage(), 0, self._full.shape)
        if on_grad is not None:
            leaf.requires_grad_(True)
            leaf.register_post_accumulate_grad_hook(on_grad)
        self._views = self.packing.views(leaf)
        self._point_modules_at(self._views)

    def reveal(self) -> None:
        """Point the modules back at the views of the last ``show`` (the buffer was gathered again
        for backward, where recomputation of checkpointed activations reads them)."""
        self._point_modules_at(self._views)

    def _point_modules_at(self, tensors: list[torch.Tensor]) -> None:
        for tensor, owners in zip(tensors, self._owners):
            for attrs, name in owners:
                attrs[name] = tensor

    def accumulate(self, grad: torch.Tensor) -> None:
        """Keep this backward's unsharded gradient for a later, reducing backward (``no_sync``)."""
        with self._comm.reduce_stream(uses=(grad,)):
            grad = grad.to(self.reduce_dtype)
            self._accumulated = grad if self._accumulated is None else self._accumulated.add_(grad)

    def reduce(self, grad: torch.Tensor) -> tuple[list[Pending], torch.Tensor]:
        """Start reducing this backward's flat gradient (plus any accumulated one).

        A reduce-scatter over the ranks that split the buffer and, under ``hybrid``, an all-reduce
        of the share with the other groups, which starts once the share is complete; the result is
        the average over every rank. Returns the collectives and the tensor that will hold this
        rank's share; ``land`` adds that share to the parameters' gradients.
        """
        with self._comm.reduce_stream():
            full = grad.to(self.reduce_dtype)
            if self._accumulated is not None:
                full = self._accumulated.add_(full)
                self._accumulated = None
            share = torch.empty(self.packing.shard_numel, dtype=self.reduce_dtype, device=grad.device)
            scattered = self._comm.reduce_scatter(
                share, full, tag=self.name, average=True, holding=(grad,), codec=self._grad_codec,
                residual=self.residuals.get("reduce_scatter"))
            across = self._layout.gradient_replicas
            if across is None:
                return [scattered], share
            between = across.all_reduce(share, tag=self.name, op="avg", after=scattered, codec=self._grad_codec,
                                        residual=self.residuals.get("all_reduce"))
            return [scattered, between], share

    def land(self, pendings: list[Pending], share: torch.Tensor) -> None:
        """Wait for the collectives from ``reduce`` and hand the share to the parameters' gradients.

        A parameter without a gradient gets a view of the share (no copy); one that has a gradient
        (accumulation across backward passes without ``zero_grad``) gets the share added. A parameter
        this rank holds nothing of gets none, so optimizers skip it. The training waits for the
        collectives here (which bounds the gradients in flight), and the addition runs where
        reductions run."""
        for pending in pendings:
            pending.wait()
        self.reductions += 1
        with self._comm.reduce_stream():
            share = share.to(self.shard.dtype)
            for param, lo, hi in self._held:
                if param.grad is None:
                    param.grad = share[lo:hi]
                else:
                    param.grad.add_(share[lo:hi])
