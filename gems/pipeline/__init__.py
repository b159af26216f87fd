"""The pipeline runtime: the schedule IR and its generators, validator and simulator (pure, no
torch), topology, and the engine that executes a plan's stages on this rank (``engine.Engine``,
a facade over batches, stage runners, messaging, gradient sync, the executor and state).

Imports only ``gems.comm``, ``gems.plan``, ``gems.errors`` and ``gems.units`` from gems; the
planner (``gems.partition``), the training application and the CLIs sit above it.
"""
