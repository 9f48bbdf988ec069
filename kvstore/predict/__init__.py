"""The burst predictor and the placement planner (pure logic: no sockets, no clocks).

The planner's modules run compiled with mypyc where the install could compile them, else as pure
Python from the same source (:mod:`kvstore.predict.compiled_modules` chooses, before any is imported).
"""

from kvstore.predict import compiled_modules

compiled_modules.choose()
