"""Internals of ``aiodist.bench``: the measured cases, the per-rank worker, the report."""
