"""The ``hosts`` tier: real multi-host jobs on one machine, each host a network namespace
(``netbed``). Importable as ``tests.hosts`` from the repository root, for the bed's command line."""
