"""Where each stage's inputs come from: a tensor goes from the stage that makes it straight to the
stages that read it, never through the stages between.

Stage s takes the tuple of tensors alive at its first unit (``LIVE_IN``) and returns the tuple
alive after its last. Of its inputs it needs only those its units read (``READS``); the others a
U-Net's skip connection, say, it merely passes on. ``stage_routes`` says, for every input
position of every stage, which earlier stage made that tensor and where it sits in that stage's
output tuple -- or that the stage does not read it, in which case the runtime puts an empty
placeholder there, which the units pass on untouched. A tensor made in stage i and read in stages
j and k then travels i -> j and i -> k, once each per micro-batch, and its gradients come back
the same ways (``gems.pipeline.routes`` turns the routes into messages; the planner prices them).
"""
from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from .split import LIVE_IN, READS

UNREAD = [-1, -1, False]


def stage_routes(units: nn.Sequential, cuts: Sequence[int]) -> list[list[list]]:
    """Per stage, per position of its input tuple: ``[stage that made the tensor, its position in
    that stage's output tuple, whether a gradient goes back]`` (``Plan.routes`` as it is), or ``UNREAD``. Stage 0's list is
    empty (its input is the data); no gradient goes back for the model's input. ``[]`` when the
    units carry no graph metadata (a plain ``nn.Sequential``): every stage then takes the whole
    output of the one before, as it is."""
    metas = [getattr(u, "meta", None) for u in units]
    if not all(isinstance(m, dict) and LIVE_IN in m for m in metas):
        return []
    K = len(cuts) - 1
    live = [metas[cuts[s]][LIVE_IN] for s in range(K)]             # stage s's input names
    outputs = [live[s + 1] for s in range(K - 1)]                  # stage s's output names
    model_input = live[0][0]
    routes: list[list[list]] = [[]]
    for s in range(1, K):
        read = {metas[k][LIVE_IN][q] for k in range(cuts[s], cuts[s + 1]) for q in metas[k][READS]}
        route = []
        for name in live[s]:
            if name not in read:
                route.append(list(UNREAD))
                continue
            maker = s - 1
            while maker > 0 and name in live[maker]:
                maker -= 1
            route.append([maker, outputs[maker].index(name), name != model_input])
        routes.append(route)
    return routes
