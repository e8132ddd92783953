from effmem.optim.fused_adam import FusedAdam
from effmem.optim.clip import clip_grad_norm_

__all__ = ["FusedAdam", "clip_grad_norm_"]
