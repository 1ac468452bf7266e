"""Eigenbases refreshed when they drift, raced per second against Muon, SOAP, AdamW and
the recommended K-FAC recipe.

The recommended recipe (``kfac-moments-fresh``: Adam's step in K-FAC's eigenbasis,
factor statistics every step, every eigenbasis decomposed anew every 2 steps) spends most
of its optimizer time in ``eigh`` on wide layers, and its loss per step still falls when
the bases are fresher (decompositions every step end lower, every 4 or 8 steps higher).
``kfac-moments-drift`` checks every layer's bases every step and decomposes anew only the
layers whose A or G basis drifted past ``refresh_drift`` (``kfac_func/step/drift.py``;
``optimizers.DRIFT``): fresher bases where the factors move, no ``eigh`` where they do
not.

``python benchmarks/drift_race.py`` races it on ``lm``, ``lm4x`` and ``gpt2``
(``race_workloads.py``'s builders) with the race's tuning budget (``race.race``: the same
grid, knob and refinement as every raced optimizer) on the tuning seed and its best
setting on the evaluation seeds, beside AdamW, Muon, SOAP and ``kfac-moments-fresh`` at
the settings the committed race tuned (``benchmarks/results/race_<workload>.json``) on
the same seeds, in the same process: only ratios from one run compare. It writes
``benchmarks/results/drift_race.json``; ``--tables`` rewrites its table in
``docs/benchmarks.md``; ``--quick`` is the smoke test (tiny models, one seed, a temporary
folder). The columns are ``orthogonal_race.py``'s (the runner is shared).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import orthogonal_race as challenge

DRIFT_RACE = challenge.Challenge(
    "drift_race",
    ("kfac-moments-drift",),
    ("<!-- drift:start -->", "<!-- drift:end -->"),
    ("lm", "lm4x", "gpt2"),
)


def main(argv: list[str] | None = None) -> int:
    return challenge.main(argv, DRIFT_RACE)


if __name__ == "__main__":
    sys.exit(main())
