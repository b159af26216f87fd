"""The benchmark behind gems-bench: every schedule on the same model, data and ranks, against one
unpartitioned rank.

    report = run(BenchConfig(model="resnet18", schedules="mp,mast"), comm)   # COLLECTIVE; rank 0 gets it

Parts: ``config`` (``BenchConfig``: the options, the counts derived from them and their checks;
``micro_batches_for``: each schedule's micro-batch count), ``runner`` (the task and synthetic batch
from the model's output, the plain PyTorch reference, one Engine per schedule, and the report,
whose columns its docstring defines).
"""
from gems.bench.config import BenchConfig, micro_batches_for
from gems.bench.runner import ScheduleResult, Task, run, synthetic_batch, task_of

__all__ = ["BenchConfig", "micro_batches_for", "Task", "task_of", "synthetic_batch", "ScheduleResult", "run"]
