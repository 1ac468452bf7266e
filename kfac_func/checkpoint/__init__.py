"""Checkpoints of K-FAC states: flat tensor dicts and state files
(:mod:`~kfac_func.checkpoint.state_files`), and per-layer factor directories written by
the ranks that own the factors (:mod:`~kfac_func.checkpoint.factor_dir`).
"""
