"""Policy-level simulation (torch-free): seeded workloads (workload.py) and a discrete-event
simulator of N engines that runs the daemon's own schedulers, routers and adapter caches on
a virtual clock (simulator.py), with named scenarios, metrics and plots; `loraplex sim`.
"""
