"""Plan search: action space, simulator-backed evaluation, MCTS and the baseline searchers."""

from .evaluate import Evaluator, Feedback
from .mcts import MCTSConfig, SearchState, mcts_search, run_episode, run_playouts, uniform_prior
from .planner import DEFAULT_PLAYOUTS, plan
from .searchers import SEARCHERS, random_search, simulated_annealing, tpe_search
from .space import Action, ActionSpace

__all__ = ["DEFAULT_PLAYOUTS", "SEARCHERS", "Action", "ActionSpace", "Evaluator", "Feedback", "MCTSConfig",
           "SearchState", "mcts_search", "plan", "random_search", "run_episode", "run_playouts",
           "simulated_annealing", "tpe_search", "uniform_prior"]
