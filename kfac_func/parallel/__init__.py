"""Model parallelism: Megatron-style column/row-parallel linears, the per-stage plan, the
collectives over data- and model-parallel groups, :class:`ParallelKFACPreconditioner`
and the GPT-NeoX (DeepSpeed pipeline) preconditioner. Builds on
:mod:`kfac_func.adapter` and :mod:`kfac_func.distributed`.
"""
