"""The pipeline runtime: the engine that executes a plan's stages on this rank (``engine.Engine``,
a facade over batches, stage runners, messaging, gradient sync, the executor and state).

What it executes comes from ``gems.schedule`` (the pure action lists); it reads a plan through
``gems.plan`` and talks through ``gems.comm``. The planner (``gems.partition``), the training
application and the CLIs sit above it.
"""
