"""Triton's CPU interpreter (`TRITON_INTERPRET=1`) without a cost that changes nothing.

The test suite and `benchmarks/activations.py` run the Triton kernels under the
interpreter; `patch_language_once_per_launch` is called once, after Triton is imported
with the interpreter on, and only then (it touches the interpreter's private
`_patch_lang`; where a Triton release lacks it nothing is changed).
"""

from __future__ import annotations


def patch_language_once_per_launch() -> None:
    """Triton's interpreter (3.7) patches `triton.language` at every launch and again at
    every call of a `@triton.jit` function inside the kernel, Triton's own `tl.sum`,
    `tl.zeros`, `tl.max` included (`InterpretedFunction.__call__`), scanning every member
    of four modules each time (13,227 scans in the memory test's DeltaProduct-3 case, 195
    with this patch; 14.9 -> 12.6 s). Those calls change nothing after the first: the launch
    has patched `triton.language` until it ends, and a helper's patch is never undone (so
    `triton.language.core`, which the standard library's helpers see, stays patched). A
    helper call whose language modules are patched in one of those two ways skips it;
    every other call patches as before."""
    import inspect

    import triton.language as tl
    from triton.runtime import interpreter

    patch = getattr(interpreter, "_patch_lang", None)
    if patch is None or not hasattr(interpreter, "_LangPatchScope") or getattr(patch, "once_per_launch", False):
        return  # another Triton release, or patched already
    launched: set[int] = set()  # modules the running launch patched (undone when it ends)
    for_good: set[int] = set()  # modules a helper patched (never undone)

    def patch_once(fn):
        wanted = {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}
        if launched:  # a helper: called only inside a launch
            if wanted <= launched | for_good:
                return interpreter._LangPatchScope()  # nothing to undo
            scope = patch(fn)
            for_good.update(wanted - launched)
            return scope
        scope = patch(fn)
        launched.update(wanted)
        restore = scope.restore

        def restore_and_forget() -> None:
            launched.clear()
            restore()

        scope.restore = restore_and_forget
        return scope

    patch_once.once_per_launch = True
    interpreter._patch_lang = patch_once
