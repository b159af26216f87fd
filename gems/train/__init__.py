"""The application behind gems-train and gems-predict, above the pipeline runtime and the planner
(the CLIs in ``gems.cli`` sit above it).

- configuration: ``config`` (every gems-train flag), ``optim`` (optimizer, parameter groups, LR curve);
- data: ``samples`` (listing and checking sources), ``images`` (decoding), ``augment`` (joint image and
  mask views), ``datasets`` (what workers run), ``data`` (``TrainData``/``EvalData``: each rank's shard of
  every batch, resumable), ``seeds``, ``synth`` (gems-data synth), ``targets`` (the IGNORE convention);
- tasks: ``losses`` (sums and normalisers), ``scores`` (validation metrics summed over ranks),
  ``validation`` (--val-data, --keep-best);
- the runs: ``trainer`` (the training loop), ``predictor`` (gems-predict) with ``windows`` (sliding
  windows, stitching), ``regions`` (reading parts of large images) and ``outputs`` (masks,
  probabilities, CSV, written atomically);
- around them: ``checkpoint``, ``handshake`` (start-up agreement between ranks), ``progress`` (bar,
  JSON lines, summary), ``board`` (TensorBoard).
"""
