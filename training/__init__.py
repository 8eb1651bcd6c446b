"""TAG training package."""
