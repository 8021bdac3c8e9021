"""The promotion gate and the evidence it reads: pure checks of a challenger's figures against the bounds of `promotion`
(no MLflow; the promote flow's tasks in tasks/promotion/ gather the evidence and act on the decision)."""
