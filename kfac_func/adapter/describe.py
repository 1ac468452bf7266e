"""What a preconditioner's step is, in words: the first lines of ``print(kf.KFAC(model))``.

:func:`describe_step` reads the settings a :class:`~kfac_func.KFACPreconditioner` was
built with (its method, eigenbasis moments, orthogonalized step, KL clip, adaptive
step) and the table of its layers, so that the words follow any recipe or
argument, not a recipe's name; :func:`describe_schedule` says when it gathers statistics
and decomposes. :func:`counted` spells a count with its noun.
"""

from __future__ import annotations

from collections.abc import Callable
from fractions import Fraction
from typing import TYPE_CHECKING

from kfac_func.adapter.recipes import HEAD_NAMES
from kfac_func.step.hyper import GrowingInterval
from kfac_func.step.orthogonal import Orthogonal, takes_orthogonal

if TYPE_CHECKING:
    from kfac_func.adapter.preconditioner import KFACPreconditioner

__all__ = ["counted", "describe_schedule", "describe_step"]

_METHODS = {
    "EIGEN": "K-FAC's damped inverse (eigendecomposition, damping {damping})",
    "INVERSE": "K-FAC's damped inverse (explicit inverses, damping {damping})",
    "EKFAC": "EKFAC's step (K-FAC's eigenbasis with corrected eigenvalues, damping {damping})",
}
"""The step of the layers without eigenbasis moments, by ``compute_method``."""


def counted(n: int, noun: str) -> str:
    """``n`` and ``noun``, plural unless ``n`` is 1 (``noun`` + "s").

    Example:
        >>> counted(1, "layer"), counted(3, "parameter"), counted(0, "layer")
        ('1 layer', '3 parameters', '0 layers')
    """
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _number(value: float | Callable[[int], float] | None) -> str:
    """A hyperparameter as printed: ``:g`` for a number, "(scheduled)" for a callable."""
    if callable(value):
        return "(scheduled)"
    return f"{float(value):g}" if value is not None else "none"


def _power(side: str, p: float) -> str:
    """``side^(-p)``, with ``p`` as a fraction where it is a small one (0.5: ``-1/2``)."""
    f = Fraction(p).limit_denominator(64)
    exact = float(f) == p and f.denominator != 1
    return f"{side}^(-{f.numerator}/{f.denominator})" if exact else f"{side}^(-{p:g})"


def _orthogonal_words(o: Orthogonal, taking: int) -> str:
    """Muon's step under ``o``: on which curvature, which layers, how many of them."""
    p, q = o.powers
    if p and q:
        what = f"Muon's step on K-FAC's curvature, both sides ({_power('G', q)} · {_power('A', p)})"
    elif p:
        what = f"Muon's step on K-FAC's input curvature ({_power('A', p)})"
    elif q:
        what = f"Muon's step on K-FAC's output curvature ({_power('G', q)})"
    else:
        what = "Muon's step (no curvature: powers 0, 0)"
    if o.wider_than is not None:
        layers = f"the layers with a factor side wider than {o.wider_than}"
    else:
        layers = "every layer of one weight matrix"
    if o.skip == HEAD_NAMES:
        layers += " but the head (named lm_head, head, classifier or output)"
    elif o.skip is not None:
        layers += f" but those matching {o.skip!r}"
    if o.block is not None:
        layers += f", A in blocks of at most {o.block}"
    if o.every > 1:
        layers += f", their powers renewed at most every {o.every} steps"
    here = "none here" if taking == 0 else f"{counted(taking, 'layer')} here"
    return f"{what} on {layers}: {here}"


def describe_step(pre: KFACPreconditioner) -> str:
    """The step ``pre`` takes, in words, from its settings and its layers: the step of the
    layers without the orthogonalized step (Adam's step in K-FAC's eigenbasis, K-FAC's
    damped inverse by its method, or EKFAC's step), then Muon's step on K-FAC's curvature
    when ``pre.orthogonal`` is set (its powers, the layers taking it and how many of
    ``pre.layers`` do), then the KL clip and adaptive step when they are on.

    Example:
        >>> from torch import nn
        >>> import kfac_func as kf
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> describe_step(kf.KFAC(model, recipe="kfac-pytorch").preconditioner)
        "K-FAC's damped inverse (eigendecomposition, damping 0.001) with the KL clip 0.001"
        >>> print(describe_step(kf.KFAC(model).preconditioner))
        Adam's step in K-FAC's eigenbasis (betas 0.9, 0.95) on 2 layers; Muon's step on K-FAC's input curvature (A^(-1/2)) on the layers with a factor side wider than 512, A in blocks of at most 512: none here
        >>> model.add_module("head", nn.Linear(2, 2))
        >>> print(describe_step(kf.KFAC(model, recipe="orthogonal-two-sided").preconditioner))
        Muon's step on K-FAC's curvature, both sides (G^(-1/4) · A^(-1/4)) on every layer of one weight matrix but the head (named lm_head, head, classifier or output): 2 layers here
    """  # noqa: E501
    table = pre.layers
    o: Orthogonal | None = pre.orthogonal
    taking = 0 if o is None else sum(takes_orthogonal(s, o) for s in table.values())
    # without eigenbasis moments, the layers not taking Muon's step are not registered
    others = o is None or pre.eigenbasis_moments
    parts = []
    rest = len(table) - taking
    if pre.eigenbasis_moments:
        betas = f"betas {_number(pre.moment_beta1)}, {_number(pre.moment_beta2)}"
        parts.append(f"Adam's step in K-FAC's eigenbasis ({betas})")
    elif others:
        parts.append(_METHODS[pre.compute_method.name].format(damping=_number(pre.damping)))
    if o is not None:
        if parts:
            parts[0] += f" on {counted(rest, 'layer')}" if rest else " on no layer here"
        parts.append(_orthogonal_words(o, taking))
    words = "; ".join(parts)
    extras = _extras(pre)
    if not extras:
        return words
    return f"{words}{'; ' if len(parts) > 1 else ' '}{', '.join(extras)}"


def _every(interval: int | Callable[[int], int]) -> str:
    """An update interval in words: a number, a :class:`GrowingInterval`, or a schedule."""
    if isinstance(interval, GrowingInterval):
        first, most, until = interval.first, interval.most, interval.until
        words = _every(first)
        if most == first:
            return words
        if most == 2 * first:
            return f"{words}, every {most} from step {until}"
        return f"{words}, twice as far apart each time the run doubles from step {until}, at most every {most}"  # noqa: E501
    if callable(interval):
        return "on a schedule"
    return "every step" if int(interval) == 1 else f"every {int(interval)} steps"


def describe_schedule(pre: KFACPreconditioner) -> str:
    """When ``pre`` gathers factor statistics and decomposes, in words.

    Example:
        >>> import kfac_func as kf
        >>> from torch import nn
        >>> layer = nn.Linear(4, 2)
        >>> describe_schedule(kf.KFAC(layer, recipe="kfac-pytorch").preconditioner)
        'statistics every step; decompositions every step'
        >>> print(describe_schedule(kf.KFAC(layer).preconditioner))
        statistics every step, twice as far apart each time the run doubles from step 256, at most every 4; decompositions every 2 steps, twice as far apart each time the run doubles from step 256, at most every 32
    """  # noqa: E501
    return (
        f"statistics {_every(pre.factor_update_steps)}; "
        f"decompositions {_every(pre.inv_update_steps)}"
    )


def _extras(pre: KFACPreconditioner) -> list[str]:
    """What acts on every layer's step: the KL clip, the adaptive step."""
    out = []
    if pre.kl_clip is not None:
        out.append(f"with the KL clip {_number(pre.kl_clip)}")
    if pre.adaptive is not None:
        out.append("then the adaptive step (learning rate, momentum and damping)")
    return out
