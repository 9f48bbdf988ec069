"""Offline training and evaluation of the burst predictor: the label builder over a trace
(:mod:`~kvstore.training.trace`), the evaluation suite, the forecaster's evaluation and ``kvctl train`` /
``kvctl eval-predictor``.
"""
