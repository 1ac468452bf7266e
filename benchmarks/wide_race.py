"""The recommended recipe with Muon's step on its widest layers, raced per second against
Muon, SOAP, AdamW, ``kfac-moments-fresh`` and the same recipe with its A factors whole.

The recommended recipe (``kfac-moments-fresh``: Adam's step in K-FAC's eigenbasis, factor
statistics every step, every eigenbasis decomposed anew every 2 steps) spends most of a
wide model's step on the wide sides of its layers: on ``lm4x`` the four MLPs' 768-wide
factors are 8 of its 61 matrix factors and about 80 % of the ``eigh`` time, and their Grams
the largest part of the statistics. ``kfac-moments-wide`` (``optimizers.WIDE``) gives the
layers with a factor side wider than 512 Muon's orthogonalized step on K-FAC's input
curvature (``Orthogonal(wider_than=512, block=512)``, :mod:`kfac_func.step.orthogonal`,
one-sided: their G factors diagonal, no Gram and no ``eigh`` of them; an A factor wider
than 512 in diagonal blocks of at most 512, so that no matrix wider than 512 is
decomposed). ``kfac-moments-wide-whole`` is the same with every A factor whole: the race
of the two is what decides the blocks. The other layers keep the
recommended step; a model without such a side steps exactly as the recommended recipe
(``tests/test_orthogonal.py``), so the race runs the workloads that have one: ``lm4x``,
the autoencoder (its 784-pixel layers) and the CNN (its 512-input hidden layer).

``python benchmarks/wide_race.py`` races it with the race's tuning budget (``race.race``)
on the tuning seed and its best setting on the evaluation seeds, beside AdamW, Muon, SOAP
and ``kfac-moments-fresh`` at the settings the committed race tuned
(``benchmarks/results/race_<workload>.json``) on the same seeds, in the same process:
only ratios from one run compare. It writes ``benchmarks/results/wide_race.json``;
``--tables`` rewrites its table in ``docs/benchmarks.md``; ``--quick`` is the smoke test
(tiny models, one seed, a temporary folder). The columns are ``orthogonal_race.py``'s (the
runner is shared).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import orthogonal_race as challenge

WIDE_RACE = challenge.Challenge(
    "wide_race",
    ("kfac-moments-wide", "kfac-moments-wide-whole"),
    ("<!-- wide:start -->", "<!-- wide:end -->"),
    ("lm4x", "autoencoder", "mnist5k_cnn"),
)


def main(argv: list[str] | None = None) -> int:
    return challenge.main(argv, WIDE_RACE)


if __name__ == "__main__":
    sys.exit(main())
