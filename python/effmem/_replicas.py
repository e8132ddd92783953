"""nn.DataParallel's replication refused for a model effmem patched. Its replicas copy each module's __dict__
shallowly, and with it a forward effmem bound to the original module: every replica would run the original, on
another GPU's inputs (a device mismatch at best). torch's replicate calls _replicate_for_data_parallel on every
module; a patched one holds functools.partial(refuse_replication, what, undo) there."""


def refuse_replication(what: str, undo: str) -> None:
    raise RuntimeError(f"{what} cannot be replicated by torch.nn.DataParallel (transformers' Trainer uses it on "
                       "several GPUs when not started by torchrun or accelerate launch): run one process per GPU "
                       f"(torchrun, DistributedDataParallel), or {undo} first")
