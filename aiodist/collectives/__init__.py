"""Collective algorithms, written only against ``OpContext`` (and so against transport/base.py)."""
