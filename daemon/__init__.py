"""Control daemon: scheduling, routing, page allocation and supervision (torch-free)."""
