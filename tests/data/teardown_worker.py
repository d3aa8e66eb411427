"""One rank of a two-process run (torchrun) that trains tests/data/batch_problem.py in-process
and reports what is left when ``train`` returns: the run's contexts still alive (none: the
run, its model and its mesh are freed, not kept by a cache or a parked thread until the
interpreter's exit) and the process group (none)."""

import gc
import os
import sys

import torch

from deepsolve.problem import Context
from deepsolve.train import train

HERE = os.path.dirname(os.path.abspath(__file__))

train(os.path.join(HERE, "batch_problem.py"), overrides={"iterations": 3}, out=sys.argv[1],
      quiet=True)
gc.collect()
alive = sum(isinstance(o, Context) for o in gc.get_objects())
print(f"rank {os.environ.get('RANK')}: contexts alive {alive}, process group "
      f"{torch.distributed.is_initialized()}", flush=True)
