"""Cost model: roofline rule, profiles and communication costs."""

from .roofline import Roofline, graph_time

__all__ = ["Roofline", "graph_time"]
