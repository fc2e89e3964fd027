"""Iteration-level schedulers (torch-free): state in, StepPlan out.

Policies: fcfs (fcfs.py), mlq (mlq.py, Chameleon), dlora (dlora.py, merged/unmerged);
any of them with SLO early abort (admission.py) and adapter clustering (clustering.py), over
the mechanism they share (base.py and the collaborators it owns).
Build one by name with `make_scheduler` (factory.py).
"""
