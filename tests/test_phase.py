"""One phase definition (tag.graph.ir.Phase): labels where phases are named, indices where counted."""

import json

from tag.cost.model import PHASE_INDEX as COST_PHASE_INDEX
from tag.graph.ir import PHASE_INDEX, PHASES, Phase
from tag.sim.engine import PHASE_NAME
from tag.sim.static import BWD, FWD, OPT


def test_the_simulator_counts_the_phases_the_graph_names():
    assert PHASES == ("fwd", "bwd", "opt") and [Phase(p) for p in PHASES] == list(Phase)
    assert (FWD, BWD, OPT) == (0, 1, 2) and all(type(x) is int for x in (FWD, BWD, OPT))  # plain ints: fast
    assert {PHASE_NAME[i]: i for i in (FWD, BWD, OPT)} == PHASE_INDEX == COST_PHASE_INDEX
    # a label compares and serialises as the string a graph file holds
    assert Phase.OPT == "opt" and json.dumps([Phase.FWD, Phase.BWD]) == '["fwd", "bwd"]'
    assert PHASE_INDEX[Phase.BWD] == PHASE_INDEX["bwd"] == BWD
