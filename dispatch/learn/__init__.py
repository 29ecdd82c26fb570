"""Stage 2, learn: shape features, the policy file, training, evaluation and explanations."""
