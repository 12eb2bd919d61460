"""Local steps: synchronise every H steps instead of every step.

* :class:`DiLoCo` (:mod:`.diloco`): H inner-optimizer steps, then the pseudo-gradient (shared minus
  local parameters) is reduced by any sparsync reducer (dense: DiLoCo, Douillard et al. 2023;
  sparse with error feedback: SparseLoCo, 2025), averaged, and an outer Nesterov SGD step updates
  the shared parameters on every rank;
* :mod:`.postlocal`: torch's own post-local SGD (Lin et al. 2020) as the baseline row
  ``ddp-localsgd<H>``;
* :mod:`.trainer`: how ``sparsync train`` / ``compare`` run either.
"""

from .diloco import DiLoCo

__all__ = ["DiLoCo"]
