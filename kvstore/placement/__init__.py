"""Placement: which forecast prefixes are copied where, in what copy trees, renewed or dropped --
the planner, its candidates, copy trees, renewals and holder walks (pure logic: no sockets, no clocks).

These modules run compiled with mypyc where the install could compile them, else as pure Python from
the same source (:mod:`kvstore.placement.compiled_modules` chooses, before any is imported).
"""

from kvstore.placement import compiled_modules

compiled_modules.choose()
