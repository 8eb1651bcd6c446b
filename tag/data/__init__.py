"""The predictor's training data: random (model, topology) pairs, their MCTS-labelled decisions
and the PyG dataset built from them."""
