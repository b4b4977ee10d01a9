# shellcheck shell=bash
# batch/elastic.sh: an allocation's job that goes on while MIN_NODES of its nodes remain, shared by
# slurm/train.sbatch and pbs/train.pbs (sourced from the job's folder; docs/SCHEDULERS.md, "Elastic
# jobs: a node lost, the others go on").
#
#   elastic_min_nodes NODES            MIN_NODES checked against the allocation's NODES (NODES when unset);
#                                      exit 2 with one line when it is not a count from 1 to NODES
#   elastic_num_nodes NODES MIN        the launcher's num_nodes: NODES, or MIN:NODES when MIN < NODES
#   elastic_goes_on RANK CODE LEFT MIN whether the job goes on after node RANK ended with CODE, LEFT
#                                      nodes still running: an elastic job's node other than 0 (node 0's
#                                      torchrun agent holds the rendezvous store) while MIN remain, unless
#                                      CODE is 2 (bad input: every node's, so the job's)
#   elastic_lost_line HOST CODE        the bad-nodes file's line for a node lost mid-run; none for exit 2
#                                      (the job's input) or 3 (a failed health check names its node itself)
#
# Each wrapper starts one task per node that ends on its own (a step per node under SLURM, a
# pbsdsh/ssh/srun client per node under PBS) and polls them. Only until node 0 ends or a stop
# signal comes: after either, every node exits (143 after a stop) and its code says nothing of it.
# Under SLURM a node lost is written to the bad-nodes file, so a job that later fails is requeued
# without it.

elastic_min_nodes() {
  local nodes="$1" min="${MIN_NODES:-$1}"
  if [[ ! "${min}" =~ ^[1-9][0-9]*$ ]] || ((min > nodes)); then
    printf 'error: MIN_NODES=%s must be a whole number of nodes from 1 to the job'"'"'s %s\n' "${min}" "${nodes}" >&2
    exit 2
  fi
  printf '%s\n' "${min}"
}

elastic_num_nodes() {
  local nodes="$1" min="$2"
  if ((min < nodes)); then printf '%s:%s\n' "${min}" "${nodes}"; else printf '%s\n' "${nodes}"; fi
}

elastic_goes_on() {
  local rank="$1" code="$2" left="$3" min="$4"
  ((code != 0 && code != 2 && rank != 0 && left >= min))
}

elastic_lost_line() {
  local host="$1" code="$2"
  ((code == 2 || code == 3)) || printf '%s\tlost mid-run, exit code %s\n' "${host}" "${code}"
}
