"""The burst predictor: features of the access stream, the LightGBM model retrained online and gated
against the momentum rule, the rate forecaster and the links' measured rates (pure logic: no sockets,
no clocks). Placement decides from its scores (:mod:`kvstore.placement`); the offline training and
evaluation of the shipped model is :mod:`kvstore.training`.
"""
