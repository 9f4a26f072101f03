"""The layout vocabulary the planner and the mechanisms share (pure: no I/O, no tiers).

What a plan is made of: parameters packed into chunks (:mod:`.chunks`), the placement plan
and its default rule (:mod:`.placement`), the chunk-size chooser (:mod:`.choose`), the
per-block activation policy and adaptive keep (:mod:`.activation_policy`), and the link
shares the scheduler enforces (:mod:`.shares`).
These modules import nothing of tiermem but :mod:`tiermem.units` and :mod:`tiermem.errors`,
so the planner can be imported, read and tested without the registry, scheduler or tiers
(``tests/test_architecture.py`` checks it).
"""
