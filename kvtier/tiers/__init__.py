"""Spill tiers: stores of chunk values below the host pool (see ``base.SpillTier``)."""
