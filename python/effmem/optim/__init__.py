"""effmem's optimizers: FusedAdam (Adam/AdamW with float32 masters in one fused kernel) and OffloadAdam (its
state and update on the host), and clip_grad_norm_, which clips by global norm across both."""
from effmem.optim.clip import clip_grad_norm_
from effmem.optim.fused_adam import FusedAdam
from effmem.optim.offload_adam import OffloadAdam
from effmem.optim._clip_route import install as _install_clip_route
from effmem.optim._dcp_route import install as _install_dcp_route

# torch.nn.utils.clip_grad_norm_ would see no gradients where an OffloadAdam took them off: it routes those
# to the optimizer from now on (_clip_route says why and what it cannot reach)
_install_clip_route()
# torch.distributed.checkpoint's state helpers would step an OffloadAdam that holds gradients (_dcp_route says why)
_install_dcp_route()

__all__ = ["FusedAdam", "OffloadAdam", "clip_grad_norm_"]
