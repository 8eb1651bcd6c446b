"""Cost model: roofline rule, profile database, communication costs.

Heavy measuring code (:mod:`tag.cost.profiler`) is imported on demand. The communication profiler
times the executor's own collectives, so it lives with them (:mod:`tag.executor.commprof`); its
fits are read here (:mod:`tag.cost.comm`).
"""

from .comm import CommModel, CommProfile, LinkFit, fit_latency_bandwidth, ring_allreduce_time
from .model import CostModel, DeviceCost, device_roofline, device_type
from .profile import Profile, ProfileError, default_profile_dir, find_profile, load_profile
from .roofline import Roofline, graph_time, group_phase_table, roofline_for

__all__ = [
    "CommModel", "CommProfile", "CostModel", "DeviceCost", "LinkFit", "Profile", "ProfileError", "Roofline",
    "default_profile_dir", "device_roofline", "device_type", "find_profile", "fit_latency_bandwidth", "graph_time",
    "group_phase_table", "load_profile", "ring_allreduce_time", "roofline_for",
]
