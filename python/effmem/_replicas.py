"""nn.DataParallel's replication refused for a model effmem patched. Its replicas copy each module's __dict__
shallowly, and with it a forward effmem bound to the original module: every replica would run the original, on
another GPU's inputs (a device mismatch at best). torch's replicate calls _replicate_for_data_parallel on every
module; a patched one holds functools.partial(refuse_replication, what, undo) there."""
import functools

from torch import nn


def refuse_replication(what: str, undo: str) -> None:
    raise RuntimeError(f"{what} cannot be replicated by torch.nn.DataParallel (transformers' Trainer uses it on "
                       "several GPUs when not started by torchrun or accelerate launch): run one process per GPU "
                       f"(torchrun, DistributedDataParallel), or {undo} first")


def holds_refusal(module: nn.Module, refusal: functools.partial) -> bool:
    """Whether `module` holds `refusal`, or a copy of it: copy.deepcopy, pickle and torch.load make a new partial,
    which an identity test missed, and a copy kept refusing DataParallel with its policy removed."""
    f = module.__dict__.get("_replicate_for_data_parallel")
    return isinstance(f, functools.partial) and f.func is refuse_replication and f.args == refusal.args
