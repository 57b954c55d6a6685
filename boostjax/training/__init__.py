"""Training: the full check of a run's configuration (`checks`), the jitted step (`step`), the loop that
checkpoints, evaluates and resumes (`trainer`), and what a run reports while it trains (`observe`)."""
