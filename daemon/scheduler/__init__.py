"""Iteration-level schedulers (torch-free): state in, StepPlan out."""
