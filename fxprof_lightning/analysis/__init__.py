"""What the numbers mean: regressions, load told from slowdowns, the roofline, advice."""
