"""Counts the kernel launches a piece of work makes: every aten op that is not a view or an
allocation (each is a kernel on a GPU), made by kvslim rather than by Triton's interpreter, plus
every Triton kernel launch (interpreted or compiled)."""
from __future__ import annotations

import collections
import sys
from contextlib import ExitStack
from unittest import mock

from torch.utils._python_dispatch import TorchDispatchMode

NO_LAUNCH = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach", "lift_fresh",
             "_local_scalar_dense", "set_", "resize_", "record_stream"}


def inside_triton(depth: int = 2) -> bool:
    """Whether the caller ``depth`` frames up was called from Triton's code (its interpreter copies
    tensors to numpy and back by design)."""
    frame = sys._getframe(depth)
    while frame is not None:
        if frame.f_globals.get("__name__", "").startswith("triton"):
            return True
        frame = frame.f_back
    return False


class LaunchCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()
        self._patches = ExitStack()

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not func.is_view and name not in NO_LAUNCH and not inside_triton():
            self.counts[f"aten.{name}"] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        from triton.runtime import interpreter, jit

        for cls in (interpreter.InterpretedFunction, jit.JITFunction):
            run = cls.run

            def counted(fn_self, *args, _run=run, **kwargs):
                self.counts[f"triton.{getattr(fn_self, '__name__', None) or fn_self.fn.__name__}"] += 1
                return _run(fn_self, *args, **kwargs)

            self._patches.enter_context(mock.patch.object(cls, "run", counted))
        return super().__enter__()

    def __exit__(self, *exc):
        self._patches.close()
        return super().__exit__(*exc)
