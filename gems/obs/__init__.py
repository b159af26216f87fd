"""Measuring a run: memory metering against the plan's estimates (``memory``) and Chrome-trace
export of the executor's timed actions (``trace``), the network gems-bench predicts with
(``network``). Sits above the pipeline runtime, whose
action kinds and timer it reads, and below the training application and benchmarks.
"""
