"""loraplex on Ray Serve: replicas that each run one loraplex daemon, an OpenAI ingress that
reuses the gateway's request handling, a board that holds the cluster-wide adapter catalog and
each replica's latest stats, and a request router that places requests by LoRA rank and
adapter residency with the daemon's own routing policies (loraplex.daemon.router).

Needs the `cluster` extra (ray[serve]); never imports torch. The Serve application is built
by `loraplex.cluster.app:build_app` (`serve run loraplex.cluster.app:build_app replicas=2`).
"""
