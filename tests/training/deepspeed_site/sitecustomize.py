"""On the PYTHONPATH of the DeepSpeed test launches only (tests/training/launching.py): their processes skip DeepSpeed's
CPU shared-memory collective op.

DeepSpeed's CPU accelerator compiles that op (a C++ JIT build, 50-100 s on a 2-core machine, redone whenever the
installed DeepSpeed's path changes) as its communication backend starts, for its inference all-reduce alone; training
never calls it, and on a GPU it is never built. Without it the backend is plain torch.distributed (gloo here).
Nothing is imported here: the patch applies when DeepSpeed's own code imports deepspeed.comm.torch.
"""

import importlib.abc
import importlib.util
import sys

_MODULE = "deepspeed.comm.torch"


class _SkipSharedMemoryOp(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            module.build_shm_op = lambda: None

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _SkipSharedMemoryOp())
