"""What FusedAdam and OffloadAdam share: Adam's hyper-parameters and checked param groups."""
from typing import Any, Dict, Tuple, Union

import torch
from torch import Tensor

from effmem.optim import _validate
from effmem.optim._offload_lifetime import check_unowned


class AdamBase(torch.optim.Optimizer):
    def __init__(self, params, lr: Union[float, Tensor], betas: Tuple[float, float], eps: float,
                 weight_decay: float, decoupled_weight_decay: bool, bias_correction: bool):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        decoupled_weight_decay=decoupled_weight_decay, bias_correction=bias_correction)
        _validate.hyperparameters(defaults)
        super().__init__(params, defaults)

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """torch's add_param_group (which fills in the defaults), then the checks; a group that
        fails them is taken out again, so a refused group leaves the optimizer as it was."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            _validate.hyperparameters(group)
            _validate.params(group["params"], [p for g in self.param_groups[:-1] for p in g["params"]])
            check_unowned(group["params"], type(self).__name__, me=self)
        except (TypeError, ValueError):
            self.param_groups.pop()
            raise
