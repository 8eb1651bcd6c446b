"""TAG evaluation package."""
