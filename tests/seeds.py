"""Fresh random seeds for tests, printed so that a failure (on the GPU too) can be replayed with the same draws."""

import numpy as np


def fresh_seed() -> int:
    seed = int(np.random.SeedSequence().entropy % 2**32)
    print(f"seed {seed}")
    return seed
