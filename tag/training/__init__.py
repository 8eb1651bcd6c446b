"""Training the planner's predictor: AlphaZero-style rounds (label with MCTS, fit), the fitting
loop, the run configuration and the optuna hyperparameter search. Recipes and results:
``docs/training.md`` in the repository."""
