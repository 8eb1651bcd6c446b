"""Plan search: action space, simulator-backed evaluation, MCTS and the baseline searchers."""

from .evaluate import Evaluator, Feedback
from .mcts import MCTSConfig, SearchState, mcts_search, run_episode, run_playouts, uniform_prior
from .space import Action, ActionSpace

__all__ = ["Action", "ActionSpace", "Evaluator", "Feedback", "MCTSConfig", "SearchState", "mcts_search",
           "run_episode", "run_playouts", "uniform_prior"]
