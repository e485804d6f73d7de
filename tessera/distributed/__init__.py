"""Tensor parallelism over torch.distributed: partitioning rules, collectives, the step
channel between the driver and the other ranks, and the launcher that starts them."""
