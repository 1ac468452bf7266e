"""Pure K-FAC math: scaling conventions, factors from Gram statistics, decompositions
(eigen, inverse, QR refresh), preconditioning and the kl_clip scale. No process group,
no module, no hook.
"""
