"""What torch.compile compiled before a module's hooks changed."""
import warnings

import torch


def forget_compiled_code(who: str, call: str) -> None:
    """Code torch.compile made before hooks were added to (or removed from) modules keeps the hooks it was
    compiled with: dynamo does not guard on them (torch._dynamo.config.skip_nnmodule_hook_guards), so a model
    compiled before, or another of the same classes, would run without the new ones (compress_activations
    then compressed nothing, OffloadAdam.attach's weights were never installed). Drop what was compiled (it
    compiles again, with the hooks, at the next call), and say so."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return
    # And guard on hooks from now on: a model of the same classes compiled later without them (a teacher beside an
    # attached student) made code that the hooked model then ran without its hooks (a reviewer's run)
    torch._dynamo.config.skip_nnmodule_hook_guards = False
    if counters["frames"].get("ok", 0):
        warnings.warn(f"{who}: code compiled by torch.compile before {call} would not run the hooks as they "
                      "are now; torch._dynamo.reset() drops it, so the next compiled call compiles again. Call "
                      f"{call} before the first compiled call to avoid the second compilation", stacklevel=3)
        torch._dynamo.reset()
        counters["frames"].clear()
