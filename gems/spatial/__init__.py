"""Spatial parallelism: the first units of a model run on a tile group of P ranks, each holding
one tile of every activation, exchanging halos with its neighbours (``gems.spatial.halo``), and
their result is gathered on the group's leader for the rest of the pipeline (but for the skips to
a tiled suffix on another stage, which stay tiles: ``stage.tile_skips``).

    tiles = TileGroup(comm, ranks=[0, 1], grid=(2, 1), index=comm.rank, group=comm.group([0, 1]))
    stage = tile_stage(units[0:hi], 0, end, units.unit_names, tiles, image=(1, 3, 512, 512))

Parts: ``geometry`` (pure: tile ranges, the input range an output range needs), ``tiles`` (the
tile group, group sums, gather), ``halo`` (halo exchange; an autograd function with an exact
backward, as the sums and gather are), ``window`` (a convolution or max pooling joined with its
halos, the tile's interior computed while they travel), ``ops`` (layers on tiles), ``unit``
(which values are tiled; a unit's graph on tiles; what cannot be tiled), ``stage`` (a stage's
tiled prefix).
"""
from gems.spatial.stage import TiledUnit, check_grid, flatten, tile_stage
from gems.spatial.tiles import TileGroup

__all__ = ["TileGroup", "TiledUnit", "tile_stage", "check_grid", "flatten"]
