"""On the PYTHONPATH of the DeepSpeed test launches only (tests/training/launching.py): two build costs of DeepSpeed's
CPU accelerator, cut for the tests.

- Its CPU shared-memory collective op (a C++ JIT build, 50-100 s on a 2-core machine) is compiled as its communication
  backend starts, for its inference all-reduce alone; training never calls it, and on a GPU it is never built. Without
  it the backend is plain torch.distributed (gloo here).
- Its CPU Adam (the offloaded optimizer's op, which the offload configs need) is compiled with `-O1` and no debug
  information instead of `-O3 -g`: 24 s instead of 50 s here. Its code is explicit SIMD intrinsics and IEEE arithmetic
  (no fast-math), so the optimisation level changes how fast it runs, not what it computes.
Nothing is imported here: each patch applies when DeepSpeed's own code imports the module.
"""

import importlib.abc
import importlib.util
import sys


def _no_shared_memory_op(module):
    module.build_shm_op = lambda: None


def _light_cpu_op_flags(module):
    heavy = module.CPUOpBuilder.cxx_args

    def cxx_args(self):
        return [a for a in heavy(self) if a not in ("-O3", "-g")] + ["-O1"]

    module.CPUOpBuilder.cxx_args = cxx_args


_PATCHES = {"deepspeed.comm.torch": _no_shared_memory_op,
            "deepspeed.ops.op_builder.cpu.builder": _light_cpu_op_flags}


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        patch = _PATCHES.pop(name, None)
        if patch is None:
            return None
        if not _PATCHES:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            patch(module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _PatchOnImport())
