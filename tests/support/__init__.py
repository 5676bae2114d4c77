"""Helpers shared by the test tiers (the public one is ``aiodist.testing``): fault-timing
records (``faults``), the launcher's harness (``launcher``), bounded waits (``waits``) and the
every-operation suite (``suite``). ``tests/`` is on ``sys.path`` (``tests/conftest.py``), so
spawned ranks import them as ``support.<module>`` too."""
