"""One module per bench section: each runs its measurement (`run`), turns its results into
flat ratio keys (`ratios`), prints its block (`render`) and names its targets."""
