"""Iteration-level schedulers (torch-free): state in, StepPlan out.

Policies: fcfs (fcfs.py), mlq (mlq.py, Chameleon), dlora (dlora.py, merged/unmerged);
any of them with SLO early abort (admission.py) and adapter clustering (base.py).
Build one by name with `make_scheduler` (factory.py).
"""
