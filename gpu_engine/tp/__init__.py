"""Tensor parallelism: one engine's model split over N rank processes (Megatron-LM
for the base weights, S-LoRA §6.1 for the adapters). The split itself is the
torch-free contract loraplex.contracts.tensor_parallel; this package slices the
tensors (partition), runs the collectives (comm) and the rank's forward (model, rank)."""
