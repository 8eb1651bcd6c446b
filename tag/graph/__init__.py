"""Op graph of a training iteration: IR, capture and grouping."""

from .capture import Captured, capture, capture_graph, export_joint
from .grouping import group_ops
from .ir import Affine, Group, Op, OpGraph, Param, Tensor

__all__ = ["Affine", "Captured", "Group", "Op", "OpGraph", "Param", "Tensor", "capture", "capture_graph", "export_joint", "group_ops"]
