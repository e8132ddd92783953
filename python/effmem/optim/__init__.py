from effmem.optim.clip import clip_grad_norm_
from effmem.optim.fused_adam import FusedAdam
from effmem.optim.offload_adam import OffloadAdam

__all__ = ["FusedAdam", "OffloadAdam", "clip_grad_norm_"]
