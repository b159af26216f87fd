"""The training application behind gems-train: configuration (``config``), data sharding and
loading (``data``), checkpoints (``checkpoint``), metrics logging (``metrics``), the start-up
agreement between ranks (``handshake``) and the training loop (``trainer``). Uses the pipeline
runtime and the planner; the CLIs in ``gems.cli`` sit above it.
"""
