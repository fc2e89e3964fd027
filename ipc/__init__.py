"""Wire protocol between clients, the daemon and its children (torch-free)."""
