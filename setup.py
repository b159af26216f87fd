"""Installs gems. The source folders partition/ and models/ become gems.partition and
gems.models, so nothing generic (a top-level ``models``) lands in site-packages."""
from pathlib import Path

from setuptools import setup

HERE = Path(__file__).resolve().parent
SOURCES = {"gems": "gems", "gems.partition": "partition", "gems.models": "models"}


def packages() -> list[str]:
    """Every folder holding an ``__init__.py`` under the three source folders, named as installed:
    a new subpackage cannot be left out of the wheel. (setuptools' automatic discovery refuses this
    flat layout, and a hand-kept list once missed gems.spatial.)"""
    found = []
    for package, folder in SOURCES.items():
        root = HERE / folder
        found += [".".join([package, *init.parent.relative_to(root).parts])
                  for init in sorted(root.rglob("__init__.py"))]
    return found


setup(
    name="gems",
    version="0.1.0",
    description="Memory-aware pipeline training of CNNs on very large images (GEMS-MAST)",
    python_requires=">=3.10",
    packages=packages(),
    package_dir=SOURCES,
    # TOML config files: the standard library reads them from Python 3.11, tomli before
    install_requires=["torch>=2.4", "torchvision>=0.19", "mpi4py>=3.1", "numpy", "tqdm", "tifffile",
                      "tomli>=1.1; python_version < '3.11'"],
    extras_require={
        # An MPI that pip can install, for laptops and CI. On a cluster, leave it out and
        # build mpi4py against the site's MPI instead (see README).
        "mpich": ["mpich"],
        "test": ["pytest>=7", "pytest-timeout", "pytest-xdist>=3.6", "hypothesis", "matplotlib",
                 "timm", "segmentation-models-pytorch", "safetensors", "tensorboard"],
        # --model timm:NAME / smp:ARCH:ENCODER, and --init-from FILE.safetensors
        "models": ["timm", "segmentation-models-pytorch", "safetensors"],
        # --tensorboard DIR writes TensorBoard event files
        "tensorboard": ["tensorboard"],
        # --trace-png draws timelines with matplotlib
        "plot": ["matplotlib"],
    },
    entry_points={
        "console_scripts": [
            "gems-plan=gems.cli.plan:main",
            "gems-train=gems.cli.train:main",
            "gems-predict=gems.cli.predict:main",
            "gems-export=gems.cli.export:main",
            "gems-bench=gems.cli.bench:main",
            "gems-data=gems.cli.data:main",
            "gems-sim=gems.cli.sim:main",
        ],
    },
)
