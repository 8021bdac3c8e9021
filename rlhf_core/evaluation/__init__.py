"""Evaluation of one model against another (paper section 6): generation, judges, statistics, report."""
