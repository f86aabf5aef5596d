"""The clocks: generated timing code per node, the torch.profiler session and its trace, GPU device time, FLOPs and bytes."""
