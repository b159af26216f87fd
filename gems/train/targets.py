"""Targets as the training application holds them, whatever the files say.

Classification: one int64 class index per image. Segmentation: an int64 label map per image
(pixel value = class index). A target the loss and the metrics must skip -- a pixel the user's
``--ignore-index`` marks, every pixel of an unreadable sample, every row that pads the last
validation batch -- is ``IGNORE``; the data layer maps the user's ignore index to it, so losses
and metrics know one value only.
"""
from __future__ import annotations

import torch

IGNORE = -1


def predicted_labels(output: torch.Tensor) -> torch.Tensor:
    """The class each output row (or pixel) predicts: argmax over channels (dim 1); a
    single-channel output (binary, BCE-with-logits) predicts class 1 where its logit is > 0."""
    if output.shape[1] == 1:
        return (output[:, 0] > 0).long()
    return output.argmax(1)
