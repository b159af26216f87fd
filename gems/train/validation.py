"""Validation during training (``--val-data``, ``--val-every``, ``--keep-best``).

Every ``val_every`` steps and after the last one, the engine runs forward-only steps over the
whole validation set (``Engine.evaluate``: both mirrored replicas forward, nothing kept for
backward) and the task's scores (``gems.train.scores``) are summed over every rank before any
metric is computed -- confusion matrices and loss sums, never per-batch means -- so the
figures are those of one process over the whole set. Validation reads no random numbers, so a
resumed run reproduces them.

``--keep-best METRIC`` saves a checkpoint in ``CHECKPOINT_DIR/best`` whenever the metric
improves (higher is better except for the loss); the best value so far travels in every
checkpoint's manifest, so a resumed run keeps comparing against it.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

from gems.errors import GemsError
from gems.train import checkpoint
from gems.train.config import TrainConfig
from gems.train.data import EvalData
from gems.train.scores import METRICS, higher_is_better, make_scores
from gems.train.targets import predicted_labels


class Validation:
    """The validation set of one rank and what it remembers between validations."""

    def __init__(self, cfg: TrainConfig, groups: int, group: int, num_classes: int,
                 need_images: bool, need_labels: bool, rank0: bool) -> None:
        if cfg.keep_best and cfg.keep_best not in METRICS[cfg.task]:
            raise GemsError(f"--keep-best {cfg.keep_best} is not a metric of --task {cfg.task}: choose one of "
                            f"{', '.join(METRICS[cfg.task])}")
        self.cfg, self.num_classes = cfg, num_classes
        self.batch_size = cfg.val_batch_size or cfg.batch_size
        kwargs = dict(task=cfg.task, num_classes=num_classes, ignore_index=cfg.ignore_index,
                      binary_masks=cfg.binary_masks)
        self.data = EvalData(cfg.val_data, cfg.image_size, self.batch_size, groups, group, workers=cfg.workers,
                             need_images=need_images, need_labels=need_labels, **kwargs)
        # TensorBoard shows the first validation batch with its true and predicted masks: the ranks
        # holding a first stage read its images once more, rank 0 its masks too (it may hold no
        # last stage, so it has none otherwise) and gets the prediction (engine.predict)
        self._rank0 = rank0
        self._sample = (EvalData(cfg.val_data, cfg.image_size, self.batch_size, groups, group, workers=0,
                                 need_images=True, need_labels=rank0, **kwargs)
                        if cfg.tensorboard and cfg.task == "segmentation" and (need_images or rank0) else None)
        self.best: float | None = None

    def due(self, step: int, total: int) -> bool:
        return step == total or bool(self.cfg.val_every and step % self.cfg.val_every == 0)

    def run(self, engine, loss) -> dict:
        """The task's metrics over the whole validation set, on every rank. COLLECTIVE."""
        scores = make_scores(self.cfg.task, self.num_classes, loss)
        return engine.evaluate(self.data.batches(), scores, batch_size=self.batch_size)

    def overlays(self, engine) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(images, true masks, predicted masks) of the first validation batch on rank 0 when
        TensorBoard wants them (None elsewhere). COLLECTIVE (a forward-only step)."""
        if not (self.cfg.tensorboard and self.cfg.task == "segmentation"):
            return None
        images, truth = next(iter(self._sample.batches())) if self._sample is not None else (None, None)
        out = engine.predict(images if engine.needs_images else None, batch_size=self.batch_size)
        if not self._rank0 or out is None:
            return None
        return images, truth, predicted_labels(out)

    def improved(self, metrics: dict) -> bool:
        """Whether ``metrics`` beats the best ``--keep-best`` value so far (remembering it)."""
        name = self.cfg.keep_best
        value = metrics.get(name) if name else None
        if value is None or math.isnan(value):
            return False
        better = self.best is None or (value > self.best if higher_is_better(name) else value < self.best)
        if better:
            self.best = value
        return better

    def save_best(self, engine, step: int, meta: dict) -> Path:
        """The current model as ``CHECKPOINT_DIR/best`` (the previous best removed once it is
        written). COLLECTIVE."""
        return checkpoint.save(engine, Path(self.cfg.checkpoint_dir) / "best", step, meta, keep=1)
