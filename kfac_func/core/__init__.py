"""Pure K-FAC math: scaling conventions, factors from Gram statistics, decompositions
(eigen, inverse, QR refresh), preconditioning and the kl_clip scale, and the quadratic
model of the adaptive step. No process group, no module, no hook.

The step's stages (:mod:`kfac_func.step`) call these on one layer at a time; they are for
code that works on one layer's factors itself.

Example:
    >>> import torch
    >>> from kfac_func.core import eigen_decompose
    >>> a, g = torch.eye(3), 2 * torch.eye(2)
    >>> eigen_decompose(a, g, damping=0.0).qa.shape
    torch.Size([3, 3])
"""

from kfac_func.core.attempts import DecompositionError
from kfac_func.core.conventions import CONVENTIONS, Convention
from kfac_func.core.decomposition import (
    EigenDecomposition,
    EKFACDecomposition,
    InverseDecomposition,
)
from kfac_func.core.factors import a_factor, g_factor
from kfac_func.core.layer_decomposition import eigen_decompose, inverse_decompose
from kfac_func.core.preconditioning import kl_clip_scale, precondition
from kfac_func.core.quadratic import QuadraticSolution, lm_damping, solve_quadratic

__all__ = [
    "CONVENTIONS",
    "Convention",
    "DecompositionError",
    "EKFACDecomposition",
    "EigenDecomposition",
    "InverseDecomposition",
    "QuadraticSolution",
    "a_factor",
    "eigen_decompose",
    "g_factor",
    "inverse_decompose",
    "kl_clip_scale",
    "lm_damping",
    "precondition",
    "solve_quadratic",
]
