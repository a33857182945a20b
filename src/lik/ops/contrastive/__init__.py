"""In-batch contrastive training on MaxSim scores (:func:`lik.contrastive_loss`): one autograd node, the MaxSim
launches and one cross-entropy kernel."""

from .function import contrastive_loss
from .reference import contrastive_loss_reference

__all__ = ["contrastive_loss", "contrastive_loss_reference"]
