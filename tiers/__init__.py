"""Where bytes live: the Tier protocol (``base``) and one module per tier.

Importing this package does not import the tiermem core.
"""

from tiermem.tiers.base import ALIGNMENT, TIER_NAMES, Allocation, Tier, TierStatistics

__all__ = ["ALIGNMENT", "TIER_NAMES", "Allocation", "Tier", "TierStatistics"]
