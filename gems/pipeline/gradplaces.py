"""Where each parameter's ``.grad`` lives: its place in the rank's gradient bucket
(``gems.pipeline.gradsync``), or in the host copy of a stage whose optimizer runs on the host
(``gems.pipeline.hostopt``), and how a step's gradients get there.

Between steps ``.grad`` is its place, holding the last step's summed gradients (as after a plain
loop's ``optimizer.step()``); ``engine.optimizer.zero_grad()`` zeroes the places and keeps them,
whatever its ``set_to_none`` says. A ``.grad`` set to None is put back at the next step; one
replaced by another tensor is refused (GemsError) before the step communicates.

During a step a bucket parameter's ``.grad`` starts as None, so that autograd makes its first
gradient as a tensor of its own (usually the very tensor the backward computed); a
post-accumulate hook copies it into the place, which ``.grad`` is from then on, so later
gradients of the step are added into it in place. One pass over the gradients, where adding the
first to a zeroed bucket took two (the zeroing, then a read of both). Gradients accumulated
outside autograd's engine (a split backward's weight half) are placed by ``take``; ``settle``
completes a part before it is summed (zeros where no gradient came).
"""
from __future__ import annotations

import torch
from torch import nn

from gems.errors import GemsError

HOOK = "_gems_bucket_hook"   # the attribute holding a parameter's hook handle (one engine's at a time)


class GradPlaces:
    """The places of the bucket's parameters' gradients (``add``, ``move``), and the checks of
    every place, host copies' included (``host_views``: a callable listing those)."""

    def __init__(self, host_views) -> None:
        self.views: list[tuple[nn.Parameter, torch.Tensor]] = []   # (bucket parameter, its place), in bucket order
        self._of: dict[int, torch.Tensor] = {}       # id(parameter) -> its place
        self._index: dict[int, int] = {}             # id(parameter) -> where it is in ``views``
        self._host_views = host_views

    def add(self, p: nn.Parameter, place: torch.Tensor) -> None:
        """``p``'s gradient lives at ``place`` from now on (its ``.grad``), with the hook that copies a
        step's first gradient there, in place of the one an earlier engine on ``p`` left."""
        p.grad = place
        self._index[id(p)] = len(self.views)
        self.views.append((p, place))
        self._of[id(p)] = place
        release(p)
        setattr(p, HOOK, p.register_post_accumulate_grad_hook(self.adopt))

    def move(self, p: nn.Parameter, place: torch.Tensor) -> None:
        """``p``'s gradient lives at ``place`` instead (before the first step: places hold zeros)."""
        p.grad = self._of[id(p)] = place
        self.views[self._index[id(p)]] = (p, place)

    def keep(self, optimizer: torch.optim.Optimizer, zero) -> None:
        """Make ``optimizer.zero_grad()`` call ``zero()`` (which zeroes every place) and keep ``.grad``
        the places, whatever ``set_to_none`` says: set to None, they would be places no more until
        the next step."""
        def zero_grad(set_to_none: bool = True) -> None:  # noqa: ARG001 - gradients live in their places
            zero()
            for p, place in self.views:
                p.grad = place
            _reattach(self._host_views())

        optimizer.zero_grad = zero_grad

    def begin_step(self) -> None:
        """Check every place (re-attaching a ``.grad`` set to None), then leave the bucket parameters'
        ``.grad`` None for the step's first gradients (module docstring)."""
        _reattach([*self.views, *self._host_views()])
        for p, _ in self.views:
            p.grad = None

    @torch.no_grad()
    def adopt(self, p: nn.Parameter) -> None:
        """After a gradient of ``p`` was accumulated: where it is the step's first, made as a tensor
        of its own, copied into its place, which ``.grad`` is from then on."""
        place = self._of[id(p)]
        if p.grad is not None and p.grad is not place:
            place.copy_(p.grad)
            p.grad = place

    def take(self, params: list[nn.Parameter]) -> None:
        """After gradients of ``params`` were accumulated outside autograd's engine: each in its place."""
        for p in params:
            self.adopt(p)

    @torch.no_grad()
    def settle(self, params: list[nn.Parameter]) -> None:
        """The step's gradients of ``params`` complete: each in its place, zeros where none came."""
        for p in params:
            place = self._of[id(p)]
            if p.grad is None:
                place.zero_()
            elif p.grad is not place:
                place.copy_(p.grad)
            p.grad = place


def release(p: nn.Parameter) -> None:
    """Remove the hook an earlier engine left on ``p`` (its bucket is not this engine's), if any."""
    old = getattr(p, HOOK, None)
    if old is not None:
        old.remove()
        delattr(p, HOOK)


def _reattach(views: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Each (parameter, its gradient's place): ``.grad`` set to the place where it is None; GemsError
    where it was replaced by another tensor."""
    for p, view in views:
        if p.grad is None:
            p.grad = view
        elif p.grad is not view:
            raise GemsError("a parameter's .grad was replaced by another tensor: gems keeps gradients in its sync "
                            "bucket (or, for --state-placement host-optimizer, in its host copy), so zero them "
                            "with engine.optimizer.zero_grad() and never assign .grad")
