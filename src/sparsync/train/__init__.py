"""Training: workloads, loop, run directories and reports (``sparsync train`` / ``compare``)."""
