"""Stateful drop-ins for ordinary training loops: :class:`KFACPreconditioner` (module
hooks feed the pure step; ``step()`` rewrites ``.grad``), its kfac-pytorch arguments, and
:class:`LambdaParamScheduler`. The adapter owns no math.
"""
