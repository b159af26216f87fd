"""The schedule world, pure Python: no torch, no MPI, nothing of gems above ``gems.errors``.

A schedule is a function (name, K, m) -> for each position of a group, the ordered list of
actions it runs in one training step. The engine executes these lists, the simulator replays
them, the planner prices them and the validator proves them -- one source of truth.

    ir          the actions and the identity of every message (``Message``), wire order
    ordering    a greedy list scheduler of compute tasks and the rules it runs with
    search      each schedule's compute order, and for ``mast`` the best of several
    lowering    compute orders -> action lists: the messages, syncs and step around them
    generators  ``schedule(name, K, m)``: mp, gpipe, 1f1b, mast (split backward, searched orders)
    peers       other systems' schedules (ZB-V, DualPipeV) in the same IR, for comparison
    validate    proof that action lists are a complete, deadlock-free step
    posting     when a position posts its receives (the wire order and a look-ahead)
    topology    where every rank sits: rank -> (group, position, tile), and who syncs with whom
    simulate    replays the action lists with costs to predict a step
    sweep       simulated sweeps: weak scaling, every (schedule, K, m, P, D) of a world ranked
"""
