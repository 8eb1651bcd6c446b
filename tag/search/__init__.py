"""Plan search: action space, simulator-backed evaluation, MCTS and the baseline searchers.

The planner that combines them with the GNN predictor is :func:`tag.planner.find_plan`."""

from .evaluate import Evaluator, Feedback
from .mcts import MCTSConfig, SearchState, mcts_search, run_episode, run_playouts, uniform_prior
from .searchers import SEARCHERS, random_search, simulated_annealing, tpe_search
from .space import Action, ActionSpace

__all__ = ["SEARCHERS", "Action", "ActionSpace", "Evaluator", "Feedback", "MCTSConfig",
           "SearchState", "mcts_search", "random_search", "run_episode", "run_playouts",
           "simulated_annealing", "tpe_search", "uniform_prior"]
