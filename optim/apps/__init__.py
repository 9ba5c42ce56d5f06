"""The applications built on the library, apart from it: the ``sparsecomm`` command line (``cli``), the GPT train
job behind ``sparsecomm train`` (``train_job``) and ``sparsecomm bench`` (``benchmarks``; results and their
tables live in the checkout's ``benchmarks/`` folder). The library (:mod:`optim.optimizers`, :mod:`optim.state`,
:mod:`optim.resilient`, :mod:`optim.integrations`) never imports them.
"""
