"""Launch and the stack's own cost: start-up and samples/s against plain torchrun, Ray, SLURM, trackers, interpreters."""
