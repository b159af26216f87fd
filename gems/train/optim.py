"""The optimizer and the learning-rate curve of a training run.

Weight decay applies to weights only: every 1-dimensional parameter -- biases, and the scales
and shifts of BatchNorm, GroupNorm and LayerNorm -- goes into a second parameter group with
none, the usual practice for CNNs and transformers alike (decaying a normalisation's scale
fights the normalisation). A rule by dimension needs no module names, so it holds for every
stage of any model. The learning rate is a pure function of the step, so a resumed run
follows the same curve; the optimizer's state (moments, momentum) is in the checkpoint.
"""
from __future__ import annotations

import bisect
import math
from typing import Callable, Iterable

import torch

from gems.train.config import TrainConfig


def learning_rate(cfg: TrainConfig, step: int, total: int) -> float:
    """Linear warm-up, then cosine decay to zero, constant, or multiplied by ``lr_gamma`` at
    each of ``lr_milestones`` (step decay)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return cfg.lr
    if cfg.lr_schedule == "step":
        return cfg.lr * cfg.lr_gamma ** bisect.bisect_right(cfg.milestones(), step)
    progress = (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * progress))


def parameter_groups(params: Iterable[torch.nn.Parameter], weight_decay: float) -> list[dict]:
    """[weights with ``weight_decay``, 1-dimensional parameters without]: always both groups
    (one may be empty), so every rank's optimizer has the same groups in checkpoints."""
    params = list(params)
    return [{"params": [p for p in params if p.ndim > 1], "weight_decay": weight_decay},
            {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0}]


def make_optimizer(cfg: TrainConfig) -> Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]:
    """``params -> optimizer`` as ``gems.Engine`` takes it."""
    def build(params):
        groups = parameter_groups(params, cfg.weight_decay)
        if cfg.optimizer == "adam":
            return torch.optim.Adam(groups, lr=cfg.lr)
        if cfg.optimizer == "adamw":
            return torch.optim.AdamW(groups, lr=cfg.lr)
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum)
    return build
