"""gems: pipeline training of CNNs too large for one device, on very large images.

``gems.models`` builds models as ``nn.Sequential`` of splittable units, ``gems.partition``
profiles and cuts them into stages, ``gems.Engine`` trains a plan across MPI ranks.
"""
from gems.errors import GemsError

__version__ = "0.1.0"
__all__ = ["GemsError", "Engine", "__version__"]


def __getattr__(name):
    # The engine pulls in torch and MPI; import it only when asked for.
    if name == "Engine":
        from gems.pipeline.engine import Engine

        return Engine
    raise AttributeError(f"module 'gems' has no attribute {name!r}")
