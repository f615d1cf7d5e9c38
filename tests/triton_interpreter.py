"""Triton's interpreter (the Triton kernel tests on the CPU) without its repeated patching of ``triton.language``.

A kernel launch patches ``triton.language``'s builtins with their interpreted versions for the launch's duration;
triton 3.x then patches them again at every call of a ``@triton.jit`` device function (once per call per program
instance), walking the modules' members with ``inspect.getmembers`` each time. Those nested patches change
nothing (the builtins are already patched), yet took 38% of an MLA decode test's profile. Here a device function
called inside a launch that patched its language modules runs at once; anything else goes through Triton.
"""
from __future__ import annotations

import functools
import inspect


def skip_nested_language_patches() -> None:
    """Installs the shortcut; changes nothing where triton or the interpreter's hooks are missing."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    if not all(hasattr(interpreter, name) for name in ('GridExecutor', 'InterpretedFunction', 'InterpreterError')):
        return
    launch, device_call = interpreter.GridExecutor.__call__, interpreter.InterpretedFunction.__call__
    patched: list[set[int]] = []  # the language modules patched by each launch in progress

    def languages(fn) -> set[int]:
        return {id(value) for value in fn.__globals__.values() if inspect.ismodule(value) and value in (tl, tl.core)}

    @functools.wraps(launch)
    def patched_launch(self, *args, **kwargs):
        patched.append(languages(self.fn))
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched.pop()

    @functools.wraps(device_call)
    def patched_device_call(self, *args, **kwargs):
        if not patched:
            return device_call(self, *args, **kwargs)
        needed = languages(self.fn)
        if not needed <= patched[-1]:  # Triton patches them (they stay patched) and runs it
            patched[-1] |= needed
            return device_call(self, *args, **kwargs)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # as Triton's own device call reports it
            raise interpreter.InterpreterError(repr(e)) from e

    interpreter.GridExecutor.__call__ = patched_launch
    interpreter.InterpretedFunction.__call__ = patched_device_call
