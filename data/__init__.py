"""TAG data package."""
