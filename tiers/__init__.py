"""Where bytes live: the Tier protocol (``base``: what a new tier implements), the machinery
every tier shares (``accounting``) and one module per tier.

Importing this package does not import the tiermem core.
"""

from tiermem.tiers.base import ALIGNMENT, TIER_NAMES, Allocation, Tier, TierStatistics

__all__ = ["ALIGNMENT", "TIER_NAMES", "Allocation", "Tier", "TierStatistics"]
