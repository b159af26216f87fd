"""Where a rank's gradients live: one flat bucket, a segment per part of the stages it holds.

A part's segment holds its gradients -- each parameter's ``.grad`` a view of it
(``gems.pipeline.gradplaces``) -- then a copy of its floating buffers (BatchNorm running
statistics), which ``gems.pipeline.gradsync`` sums with them over the part's sync group. A part
whose model state lives in host memory keeps only its statistics' copy here: its gradients are
laid out as if here (the host copy's layout, ``gems.pipeline.hostopt``) but go to the host as
backward makes them (parameters on the host too, ``placed``) or exist only from the stage's first
backward to its copy out (``lazy``). A sharded optimizer lays a part's gradients out again by
owner (``lay_out``) and makes its parameters views of one flat buffer laid out alike
(``flatten``).
"""
from __future__ import annotations

import torch
from torch import nn

from gems.pipeline.gradplaces import GradPlaces, release
from gems.plan import formats

Key = tuple[int, int]   # (stage, part)


class GradBucket:
    """The bucket of the parts ``params`` ({part: its trainable parameters}, in bucket order) with
    the statistics buffers ``stats`` ({part: buffers}); ``placed`` and ``lazy``: the parts held in
    host memory (module docstring); ``host_views``: a callable listing the host copies' gradient
    places (``GradPlaces``)."""

    def __init__(self, params: dict[Key, list[nn.Parameter]], stats: dict[Key, list[torch.Tensor]],
                 placed: set[Key], lazy: set[Key], dtype: torch.dtype, device: torch.device, host_views,
                 zeros) -> None:
        self.params, self.placed, self.lazy = params, placed, lazy
        sizes = {k: (sum(p.numel() for p in params[k]), sum(b.numel() for b in stats[k])) for k in params}
        numel = sum(n + g * self.holds(k) for k, (g, n) in sizes.items())
        self.flat = zeros(numel, dtype, device)
        # per part: (its segment, its gradients, its statistics' copy, the statistics buffers)
        # The buffers keep storage of their own: autograd saves BatchNorm's running statistics
        # for backward, and a view of the bucket would share its version counter with the
        # gradients being accumulated, failing autograd's in-place check.
        self.segments: dict[Key, tuple[torch.Tensor, torch.Tensor, torch.Tensor, list]] = {}
        self.places = GradPlaces(host_views)   # where each bucket parameter's .grad lives
        self.offsets: dict[int, int] = {}   # id(parameter) -> where its gradient starts in the bucket
        offset = 0
        for k, (n_grad, n_stats) in sizes.items():
            if not self.holds(k):   # offsets relative to the part only (not into the bucket)
                segment = self.flat[offset:offset + n_stats]
                self.segments[k] = (segment, segment[:0], segment, stats[k])
                at = offset
                for p in params[k]:
                    release(p)      # no bucket of an earlier engine on these parameters takes their gradients
                    p.grad = None   # autograd makes one per backward (hostweights), or ``gradients`` its place
                    self.offsets[id(p)] = at
                    at += p.numel()
                offset += n_stats
                continue
            segment = self.flat[offset:offset + n_grad + n_stats]
            self.segments[k] = (segment, segment[:n_grad], segment[n_grad:], stats[k])
            for p in params[k]:
                self.places.add(p, formats.like(self.flat[offset:offset + p.numel()], p))   # p's strides: NHWC stays
                self.offsets[id(p)] = offset
                offset += p.numel()
            offset += n_stats

    def holds(self, key: Key) -> bool:
        """Whether part ``key``'s gradients live in the bucket (its model state on the device)."""
        return key not in self.placed and key not in self.lazy

    def span(self, params: list[nn.Parameter]) -> tuple[int, int]:
        """Where the gradients of ``params`` (contiguous, in this order) begin and end in the bucket."""
        return self.offsets[id(params[0])], self.offsets[id(params[-1])] + params[-1].numel()

    def lay_out(self, key: Key, ordered: list[nn.Parameter]) -> None:
        """Place the gradients of part ``key`` in its segment in the order ``ordered`` (before the
        first step: the bucket holds zeros)."""
        offset = min((self.offsets[id(p)] for p in ordered), default=0)
        for p in ordered:
            if self.holds(key):   # the others' are laid out on the host alone
                self.places.move(p, formats.like(self.flat[offset:offset + p.numel()], p))
            self.offsets[id(p)] = offset
            offset += p.numel()
        self.params[key] = ordered

    @torch.no_grad()
    def flatten(self, params: list[nn.Parameter], lo: int, hi: int, into: torch.Tensor | None = None) -> torch.Tensor:
        """One buffer holding ``params`` (the bucket's [lo, hi)), each parameter's data now a view of it:
        ``into`` (hi - lo elements), or a new one."""
        flat = torch.empty(hi - lo, dtype=params[0].dtype, device=params[0].device) if into is None else into
        for p in params:
            start = self.offsets[id(p)] - lo
            view = formats.like(flat[start:start + p.numel()], p)
            view.copy_(p)
            p.data = view
        return flat
