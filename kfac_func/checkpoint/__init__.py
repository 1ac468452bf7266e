"""Checkpoints of K-FAC states: the errors (:mod:`~kfac_func.checkpoint.errors`), the
format (:mod:`~kfac_func.checkpoint.state_format`), flat tensor dicts
(:mod:`~kfac_func.checkpoint.state_dict`) and state files
(:mod:`~kfac_func.checkpoint.state_files`), and per-layer factor directories written by the
ranks that own the factors (:mod:`~kfac_func.checkpoint.factor_dir`, with their manifest in
:mod:`~kfac_func.checkpoint.factor_manifest` and the ranks' agreement in
:mod:`~kfac_func.checkpoint.factor_ranks`).
"""
