"""A batch job's Ray on one node: what slurm/ray.sbatch and pbs/ray.pbs run through batch/ray_cluster.sh.

    python -m purrsight.ray_node check-config CONFIG [section.key=value ...]
    python -m purrsight.ray_node address [--hint ADDR] [--head ADDR]
    python -m purrsight.ray_node ports --job JOB            (on the head's host: a free port block)
    python -m purrsight.ray_node start head|worker --job JOB --ports BASE --slot K --name NODE ...
    python -m purrsight.ray_node wait --job JOB --ports BASE --head ADDR --nodes NODE[,NODE...] ...

``ports`` (a job's block, probed), ``address`` (which address a node announces),
``resources`` (what its Ray may use), ``temp`` (its temp dir), ``processes`` (its process
tree, and the teardown by that tree), ``node`` (one node's life: Ray up with the job-wide stop
signals held, down when the batch script says), ``wait`` (every node up, with a deadline).
Torch-free and Ray-free but for ``wait``, which asks the head for its nodes. Stands on the
launcher's node facts (addresses, routes, the CPU rule) and on the base modules.
"""
