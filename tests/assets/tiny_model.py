"""A user model factory for tests: ``--model tests/assets/tiny_model.py:tiny``."""
from torch import nn


def tiny(num_classes: int = 10) -> nn.Sequential:
    def block(cin: int, cout: int, stride: int = 1) -> nn.Sequential:
        return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU())
    return nn.Sequential(block(3, 8), block(8, 16, 2), block(16, 16), block(16, 16, 2),
                         nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, num_classes)))


def tiny_segmenter(num_classes: int = 3) -> nn.Sequential:
    """A per-pixel classifier without BatchNorm (batch-independent: GroupNorm), full resolution."""
    def block(cin: int, cout: int) -> nn.Sequential:
        return nn.Sequential(nn.Conv2d(cin, cout, 3, 1, 1), nn.GroupNorm(4, cout), nn.ReLU())
    return nn.Sequential(block(3, 16), block(16, 16), block(16, 16), nn.Conv2d(16, num_classes, 1))


def small_preact(num_classes: int = 10) -> nn.Sequential:
    """The zoo's pre-activation ResNet at its smallest depth, 20 (a name registers 110 at least):
    the same units, few enough for a test to plan and train it quickly."""
    from gems.models import build  # noqa: PLC0415 - the factories above need nothing but torch
    return build("preact-resnet", num_classes=num_classes, depth=20)
