"""Virtual Parameter Space: layouts, the mapping onto ranks, and switch plans."""
