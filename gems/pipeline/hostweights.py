"""Parameters in host memory, on the device per unit group: ``StagePolicy.state_placement == "host"``
(Harmony's weight swapping, ZeRO-Infinity's parameter offload).

Such a stage's model state is held by the host tier as under ``host-optimizer``
(``gems.pipeline.hostopt``: the optimizer's state, its update, the host copies of the parameters and
of the gradient segment), and its parameters' device storage is empty -- a 0-element placeholder in
each ``Parameter`` -- except while a **unit group** (``StagePolicy.weight_groups``; default the whole
stage) is *resident*: one device buffer, filled by copy from the host copies, that the group's
parameters are views of. A stage of groups g0 g1 g2, one forward action and its backward::

    forward    load g0 | g0's units | free g0 | load g1 | g1's units | free g1 | load g2 | ... | free g2
    backward   load g2 | g2's nodes, grads -> host | free g2 | load g1 | ... | free g0

- forward: a hook before each unit loads its group (if not resident), one after a group's last
  unit frees it -- also a forward-only step's (``gems.pipeline.forward``).
- what autograd saves: a convolution or linear on CPU without autocast saves the ``Parameter`` itself
  (a leaf), so the saved tensor would read whatever storage the parameter holds when backward runs.
  The stage's forward runs under ``saving``'s ``saved_tensors_hooks``: a saved parameter of the stage
  packs to a token (its group and itself), and unpacking it loads the group again -- "comes back for
  its backward", on demand, in the order backward needs the groups -- and hands autograd the
  parameter, its values resident. A saved view of a parameter (a linear layer saves ``weight.t()``)
  packs so too, with its geometry, and comes back as that view of the resident values: kept as is, it
  would hold the whole group's device buffer until its backward, a copy of the group's weights per
  micro-batch in flight. Everything else goes to the hooks it composes with (the stage's
  offload, ``gems.pipeline.offload``) or is kept as is. Under bf16 autocast the saved weight is the
  cast copy (a non-leaf made while the group was resident): it is an activation like any other, kept
  on the device or offloaded by the stage's policy, and never refers to the parameter's storage.
- recompute (``torch.utils.checkpoint``, non-reentrant): a checkpointed piece's forward runs under
  checkpoint's own hooks (innermost, so nothing of it reaches ours) and is re-run inside backward,
  where the unit hooks load its groups; the re-run saves detached aliases of the resident buffer,
  which stay valid after the group is freed (the alias keeps that buffer until autograd drops it).
- gradients: a device parameter of such a stage has no ``.grad`` between uses. Autograd's
  accumulation makes one in the group's backward (a hook on the parameter makes sure the group is
  resident then); the hook after accumulation hands it to the host tier (``HostTier.grad_out``: added
  into the host gradient, micro-batch after micro-batch, as the device bucket would add it -- bitwise
  the same sums on CPU) and drops it; once every parameter of a resident group has done so in a
  backward, the group is freed. What is left resident at the end of a backward action (a parameter
  that got no gradient, the halves of a split backward, where gradients arrive through
  ``accumulate`` instead) goes by ``finish``.
- group-major runs (``Plan.swap_grouped``, ``gems.pipeline.grouping``): the executor runs a visit's
  micro-batches group by group inside ``hold`` (a group stays after its units ran over one micro-batch)
  and ``release``s each group when every micro-batch has passed it; the backward's gradients of a group
  come from ``torch.autograd.grad`` and arrive through ``accumulate``, as a split backward's do.
- frozen parameters (``requires_grad`` False) and buffers (BatchNorm statistics) stay on the device:
  the statistics are updated by the forward and averaged through the segment as under
  ``host-optimizer``.

Transfers are counted (``loads``, ``bytes_in``; gradients: ``bytes_out``). A group whose host copies lie
back to back (as the host tier lays a part out, but for a sharded part's reordering) comes in one copy,
else one per parameter. On CUDA the copies in run
on a copy stream after the compute stream's work so far, in pinned host memory; loading a group also
starts the copy of the group expected next (forward: the following, backward: the one before), which
the compute stream waits for (an event) only when that group is used, so at most two groups are on
the device at once and a copy runs beside the compute of the group before it. Nothing is prefetched
across actions (a forward's first group and a backward's last come just in time). A buffer is
recorded on the copy stream, so freeing it never lets a later allocation overwrite it before its copy
completed. Gradients go out on the host tier's copy stream (``HostTier.grad_out``).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from gems.errors import GemsError
from gems.pipeline.hostopt import HostTier
from gems.plan import formats

PLACEMENT = "host"


class _Group:
    """One unit group's trainable parameters (device ``Parameter`` objects) and, while resident, the
    device buffer they are views of; ``waiting``: ids of those whose gradient this backward has yet to
    hand over."""

    __slots__ = ("index", "params", "hosts", "numel", "span", "buffer", "waiting", "arriving")

    def __init__(self, index: int, params: list[nn.Parameter], hosts: list[torch.Tensor]) -> None:
        self.index, self.params, self.hosts = index, params, hosts
        self.numel = sum(h.numel() for h in hosts)
        self.span = _span(hosts)   # the host copies as one flat run, where they are one: one copy moves them
        self.buffer: torch.Tensor | None = None
        self.waiting: set[int] = set()
        self.arriving: torch.cuda.Event | None = None   # CUDA, prefetched: the end of its copy, not yet waited for


class _SavedWeight:
    """What autograd keeps for a saved parameter of a host stage, or a view of one: the parameter, its
    group and, for a view, its geometry (size, stride, offset from the parameter's own)."""

    __slots__ = ("param", "group", "view")

    def __init__(self, param: nn.Parameter, group: _Group, view: tuple | None = None) -> None:
        self.param, self.group, self.view = param, group, view

    def unpacked(self) -> torch.Tensor:
        """The parameter, or its view again (on the parameter's values now resident)."""
        if self.view is None:
            return self.param
        size, stride, offset = self.view
        return self.param.detach().as_strided(size, stride, self.param.storage_offset() + offset)


def _kept(t):
    return t


def _span(hosts: list[torch.Tensor]) -> torch.Tensor | None:
    """``hosts`` as one flat view where they lie back to back in one storage, each dense (the host tier
    lays a part's parameters out so, but for a sharded part's reordering); else None."""
    if not hosts:
        return None
    storage = hosts[0].untyped_storage().data_ptr()
    at = hosts[0].storage_offset()
    for h in hosts:
        dense = h.is_contiguous() or h.is_contiguous(memory_format=torch.channels_last)
        if h.untyped_storage().data_ptr() != storage or h.storage_offset() != at or not dense:
            return None
        at += h.numel()
    return hosts[0].as_strided((at - hosts[0].storage_offset(),), (1,), hosts[0].storage_offset())


class HostWeights:
    """The residency of one stage's parameters, group by group (module docstring).

    Args:
        module: the stage (``model[lo:hi]``), its trainable parameters already held by ``tier``.
        first_unit: ``lo``, the model index of its first unit (groups name model units).
        groups: ``[first_unit, end_unit)`` per group, covering the stage in order (empty: one group).
        tier: the host tier holding the parameters' values and gradients.
        device: where the stage runs.
    """

    def __init__(self, module: nn.Sequential, first_unit: int, groups: list[list[int]], tier: HostTier,
                 device: torch.device) -> None:
        self.tier, self.device = tier, device
        self.cuda = device.type == "cuda"
        self._stream = torch.cuda.Stream(device) if self.cuda else None
        bounds = [(first - first_unit, end - first_unit) for first, end in groups] or [(0, len(module))]
        self.bounds = bounds   # per group, its units [lo, hi) in the stage
        self._held = False     # in a group-major run: groups stay until ``release``
        self.groups: list[_Group] = []
        self._of: dict[int, tuple[nn.Parameter, _Group]] = {}   # id(parameter) -> (it, its group)
        for index, (lo, hi) in enumerate(bounds):
            params = list({id(p): p for unit in module[lo:hi] for p in unit.parameters() if p.requires_grad}.values())
            shared = next((p for p in params if id(p) in self._of), None)
            if shared is not None:
                raise GemsError(f"a parameter of stage units {first_unit}..{first_unit + len(module) - 1} is used in "
                                f"weight groups {self._of[id(shared)][1].index} and {index}, which are on the device "
                                "at different times: put the units sharing it in one weight group")
            group = _Group(index, params, [tier.values(p).data for p in params])
            self.groups.append(group)
            for p in params:
                self._of[id(p)] = (p, group)
                p.register_hook(lambda grad, group=group: self._load(group))   # before its accumulation
                p.register_post_accumulate_grad_hook(self._hand_over)
            for i, unit in enumerate(module[lo:hi], start=lo):
                unit.register_forward_pre_hook(lambda *_, group=group: self._load(group))
                if i == hi - 1:
                    unit.register_forward_hook(lambda *_, group=group: self._leave(group))
        dtype = next((g.hosts[0].dtype for g in self.groups if g.hosts), torch.float32)
        self._empty = torch.empty(0, dtype=dtype, device=device)   # every evicted parameter's storage
        self.loads = 0          # groups brought to the device
        self.bytes_in = 0       # parameter bytes copied to the device
        self.bytes_out = 0      # gradient bytes handed to the host
        for group in self.groups:   # the values are in the host tier now: the device storage goes
            for p in group.params:
                p.data = self._empty

    # -- residency ---------------------------------------------------------------------------
    def _load(self, group: _Group) -> None:
        """Make ``group``'s parameters usable on the device now (nothing if resident); on CUDA also start
        bringing the group that comes next (forward: the following one; backward: the one before), so
        its copy runs beside this group's compute -- at most two groups on the device at a time."""
        if group.buffer is not None:
            if group.arriving is not None:   # prefetched: the compute stream waits for its copy
                torch.cuda.current_stream(self.device).wait_event(group.arriving)
                group.arriving = None
            return
        if not group.params:
            return
        self._fetch(group, wait=True)
        if self.cuda:
            after = group.index + (-1 if torch._C._current_graph_task_id() != -1 else 1)
            if 0 <= after < len(self.groups) and self.groups[after].buffer is None and self.groups[after].params:
                self._fetch(self.groups[after], wait=False)

    @torch.no_grad()
    def _fetch(self, group: _Group, wait: bool) -> None:
        """Copy ``group`` into a new device buffer and make its parameters views of it. CUDA: on the copy
        stream, after the compute stream's work so far; ``wait``: the compute stream waits for the copy
        now, else at the group's ``_load`` (``arriving``)."""
        with self.tier.timed(f"weights-in g{group.index}"):
            self._copy_in(group, wait)

    def _copy_in(self, group: _Group, wait: bool) -> None:
        buffer = torch.empty(group.numel, dtype=group.hosts[0].dtype, device=self.device)
        views, offset = [], 0
        for h in group.hosts:
            views.append(formats.like(buffer[offset:offset + h.numel()], h))   # the host copy's format
            offset += h.numel()
        pairs = [(buffer, group.span)] if group.span is not None else list(zip(views, group.hosts))
        if self._stream is None:
            for view, h in pairs:
                view.copy_(h)
        else:
            compute = torch.cuda.current_stream(self.device)
            self._stream.wait_stream(compute)   # the buffer's memory is free in the compute stream's order
            with torch.cuda.stream(self._stream):
                for view, h in pairs:
                    view.copy_(h, non_blocking=True)
                if not wait:
                    group.arriving = torch.cuda.Event()
                    group.arriving.record(self._stream)
            if wait:
                compute.wait_stream(self._stream)
            buffer.record_stream(self._stream)   # freed early, its memory still waits for the copy
        for p, view in zip(group.params, views):
            p.data = view   # the Parameter object, its autograd identity and version stay
        group.buffer = buffer
        group.waiting = {id(p) for p in group.params}
        self.loads += 1
        self.bytes_in += group.numel * buffer.element_size()

    def _free(self, group: _Group) -> None:
        """Hand over any gradient the group's parameters still hold and empty their device storage."""
        if group.buffer is None:
            return
        for p in group.params:
            if p.grad is not None:
                self._give(p, p.grad)
                p.grad = None
            p.data = self._empty
        group.buffer = group.arriving = None
        group.waiting = set()

    def _leave(self, group: _Group) -> None:
        """After a group's last unit: free it, unless in a backward (a recomputation), where its backward
        comes next and frees it."""
        if torch._C._current_graph_task_id() == -1 and not self._held:
            self._free(group)

    def _hand_over(self, p: nn.Parameter) -> None:
        """After autograd accumulated ``p``'s gradient: to the host; the group goes once all have."""
        _, group = self._of[id(p)]
        self._give(p, p.grad)
        p.grad = None
        group.waiting.discard(id(p))
        if not group.waiting:
            self._free(group)

    def _give(self, p: nn.Parameter, grad: torch.Tensor) -> None:
        with self.tier.timed("grads-out"):
            self.tier.grad_out(p, grad)
        self.bytes_out += grad.numel() * grad.element_size()

    # -- what the stage runner and the executor call -------------------------------------------
    @contextlib.contextmanager
    def saving(self, inner: tuple[Callable, Callable] | None = None) -> Iterator[None]:
        """The stage's forward: saved parameters become tokens their backward loads again; everything
        else goes to ``inner`` (pack, unpack; the stage's offload) or is kept."""
        pack_inner, unpack_inner = inner or (_kept, _kept)

        def pack(t: torch.Tensor):
            found = self._of.get(id(t))
            if found is not None and found[0] is t:
                return _SavedWeight(*found)
            base = t._base   # a view of a parameter (a linear layer saves weight.t()) would keep the whole
            found = self._of.get(id(base)) if base is not None else None   # group's buffer alive
            if found is not None and found[0] is base and t.dtype == base.dtype:
                return _SavedWeight(*found, (t.size(), t.stride(), t.storage_offset() - base.storage_offset()))
            return pack_inner(t)

        def unpack(item):
            if isinstance(item, _SavedWeight):
                self._load(item.group)
                return item.unpacked()
            return unpack_inner(item)

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield

    def accumulate(self, p: torch.Tensor, grad: torch.Tensor | None) -> bool:
        """A split backward's weight half: hand ``grad`` of ``p`` straight to the host (``p`` need not be
        resident). Returns False for a parameter that is not one of this stage's on the host."""
        if id(p) not in self._of:
            return False
        if grad is not None:
            self._give(p, grad)
        return True

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """A group-major run (``gems.pipeline.grouping``): a group stays on the device after its units ran
        over one micro-batch, until the run ``release``s it."""
        self._held = True
        try:
            yield
        finally:
            self._held = False

    def release(self, index: int) -> None:
        """Group ``index`` leaves the device (a group-major run is done with it)."""
        self._free(self.groups[index])

    def finish(self) -> None:
        """After a backward action (or half): every group still resident hands over and goes."""
        for group in self.groups:
            self._free(group)

    @contextlib.contextmanager
    def resident(self) -> Iterator[None]:
        """Every group on the device, and on leaving, their values stored to the host copies (loading
        state into the module: ``Engine.load_state``)."""
        for group in self.groups:
            self._load(group)
        try:
            yield
        finally:
            with torch.no_grad():
                for group in self.groups:
                    for p, h in zip(group.params, group.hosts):
                        h.copy_(p.data)
                    self._free(group)

    @property
    def device_bytes(self) -> int:
        """Bytes of device storage the stage's trainable parameters hold now (each buffer once)."""
        storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for g in self.groups for p in g.params}
        return sum(storages.values())
