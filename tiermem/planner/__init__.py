"""The planner (ProTrain's memory-aware profiler, cost model and search). Pure where it decides:
a :class:`~tiermem.planner.profile.Profile` and free bytes per tier in, a frozen
:class:`~tiermem.layout.placement.Plan` out (policy vs mechanism: docs/ARCHITECTURE.md, "Who
may import whom" rule 3).

Pure (importing them loads no registry, scheduler, tier, offloader or manager):

- :mod:`~tiermem.planner.profile`: what one instrumented step measured (JSON round trip).
- :mod:`~tiermem.planner.costmodel`: a plan's step time and peak bytes (NOTE [ Cost model ]),
  from :mod:`~tiermem.planner.state_costs` (the model states) and
  :mod:`~tiermem.planner.activation_costs` (the activations).
- :mod:`~tiermem.planner.search`: the fastest plan that fits (NOTE [ Plan search ]), from
  :mod:`~tiermem.planner.candidates` (packings, the activation front),
  :mod:`~tiermem.planner.scan` (scan and pick) and :mod:`~tiermem.planner.no_fit` (no fit).

Measuring (on the live model and tiers):

- :mod:`~tiermem.planner.profiler`: the instrumented step itself (NOTE [ Profiling step ]).
- :mod:`~tiermem.planner.probes`: its link probes, through the registry and the NVMe tier.
- :mod:`~tiermem.planner.optimizer_probe`: the optimizer's time per byte, on a sample.
- :mod:`~tiermem.planner.calibrate`: a managed step's own overheads (NOTE [ Overhead calibration ]).
- :mod:`~tiermem.planner.cache`: profiles cached in the user's cache (NOTE [ Profile cache ]).
- :mod:`~tiermem.planner.auto`: profile-or-cache, then search, for ``rt.manage(plan="auto")``.
"""

from tiermem.planner.costmodel import FRAGMENTATION_MARGIN, Estimate, predict
from tiermem.planner.errors import NoPlanFitsError, ProfileError
from tiermem.planner.profile import BlockStats, Overheads, ParamStats, Profile
from tiermem.planner.search import Decision, search

__all__ = [
    "FRAGMENTATION_MARGIN",
    "BlockStats",
    "Decision",
    "Estimate",
    "NoPlanFitsError",
    "Overheads",
    "ParamStats",
    "Profile",
    "ProfileError",
    "predict",
    "search",
]
