"""K-FAC across ranks: the plan (who decomposes and preconditions what, pure data), the
communicator that executes it over ``torch.distributed``, and the KAISA step that
composes the math of :mod:`kfac_func.step` with the communicator.
"""
