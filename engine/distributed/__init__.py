"""Tensor parallelism: the model's weights and KV heads split over N processes (ranks) that run each step
together through torch.distributed. Rank 0 is the engine (scheduler, block pool, sampler); the other ranks only
run the model on the step rank 0 sends them. Pipeline parallelism (pipeline.py) splits the layers into stages
instead, one rank each."""
