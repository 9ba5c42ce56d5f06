"""The optimizers: AdamS and its sharded, sparse (SCAPE) and local forms, wrappers of any ``torch.optim`` optimizer
(``LocalOptimizer``, ``CodedGradients``, ``DiLoCo``, ``SparseLoCo``, ``MaskedLoCo``, ``DeMo``,
``TopKGradients``) and the parts they share (buckets, averaging,
codes, noise).

Their public classes are re-exported by :mod:`optim`; what the loop, export and re-shard ask of each is in
:mod:`optim.optimizers.capabilities`.
"""
