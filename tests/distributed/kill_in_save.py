"""Runs gems-train in this process and SIGKILLs itself halfway through writing the shard
of checkpoint number ``GEMS_TEST_KILL_AT_SAVE`` (a real torn write, for the checkpoint tests).

    python tests/distributed/kill_in_save.py 2 <gems-train arguments>
"""
import os
import signal
import sys

import torch

from gems import checkpoint
from gems.cli import train

kill_at = int(sys.argv.pop(1))
saves = 0
real_save = torch.save


def torn_save(obj, f, *args, **kwargs):
    global saves
    if isinstance(obj, dict) and "model" in obj:  # a stage shard, not an RNG file
        saves += 1
        if saves == kill_at:
            real_save(obj, f, *args, **kwargs)
            f.flush()
            f.truncate(f.tell() // 2)
            os.kill(os.getpid(), signal.SIGKILL)
    real_save(obj, f, *args, **kwargs)


checkpoint.torch.save = torn_save
train.main(sys.argv[1:])
