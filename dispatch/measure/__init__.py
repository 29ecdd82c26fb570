"""Stage 1, measure: shape inventories, timing, the sweep, the corpus and fleets."""
