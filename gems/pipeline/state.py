"""Model and optimizer state of a partitioned model, keyed by the model's own names.

Each rank holds some stages (``model[lo:hi]`` keeps the original unit names), so a stage's
``state_dict`` already uses the full model's keys. Optimizer state is re-keyed from the
optimizer's positional indices to parameter names, so a checkpoint written under one partition
loads under any other.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn

from gems.errors import GemsError


class StageState:
    """State of the stages this rank holds (``stages``: {stage: module}) and of its optimizer.

    ``copy_holder``: whether this rank's copies are the ones gathered into the full state dict
    (group 0's), ``model_keys``: the full model's state-dict keys in order."""

    def __init__(self, comm, stages: dict[int, nn.Module], optimizer: torch.optim.Optimizer,
                 copy_holder: bool, model_keys: list[str], key: Callable[[str], str] = str,
                 extras: dict[str, torch.Tensor] | None = None, shards=None,
                 optimized: Callable[[nn.Parameter], torch.Tensor] = lambda p: p,
                 values: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> None:
        self.comm, self.stages, self.optimizer = comm, stages, optimizer
        self.copy_holder, self._order = copy_holder, {k: i for i, k in enumerate(model_keys)}
        self.key = key              # a stage's state-dict key -> the model's (gems.graph.GraphUnits)
        self.extras = extras or {}  # model state no unit uses (e.g. an unused head): kept as loaded
        self.shards = shards        # the sync groups sharing the optimizer, in one order (None: this rank's holds all)
        self.optimized = optimized  # a stage's parameter -> the one the optimizer updates (a host copy, or itself)
        self.values = values        # a stage's tensor -> the one holding its values (a parameter on the host: its copy)

    def _own(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """A stage's state, keyed by the model's names (a tensor two units share appears once); a
        parameter living in host memory (its device storage empty between uses) by its host copy."""
        return {self.key(k): self.values(v).detach() for k, v in module.state_dict(keep_vars=True).items()}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The full model's state dict (keys as ``model.state_dict()``), on every rank. COLLECTIVE."""
        mine = {k: v.detach().cpu().clone() for k, v in self.extras.items()} if self.comm.rank == 0 else {}
        if self.copy_holder:
            for s in self.stages.values():
                mine.update({k: v.detach().cpu().clone() for k, v in self._own(s).items()})
        full: dict[str, torch.Tensor] = {}
        for part in self.comm.allgather_object(mine):
            full.update(part)
        return dict(sorted(full.items(), key=lambda kv: self._order.get(kv[0], math.inf)))

    def _opt_names(self) -> list[str]:
        """Parameter names in the optimizer's own index order."""
        name_of = {id(self.optimized(p)): self.key(n) for s in self.stages.values() for n, p in s.named_parameters()}
        return [name_of[id(p)] for g in self.optimizer.param_groups for p in g["params"]]

    def stage_state(self, stage: int) -> dict:
        """Everything a checkpoint shard keeps for one stage this rank holds: model tensors
        and optimizer state keyed by the model's own names (so any partition can load it)."""
        module = self.stages[stage]
        own = {self.key(n) for n, _ in module.named_parameters()}
        opt = self.optimizer.state_dict()
        names = self._opt_names()
        extras = self.extras if stage == 0 else {}   # stage 0's shard carries them
        state = {names[i]: {k: (v.detach().cpu().clone() if torch.is_tensor(v) else v) for k, v in st.items()}
                 for i, st in opt["state"].items()}
        for group in self.shards or ():   # every member's share of every stage the group holds, group by group
            state = {n: st for part in self.comm.allgather_object(state, group) for n, st in part.items()}
        return {
            "model": {k: v.detach().cpu().clone() for k, v in {**extras, **self._own(module)}.items()},
            "optimizer": {n: st for n, st in state.items() if n in own},
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in opt["param_groups"]],
        }

    def load_state(self, model: dict[str, torch.Tensor], optimizer: dict[str, dict] | None = None,
                   param_groups: list[dict] | None = None) -> None:
        """Load full-model state (from any partition): each rank takes its stages' entries."""
        for module in self.stages.values():
            missing = [k for k in self._own(module) if k not in model]
            if missing:
                raise GemsError(f"the checkpoint lacks {missing[0]} (and {len(missing) - 1} more): "
                                "it was saved from a different model")
        for module in self.stages.values():
            module.load_state_dict({k: model[self.key(k)] for k in module.state_dict().keys()})
        self.extras = {k: model.get(k, v) for k, v in self.extras.items()}
        if optimizer is None:
            return
        current = self.optimizer.state_dict()
        names = self._opt_names()
        current["state"] = {i: optimizer[n] for i, n in enumerate(names) if n in optimizer}
        if param_groups and len(param_groups) == len(current["param_groups"]):
            for group, saved in zip(current["param_groups"], param_groups):
                group.update({k: v for k, v in saved.items() if k != "params"})
        self.optimizer.load_state_dict(current)
