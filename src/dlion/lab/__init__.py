"""dlion.lab: the tooling around the library.

The library (``dlion``: ``Lion``, ``DistributedLion``, the codecs, collectives,
quantisation, the one-process simulation and checkpoints) is what a training
job imports. The lab is everything used to exercise, measure and demonstrate it:

* ``cluster``      a virtual cluster on one machine: one network namespace per
                   rank, shaped links (``dlion cluster``)
* ``spawn``        run a function on N local Gloo ranks, for the tests, the demo
                   and the benchmarks (real jobs use ``torchrun``)
* ``models``       small models (CNNs for digits and MNIST-1D, a character GPT)
* ``data``         offline data sets (digits, MNIST-1D, Shakespeare), sharding
                   and batching
* ``demo``         ``dlion demo``: G-Lion vs D-Lion on local workers
* ``bench``        ``dlion bench``: codec, comm, overlap and end-to-end benchmarks
* ``experiments``  ``dlion experiment``: convergence sweeps against baselines
* ``faults``       fault injection: Byzantine sign hooks
* ``cli``          the ``dlion`` command

The lab imports the library; the library never imports the lab (only ``python -m dlion``,
the library's ``__main__``, hands over to :func:`dlion.lab.cli.main`).
"""
