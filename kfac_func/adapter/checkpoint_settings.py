"""The settings a preconditioner's state dict records beside its factors.

Two kinds, treated differently on load:

- the hyperparameters (``damping``, ``factor_update_steps``, ...): restored from the
  checkpoint as kfac-pytorch restores them, with one warning that names every value the
  checkpoint replaced (``old → new``) where the constructor chose another value than the
  checkpoint's run was constructed with (saved under ``"constructed"``): resuming a run
  whose scheduler moved a value is silent, loading it into a preconditioner built with
  other settings is not;
- the settings that decide what the stored factors *mean* (:func:`meaning_settings`: the
  scaling convention, the compute method, the eigenbasis moments, the factor dtype, each
  layer's kind and ``kfac_approx``): saved under ``"settings"``, and a checkpoint whose
  settings differ from the preconditioner's is refused with a ValueError naming each one
  (:func:`check_settings`). Checkpoints written before these were saved load unchecked.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kfac_func.adapter.arguments import HYPER
from kfac_func.state import KFACState

if TYPE_CHECKING:
    from kfac_func.adapter.arguments import PreconditionerBase

__all__ = [
    "CONSTRUCTED_KEY",
    "SETTINGS_KEY",
    "check_settings",
    "hyperparameter_entries",
    "load_hyperparameters",
    "meaning_settings",
    "replaced_choices",
    "warn_replaced",
]

SETTINGS_KEY = "settings"
"""The state-dict key under which :func:`meaning_settings` are saved."""

CONSTRUCTED_KEY = "constructed"
"""The state-dict key of the hyperparameters the saving preconditioner was built with."""


def replaced_choices(
    keys: Sequence[str],
    saved_constructed: Mapping[str, Any] | None,
    constructed: Mapping[str, Any],
    state_dict: Mapping[str, Any],
) -> list[str]:
    """The hyperparameters of ``keys`` a state dict replaces that this preconditioner's
    constructor chose otherwise than the checkpoint's run: those whose ``constructed``
    (non-callable) value differs from ``saved_constructed``'s (without that record, an
    older checkpoint: from the state dict's value).

    Example:
        >>> replaced_choices(["damping"], {"damping": 0.01}, {"damping": 1e-3},
        ...                  {"damping": 0.005})
        ['damping']
        >>> replaced_choices(["damping"], {"damping": 1e-3}, {"damping": 1e-3},
        ...                  {"damping": 0.005})  # the same construction, scheduled
        []
    """
    out = []
    for key in keys:
        mine = constructed.get(key)
        if key not in state_dict or callable(mine):
            continue
        theirs = (saved_constructed or {}).get(key, state_dict[key])
        if theirs != mine:
            out.append(key)
    return out


def meaning_settings(state: KFACState, eigenbasis_moments: bool) -> dict[str, Any]:
    """The settings that decide what ``state``'s factors, decompositions and moments mean,
    as plain data (strings, bools, dicts: loadable with ``weights_only=True``).

    Example:
        >>> from torch import nn
        >>> import kfac_func as kf
        >>> s = meaning_settings(kf.init(kf.register(nn.Linear(2, 2))), False)
        >>> s["scaling"], s["compute_method"], s["factor_dtype"], s["kinds"]
        ('fisher', 'eigen', 'float32', {'': 'linear'})
    """
    cfg = state.config
    specs = {name: ls.spec for name, ls in state.layers.items()}
    return {
        "scaling": cfg.convention,
        "compute_method": cfg.compute_method,
        "eigenbasis_moments": bool(eigenbasis_moments),
        "factor_dtype": str(cfg.factor_dtype).removeprefix("torch."),
        "kinds": {name: spec.kind for name, spec in specs.items()},
        "kfac_approx": {
            name: "reduce" if spec.block.reduced(spec) else "expand" for name, spec in specs.items()
        },
    }


def check_settings(saved: Mapping[str, Any] | None, current: Mapping[str, Any]) -> None:
    """Raise a ValueError naming every setting of ``saved`` (a checkpoint's) that differs
    from ``current`` (per layer for the per-layer ones). None (a checkpoint written before
    settings were saved) and settings the checkpoint does not hold pass.

    Example:
        >>> check_settings({"scaling": "fisher"}, {"scaling": "kfac-pytorch"})
        Traceback (most recent call last):
        ...
        ValueError: state_dict settings differ from this preconditioner's: scaling='fisher' \
in the state_dict, 'kfac-pytorch' here; build the preconditioner with the checkpoint's \
settings to load it
    """
    if saved is None:
        return
    if not isinstance(saved, Mapping):
        raise ValueError(f"state_dict {SETTINGS_KEY!r} must be a dict, got {type(saved).__name__}")
    diffs = []
    for key, want in current.items():
        if key not in saved:
            continue
        got = saved[key]
        if isinstance(want, Mapping) and isinstance(got, Mapping):
            diffs += [
                f"layer {name!r}: {key}={got[name]!r} in the state_dict, {want[name]!r} here"
                for name in want
                if name in got and got[name] != want[name]
            ]
        elif got != want:
            diffs.append(f"{key}={got!r} in the state_dict, {want!r} here")
    if diffs:
        raise ValueError(
            "state_dict settings differ from this preconditioner's: "
            + "; ".join(diffs)
            + "; build the preconditioner with the checkpoint's settings to load it"
        )


def warn_replaced(
    keys: Sequence[str], before: Mapping[str, Any], after: Mapping[str, Any], *, stacklevel: int
) -> None:
    """One UserWarning naming each of ``keys`` whose value changed (``old → new``), none
    when nothing changed.

    Example:
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as w:
        ...     warnings.simplefilter("always")
        ...     warn_replaced(["damping"], {"damping": 1e-3}, {"damping": 0.01}, stacklevel=1)
        >>> print(w[0].message)
        load_state_dict replaced the constructor's settings with the state_dict's: \
damping 0.001 → 0.01
    """
    changed = [f"{k} {before[k]!r} → {after[k]!r}" for k in keys if before[k] != after[k]]
    if changed:
        warnings.warn(
            "load_state_dict replaced the constructor's settings with the state_dict's: "
            + ", ".join(changed),
            UserWarning,
            stacklevel=stacklevel + 1,
        )


def hyperparameter_entries(owner: PreconditionerBase, settings: dict[str, Any]) -> dict[str, Any]:
    """The entries a preconditioner's state dict begins with: ``steps``, the non-callable
    hyperparameters of :data:`~kfac_func.adapter.arguments.HYPER`, the ``settings`` (its
    :func:`meaning_settings`) and the non-callable hyperparameters it was constructed with.

    Example:
        >>> from torch import nn
        >>> import kfac_func as kf
        >>> pre = kf.KFACPreconditioner(nn.Linear(2, 2), damping=lambda k: 0.1)
        >>> sd = hyperparameter_entries(pre, {})
        >>> sorted(sd), sd["constructed"]["lr"]
        (['constructed', 'factor_decay', 'factor_update_steps', 'inv_update_steps', \
'kl_clip', 'lr', 'settings', 'steps'], 0.1)
    """
    sd: dict[str, Any] = {"steps": owner.steps}
    sd.update({k: v for k in HYPER if not callable(v := getattr(owner, k))})
    sd[SETTINGS_KEY] = settings
    made = getattr(owner, "_constructed", {})
    sd[CONSTRUCTED_KEY] = {k: v for k, v in made.items() if not callable(v)}
    return sd


def load_hyperparameters(
    owner: PreconditionerBase, sd: dict[str, Any], settings: Mapping[str, Any]
) -> tuple[list[str], dict[str, Any]]:
    """Check the settings of the state dict ``sd`` against ``settings`` (a ValueError
    names those that differ; nothing changes then), then set its hyperparameters on
    ``owner`` but where ``owner`` holds a callable; both records are popped from ``sd``.
    Returns the hyperparameters the constructor chose otherwise than the checkpoint's
    run (:func:`replaced_choices`) and the values before, for :func:`warn_replaced` (and
    for putting them back if the rest of the state dict is refused).

    Example:
        >>> from torch import nn
        >>> import kfac_func as kf
        >>> pre = kf.KFACPreconditioner(nn.Linear(2, 2), damping=0.01)
        >>> sd = {"damping": 0.5, "constructed": {"damping": 0.01}}
        >>> load_hyperparameters(pre, sd, {})[0], pre.damping, sd
        ([], 0.5, {'damping': 0.5})
    """
    check_settings(sd.pop(SETTINGS_KEY, None), settings)
    made = getattr(owner, "_constructed", {})
    chosen = replaced_choices(HYPER, sd.pop(CONSTRUCTED_KEY, None), made, sd)
    old = {key: getattr(owner, key) for key in HYPER}
    for key in HYPER:
        if key in sd and not callable(old[key]):
            setattr(owner, key, sd[key])
    return chosen, old
