"""The ``lit-parallel`` command and its subcommands (:mod:`~.cli` wires them): ``demo``, ``doctor``,
``consolidate``, ``advise``, ``bench``, ``lab``, and what they share: the torchrun launch (:mod:`~.launch`),
tables that fit the terminal (:mod:`~.terminal`) and the check for an optional extra (:mod:`~.extras`).

The top layer: it may import everything in the package, and nothing in the library imports it. Modules
here that ranks run by name (``python -m lit_parallel.commands...``) are listed in tests/test_layers.py.
"""
