"""What a compile warm-up runs a stage on (``gems.pipeline.compiled``): a stage's inputs made as a
step makes them, and, for pieces that do not compile, their outputs' metadata from a pass on the meta
device, turned into real tensors for the next piece."""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from gems.pipeline.stage import as_tuple, recomputation, unpack

Inputs = tuple[torch.Tensor, ...]


def on_meta(module: nn.Module, xs: Inputs) -> Inputs:
    """``module``'s outputs on the meta device (shapes, dtypes, strides; nothing computed or kept), its
    ``RECOMPUTING`` flags raised so that deferred BatchNorm layers count nothing."""
    state = {name: t.to("meta") for name, t in (*module.named_parameters(), *module.named_buffers())}
    with torch.no_grad(), recomputation(module):
        return as_tuple(torch.func.functional_call(module, state, (unpack(tuple(x.to("meta") for x in xs)),)))


def example(t: torch.Tensor, device: torch.device, grad: bool) -> torch.Tensor:
    """A real tensor like ``t`` (shape, dtype, strides) on ``device``, random where floating."""
    real = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
    with torch.no_grad():
        real.copy_(torch.randn(t.shape, dtype=t.dtype) if t.dtype.is_floating_point
                   else torch.zeros(t.shape, dtype=t.dtype))
    return real.requires_grad_(grad and t.dtype.is_floating_point)


def example_inputs(plan, routes, stage: int, rows: int, device: torch.device,
                   arrive: Callable[[torch.Tensor], torch.Tensor]) -> Inputs:
    """Stage ``stage``'s inputs for a micro-batch of ``rows`` images, made as a step makes them: the
    images through ``arrive`` (stage 0), else its messages packed and unpacked in the plan's layout,
    ``requires_grad`` where their gradients go back (``gems.pipeline.executor``). Random values of a
    generator of their own."""
    g = torch.Generator().manual_seed(rows)
    if stage == 0:
        return (arrive(torch.randn(rows, *plan.input_shape, dtype=getattr(torch, plan.dtype), generator=g)),)
    received = {}
    for edge, e in routes.edges.items():
        if e.consumer != stage:
            continue
        layout = routes.layout("act", edge, rows)
        values = [torch.randn(shape, dtype=dtype, generator=g) if dtype.is_floating_point
                  else torch.zeros(shape, dtype=dtype) for shape, dtype in zip(layout.shapes, layout.dtypes)]
        tensors = layout.unpack(layout.pack(values, "the warm-up", device), "the warm-up")
        for t, grad in zip(tensors, e.grads):
            t.requires_grad_(grad)
        received[edge] = tensors
    return routes.assemble(stage, received, device)
