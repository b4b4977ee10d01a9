# shellcheck shell=bash
# batch/python_env.sh: the Python a batch job's own steps run (slurm/prepare.sbatch, batch/ray_cluster.sh),
# sourced from the job's folder: VENV, else this folder's .venv (what the README's install makes),
# else the one already on PATH. cluster_train.sh chooses the same way, and also takes CONDA_ENV.

activate_job_python() {
  if [[ -n "${VENV:-}" ]]; then
    # shellcheck disable=SC1091 # the user's virtualenv, not ours to lint
    source "${VENV}/bin/activate"
  elif [[ -f .venv/bin/activate && -z "${VIRTUAL_ENV:-}" ]]; then
    # shellcheck disable=SC1091 # made by the README's install command
    source .venv/bin/activate
  fi
}
