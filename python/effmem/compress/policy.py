"""Which saved tensors compress_activations quantises, and why the others are kept as they are."""
import fnmatch
import warnings
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Tuple, Union

import torch
from torch import Tensor, nn

from effmem import _C
from effmem.compress import _codec
from effmem.compress.tracker import is_param_like

ModuleSpec = Union[str, type]


@dataclass(frozen=True)
class CompressConfig:
    """Options of compress_activations (see its docstring for each one)."""
    bits: int = 8
    group_size: int = 128
    min_numel: int = 4096
    stochastic: bool = True
    seed: int = 0
    exclude_modules: Tuple[ModuleSpec, ...] = ()
    exclude: Optional[Callable[[Tensor], bool]] = None
    pack_bool_masks: bool = True
    track_exact: bool = True
    record: bool = False

    def __post_init__(self):
        _codec.check_config(self.bits, self.group_size)
        if isinstance(self.min_numel, bool) or not isinstance(self.min_numel, int) or self.min_numel < 0:
            raise ValueError(f"min_numel must be an int >= 0, got {self.min_numel!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        if self.exclude is not None and not callable(self.exclude):
            raise ValueError(f"exclude must be a callable taking a tensor, got {self.exclude!r}")
        for flag in ("stochastic", "pack_bool_masks", "track_exact", "record"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag} must be True or False, got {getattr(self, flag)!r}")
        # one name or type alone is one entry (a string would otherwise be taken a character at a time, and
        # a lone "*" among them excludes every module)
        one = isinstance(self.exclude_modules, (str, type))
        if not one and not isinstance(self.exclude_modules, Iterable):   # None: nothing excluded
            if self.exclude_modules is not None:
                raise ValueError(f"exclude_modules must be module names (glob patterns) or nn.Module subclasses, "
                                 f"got {self.exclude_modules!r}")
        specs = (self.exclude_modules,) if one else tuple(self.exclude_modules or ())
        for spec in specs:
            if not isinstance(spec, str) and not (isinstance(spec, type) and issubclass(spec, nn.Module)):
                raise ValueError(f"exclude_modules entries must be module names (glob patterns) or nn.Module "
                                 f"subclasses, got {spec!r}")
        object.__setattr__(self, "exclude_modules", specs)


def check_patterns(specs: Iterable[ModuleSpec], root: nn.Module) -> None:
    """Name patterns that match none of root's modules excluded nothing, silently (a typo: 'nett' for 'net'):
    refused where none matches, a warning where others do (one list for several model families: lm_head and
    embed_out). Checked when the modules are named (the `with` form's entry: modules added before it count)."""
    names = [n for n, _ in root.named_modules() if n]
    patterns = [s for s in specs if isinstance(s, str)]
    unmatched = [s for s in patterns if not any(fnmatch.fnmatchcase(n, s) for n in names)]
    if not unmatched:
        return
    why = (f"{', '.join(map(repr, unmatched))} {'matches' if len(unmatched) == 1 else 'match'} no module of "
           f"{type(root).__name__} (named as model.named_modules() names them: {', '.join(names[:4]) or 'none'}...)")
    if len(unmatched) == len(patterns):
        raise ValueError(f"exclude_modules: {why}")
    warnings.warn(f"exclude_modules: {why}; the other patterns exclude what they match", stacklevel=4)


def module_excluded(specs: Iterable[ModuleSpec], name: str, module: nn.Module) -> bool:
    """Whether a module (by qualified name, glob patterns allowed, or by type) is excluded."""
    for spec in specs:
        if isinstance(spec, str):
            if fnmatch.fnmatchcase(name, spec):
                return True
        elif isinstance(module, spec):
            return True
    return False


# Tensors with a last dim this small hold one or two numbers per row:
# statistics (rstd of a decomposed norm, the (min, scale) pairs of an already
# compressed tensor), not activations worth quantising.
ROW_STAT_MAX_LAST_DIM = 2


def attention_output(t: Tensor) -> bool:
    """Whether t is (a view of) a fused attention's output, the saved memory the compressors keep as it is:
    flash, memory-efficient, cuDNN, the CPU's flash (csrc/saved/hooks.cpp's rule, which says why)."""
    fn = (t._base if t._base is not None else t).grad_fn
    return fn is not None and fn.name().startswith("ScaledDotProduct")


def compared_inputs(out: Tensor) -> list:
    """The (grad_fn, output number) of each input that `out`'s reduction compares with `out`, its own result
    (amax, max(), an infinity norm, dist...: csrc/saved/hooks.cpp's compares_with_extreme); none for others."""
    return list(out.grad_fn.next_functions) if _C.compares_with_extreme(out) else []


def early_reason(cfg: CompressConfig, t: Tensor) -> Optional[str]:
    """The reason to keep `t` as it is that needs neither the model nor the tracker, or None."""
    if (type(t) not in (Tensor, nn.Parameter) or t.layout != torch.strided or t.is_nested
            or t.device.type == "meta" or t._is_zerotensor() or t.is_neg()):
        return "unsupported"   # (forward-mode AD's zero tangents hold no memory; a negated view, other bits)
    if is_param_like(t) or (t._base is not None and is_param_like(t._base)):
        return "parameter"
    return None


def value_reason(cfg: CompressConfig, t: Tensor) -> Optional[str]:
    """Reasons that depend on the tensor alone: dtype, size, shape."""
    if t.numel() == 0:
        return "small"
    if t.dtype == torch.bool:
        return None if cfg.pack_bool_masks and t.numel() >= cfg.min_numel else (
            "small" if cfg.pack_bool_masks else "integer")
    if not t.is_floating_point():
        return "integer" if not t.is_complex() else "dtype"
    if t.dtype not in _codec.FLOAT_DTYPES:
        return "dtype"
    if t.numel() < cfg.min_numel:
        return "small"
    if t.dim() == 0 or t.shape[-1] <= ROW_STAT_MAX_LAST_DIM:
        return "row_statistic"
    return None
