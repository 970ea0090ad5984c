"""kGLA, GLA with a key-dependent gate (paper, sec. 3.3):

    S_t = Diag(α_t)(I − β_t Diag(k_t ⊙ k_t)) S_{t-1} + k_t v_tᵀ

the diagonal part of the delta rule's correction. Same new parameters as GDN.
"""

from __future__ import annotations

from linjax.kernels import kgla
from linjax.mixers.gdn import GDN


class KGLA(GDN):
    mechanism = "kgla"
    kernel_module = kgla
    fla_kernel = "gla"  # FLA's GLA, with the key gate folded into its decay
