#!/usr/bin/env bats
# The batch scripts' own shell: slurm/prepare.sbatch's part of an array, the CPUs an srun step
# asks for (slurm/job.sh), and batch/ray_cluster.sh's bring-up and teardown (a failed step stops
# the bring-up; a stop signal ends it at once; the teardown file stays until every node answers).
#
# Python is a stand-in here (a script that records its arguments and plays one answer per
# command): these tests are about what the shell does with the answers. The real ones run in
# tests/cluster (SLURM, PBS over it, real Ray).

setup() {
  REPO="$(cd "${BATS_TEST_DIRNAME}/../.." && pwd)"
  cd "${REPO}" || exit 1
  STUB="${BATS_TEST_TMPDIR}/venv"
  mkdir -p "${STUB}/bin"
  printf 'PATH="%s/bin:${PATH}"\n' "${STUB}" >"${STUB}/bin/activate"
  # python: records its arguments; `wait` sleeps STUB_WAIT_S (the wait for the nodes), `address`
  # fails when STUB_ADDRESS_FAILS is set, `ports` prints a block, the rest succeed.
  cat >"${STUB}/bin/python" <<'EOF'
#!/usr/bin/env bash
printf '%s\n' "$*" >>"${STUB_CALLS}"
case " $* " in
  *" address "*) [[ -z "${STUB_ADDRESS_FAILS:-}" ]] || exit 1; echo 127.0.0.1 ;;
  *" ports "*) echo 14200 ;;
  *" wait "*) sleep "${STUB_WAIT_S:-0}"; echo http://127.0.0.1:14201 ;;
esac
EOF
  printf '#!/bin/sh\nexit 0\n' >"${STUB}/bin/ray"
  chmod +x "${STUB}/bin/python" "${STUB}/bin/ray"
  export VENV="${STUB}" STUB_CALLS="${BATS_TEST_TMPDIR}/calls" LOG_DIR="${BATS_TEST_TMPDIR}/logs"
  unset PARTS SLURM_ARRAY_TASK_ID SLURM_ARRAY_TASK_MIN SLURM_ARRAY_TASK_MAX SLURM_ARRAY_TASK_COUNT
}

prepare_part() {
  run bash slurm/prepare.sbatch config/train_config.yaml "${BATS_TEST_TMPDIR}/out"
}

@test "prepare.sbatch: each task of a 0-based or 1-based array prepares its place in the array" {
  SLURM_ARRAY_TASK_MIN=0 SLURM_ARRAY_TASK_MAX=15 SLURM_ARRAY_TASK_COUNT=16
  export SLURM_ARRAY_TASK_MIN SLURM_ARRAY_TASK_MAX SLURM_ARRAY_TASK_COUNT
  SLURM_ARRAY_TASK_ID=15 prepare_part
  [ "${status}" -eq 0 ]
  grep -q -- "--part 15/16 " "${STUB_CALLS}"
  export SLURM_ARRAY_TASK_MIN=1 SLURM_ARRAY_TASK_MAX=16
  for task in 1 16; do SLURM_ARRAY_TASK_ID="${task}" prepare_part; [ "${status}" -eq 0 ]; done
  grep -q -- "--part 0/16 " "${STUB_CALLS}"
  grep -c -- "--part 15/16 " "${STUB_CALLS}" | grep -qx 2
  run grep -q -- "--part 16/16" "${STUB_CALLS}"
  [ "${status}" -ne 0 ]
}

@test "prepare.sbatch: a failed part runs again as the same part with PARTS, and never as the whole set" {
  export SLURM_ARRAY_TASK_ID=3 SLURM_ARRAY_TASK_MIN=3 SLURM_ARRAY_TASK_MAX=3 SLURM_ARRAY_TASK_COUNT=1
  PARTS=16 prepare_part
  [ "${status}" -eq 0 ]
  grep -q -- "--part 3/16 " "${STUB_CALLS}"
  prepare_part # without PARTS: one line naming the fix, nothing prepared
  [ "${status}" -eq 2 ]
  [ "$(grep -c 'error:' <<<"${output}")" -eq 1 ]
  grep -q "PARTS=N sbatch --array=3" <<<"${output}"
  [ "$(wc -l <"${STUB_CALLS}")" -eq 1 ]
  PARTS=3 prepare_part
  [ "${status}" -eq 2 ]
  grep -q "array task '3' is no part of 3" <<<"${output}"
  export SLURM_ARRAY_TASK_MIN=0 SLURM_ARRAY_TASK_COUNT=2 # --array=0,3: a list with gaps
  prepare_part
  [ "${status}" -eq 2 ]
  grep -q -- "--array skips tasks (2 of 0-3)" <<<"${output}"
  unset SLURM_ARRAY_TASK_ID # not an array: the whole set
  prepare_part
  [ "${status}" -eq 0 ]
  grep -q -- "--part 0/1 " "${STUB_CALLS}"
}

@test "job.sh: an srun step asks for the task's CPUs, else its node's share of the job's" {
  cpus() { bash -c 'source slurm/job.sh; step_cpus "$1"' step_cpus "$1"; }
  [ "$(SLURM_CPUS_PER_TASK=8 SLURM_JOB_CPUS_PER_NODE='32(x2)' cpus 1)" -eq 8 ]
  export SLURM_JOB_CPUS_PER_NODE='32(x2),16' # node order: 32, 32, 16
  unset SLURM_CPUS_PER_TASK
  [ "$(cpus 0)" -eq 32 ]
  [ "$(cpus 2)" -eq 16 ]
  [ "$(cpus all)" -eq 16 ] # one count for every node's task: the least
}

# A SLURM job script with SIGNAL_LINE in its header that sources slurm/job.sh and checks a stop of
# NEEDED_S; scontrol answers with KILL_WAIT and GRACE_TIME, as `show config` and `show partition -o` do.
stop_budget_job() {
  mkdir -p "${BATS_TEST_TMPDIR}/bin"
  cat >"${BATS_TEST_TMPDIR}/bin/scontrol" <<'EOF'
#!/usr/bin/env bash
[[ -z "${SCONTROL_FAILS:-}" ]] || exit 1
case "$2" in
  config) printf 'JobAcctGatherType       = jobacct_gather/none\nKillWait                = %s sec\n' "${KILL_WAIT}" ;;
  partition) printf 'PartitionName=%s AllowGroups=ALL GraceTime=%s Hidden=NO\n' "$3" "${GRACE_TIME}" ;;
esac
EOF
  chmod +x "${BATS_TEST_TMPDIR}/bin/scontrol"
  cat >"${BATS_TEST_TMPDIR}/job.sbatch" <<EOF
#!/usr/bin/env bash
#SBATCH --nodes=2
${SIGNAL_LINE}
set -euo pipefail
log() { printf '%s\n' "\$*"; }
cd "${REPO}"
source slurm/job.sh
stop_budget "\${NEEDED_S}" "the test's stop"
echo "budget: fits"
EOF
  run env PATH="${BATS_TEST_TMPDIR}/bin:${PATH}" SLURM_JOB_PARTITION=debug bash "${BATS_TEST_TMPDIR}/job.sbatch"
}

@test "job.sh: the stop budget: a USR1 lead that cannot hold the stop ends the job with 2, a short KillWait is noted" {
  export KILL_WAIT=60 GRACE_TIME=0
  # ray.sbatch's own line: USR1 240 s before the limit holds 210 s; a scancel's 60 s is noted
  SIGNAL_LINE="$(grep '^#SBATCH --signal=' slurm/ray.sbatch)" NEEDED_S=210 stop_budget_job
  [ "${status}" -eq 0 ]
  [[ "${output}" == *"budget: fits"* ]]
  [[ "${output}" == *"note: a scancel leaves the stop KillWait (60 s), a preemption GraceTime + KillWait (60 s)"*"USR1 leaves 240 s"* ]]
  # A longer stop: refused before anything starts, naming the lead that would hold it
  SIGNAL_LINE="#SBATCH --signal=B:USR1@240" NEEDED_S=330 stop_budget_job
  [ "${status}" -eq 2 ]
  [ "$(grep -c 'error:' <<<"${output}")" -eq 1 ]
  [[ "${output}" == *"USR1 comes 240 s before the time limit, and the stop it starts takes up to 330 s (the test's stop): submit with --signal=B:USR1@360"* ]]
  [[ "${output}" != *"budget: fits"* ]]
  # The lead given on the command line (USR1_LEAD_S); SLURM's default lead without @ (60 s)
  USR1_LEAD_S=400 SIGNAL_LINE="#SBATCH --signal=B:USR1@240" NEEDED_S=330 stop_budget_job
  [ "${status}" -eq 0 ]
  SIGNAL_LINE="#SBATCH --signal=B:SIGUSR1" NEEDED_S=61 stop_budget_job
  [ "${status}" -eq 2 ]
  [[ "${output}" == *"USR1 comes 60 s before"* ]]
  # KillWait that holds the stop: no note; a long GraceTime does not hide a short KillWait (a scancel's)
  KILL_WAIT=240 GRACE_TIME=0 SIGNAL_LINE="#SBATCH --signal=B:USR1@300" NEEDED_S=210 stop_budget_job
  [ "${status}" -eq 0 ]
  [[ "${output}" != *"note:"* ]]
  KILL_WAIT=30 GRACE_TIME=300 SIGNAL_LINE="#SBATCH --signal=B:USR1@300" NEEDED_S=210 stop_budget_job
  [[ "${output}" == *"note: a scancel leaves the stop KillWait (30 s), a preemption GraceTime + KillWait (330 s)"* ]]
  # USR1 without B: reaches the steps, not the script: said, not counted as a lead
  SIGNAL_LINE="#SBATCH --signal=USR1@240" NEEDED_S=210 stop_budget_job
  [ "${status}" -eq 0 ]
  [[ "${output}" == *"sends USR1 to the job's steps, not to this script (no B:)"* ]]
  # The last --signal line wins, as in sbatch; RB: and the form with a space are read too
  SIGNAL_LINE="$(printf '#SBATCH --signal=B:USR1@600\n#SBATCH --signal=B:USR1@100')" NEEDED_S=210 stop_budget_job
  [ "${status}" -eq 2 ]
  [[ "${output}" == *"USR1 comes 100 s before"* ]]
  SIGNAL_LINE="#SBATCH --signal  RB:USR1@300 # a comment" NEEDED_S=210 stop_budget_job
  [ "${status}" -eq 0 ]
  [[ "${output}" == *"USR1 leaves 300 s"* ]]
  # scontrol failing (slurmctld away): no note, and no silent exit
  SCONTROL_FAILS=1 SIGNAL_LINE="#SBATCH --signal=B:USR1@300" NEEDED_S=210 stop_budget_job
  [ "${status}" -eq 0 ]
  [[ "${output}" == *"budget: fits"* ]]
  # a lead with a leading zero is no number of seconds (bash would read it as octal)
  USR1_LEAD_S=0300 SIGNAL_LINE="" NEEDED_S=210 stop_budget_job
  [ "${status}" -eq 2 ]
  SIGNAL_LINE="#SBATCH --time=10" NEEDED_S=210 stop_budget_job
  [ "${status}" -eq 0 ]
  [[ "${output}" == *"note: no USR1 before the time limit"* ]]
  USR1_LEAD_S=4m SIGNAL_LINE="" NEEDED_S=210 stop_budget_job
  [ "${status}" -eq 2 ]
  [[ "${output}" == *"USR1_LEAD_S=4m is not a number of seconds"* ]]
}

@test "ray_cluster.sh: a stop wait that is no number of seconds ends ray.sbatch and ray.pbs with 2 before any Ray" {
  for script in slurm/ray.sbatch pbs/ray.pbs; do
    run env RAY_JOB_STOP_WAIT_TIME_S=3m SLURM_JOB_ID=9 SLURM_JOB_NODELIST=node0 PBS_JOBID=9.server \
      PBS_NODEFILE=/dev/null PATH="${STUB}/bin:${PATH}" bash "${script}"
    [ "${status}" -eq 2 ]
    [[ "${output}" == *"error: RAY_JOB_STOP_WAIT_TIME_S=3m is not a number of seconds (180 by default)"* ]]
  done
}

@test "pbs/nodes.sh: a host's slots are its lines in PBS_NODEFILE, trailing spaces or not; 1 at least" {
  printf 'node-a\nnode-a  \nnode-b\t\nnode-a\n' >"${BATS_TEST_TMPDIR}/nodefile"
  slots() {
    PBS_NODEFILE="${BATS_TEST_TMPDIR}/nodefile" bash -c 'log() { :; }; source pbs/nodes.sh; pbs_hosts; pbs_host_cpus "$1"' slots "$1"
  }
  [ "$(slots 0)" = 3 ]
  [ "$(slots 1)" = 1 ]
}

@test "pbs/nodes.sh: the walltime comes from WALLTIME, Torque's PBS_WALLTIME or qstat -f, in seconds" {
  walltime() { env "$@" bash -c 'log() { :; }; source pbs/nodes.sh; pbs_walltime'; }
  [ "$(walltime WALLTIME=1:02:03)" = 3723 ]
  [ "$(walltime WALLTIME=90)" = 90 ]
  [ "$(walltime WALLTIME=08:09)" = 489 ] # leading zeros are not octal
  [ -z "$(walltime WALLTIME=tomorrow)" ]
  [ "$(walltime PBS_WALLTIME=7200)" = 7200 ]
  # OpenPBS's `qstat -f JOBID`, as it prints a job's resources (a stand-in: no PBS server here)
  printf '#!/bin/sh\n[ "$1 $2" = "-f 42.server" ] || exit 1\nprintf "Job Id: 42.server\\n    Resource_List.walltime = 02:00:00\\n"\n' >"${STUB}/bin/qstat"
  chmod +x "${STUB}/bin/qstat"
  [ "$(walltime PATH="${STUB}/bin:${PATH}" PBS_JOBID=42.server)" = 7200 ]
}

@test "pbs/nodes.sh: the job stops itself STOP_BEFORE_WALLTIME before the walltime, by the signal qdel sends" {
  # A job script's shape: a TERM trap (the stop), the timer, a wait; the trap records when it ran.
  cat >"${BATS_TEST_TMPDIR}/job.sh" <<EOF
cd "${REPO}"
log() { printf '%s\n' "\$*"; }
source pbs/nodes.sh
trap 'echo "stopped after \${SECONDS} s" >"${BATS_TEST_TMPDIR}/stopped"; exit 143' TERM
trap 'pbs_stop_timer_off' EXIT
pbs_stop_before_walltime "\${NEEDED_S:-0}"
sleep "\${HOLD_S}" & wait \$!
EOF
  run env WALLTIME=4 STOP_BEFORE_WALLTIME=2 HOLD_S=30 bash "${BATS_TEST_TMPDIR}/job.sh"
  [ "${status}" -eq 143 ]
  [[ "${output}" == *"stops itself 2 s before its walltime of 4 s"* ]]
  [[ "$(cat "${BATS_TEST_TMPDIR}/stopped")" =~ ^stopped\ after\ [23]\ s$ ]]
  # A job that ends first turns its timer off: no signal later, no sleep left behind.
  rm -f "${BATS_TEST_TMPDIR}/stopped"
  run env WALLTIME=600 STOP_BEFORE_WALLTIME=2 HOLD_S=1 bash "${BATS_TEST_TMPDIR}/job.sh"
  [ "${status}" -eq 0 ]
  [ ! -e "${BATS_TEST_TMPDIR}/stopped" ]
  sleep 1
  ! pgrep -f "^sleep 598$"
  # Off, unknown, or a bad setting: said in one line (a bad one ends the job with 2)
  run env WALLTIME=600 STOP_BEFORE_WALLTIME=0 HOLD_S=0 bash "${BATS_TEST_TMPDIR}/job.sh"
  [ "${status}" -eq 0 ]
  [ -z "${output}" ]
  run env PATH="/usr/bin:/bin" HOLD_S=0 bash -c "unset WALLTIME PBS_WALLTIME PBS_JOBID; bash '${BATS_TEST_TMPDIR}/job.sh'"
  [[ "${output}" == *"walltime is unknown (set WALLTIME=H:M:S"* ]]
  run env WALLTIME=600 STOP_BEFORE_WALLTIME=5m HOLD_S=0 bash "${BATS_TEST_TMPDIR}/job.sh"
  [ "${status}" -eq 2 ]
  [[ "${output}" == *"STOP_BEFORE_WALLTIME=5m is not a number of seconds"* ]]
  # The stop budget: a margin shorter than the stop it starts (ray.pbs: the driver's stop and the teardown) is refused
  run env WALLTIME=600 STOP_BEFORE_WALLTIME=100 NEEDED_S=200 HOLD_S=0 bash "${BATS_TEST_TMPDIR}/job.sh"
  [ "${status}" -eq 2 ]
  [[ "${output}" == *"STOP_BEFORE_WALLTIME=100 s cannot hold the stop it starts, 200 s"* ]]
}

# A batch script's bring-up as slurm/ray.sbatch runs it, with the scheduler's parts stubbed:
# ray_on_node records what it would start on a node.
ray_script() {
  cat >"${BATS_TEST_TMPDIR}/bring_up.sh" <<EOF
set -euo pipefail
cd "${REPO}"
log() { printf '%s\n' "\$*"; }
ray_on_node() { shift; printf 'started %s\n' "\$*" >>"${BATS_TEST_TMPDIR}/started"; exec sleep 60; }
ray_stop_nodes() { kill "\$@" 2>/dev/null || true; }
source batch/ray_cluster.sh
STOP_SIGNAL=""
on_stop_signal() { STOP_SIGNAL="\${STOP_SIGNAL:-\$1}"; ray_stop_training "\$1"; }
ray_cluster_init 7 0 none
ray_node_add node0 node0
ray_node_add node1 node1
trap 'on_stop_signal TERM' TERM
trap 'ray_cluster_down' EXIT
rc=0
ray_run config/train_config.yaml || rc=\$?
echo "ray_run: \${rc}"
exit "\${rc}"
EOF
}

@test "ray_cluster.sh: a failed address lookup stops the bring-up before any node starts" {
  ray_script
  STUB_ADDRESS_FAILS=1 run bash "${BATS_TEST_TMPDIR}/bring_up.sh"
  [ "${status}" -ne 0 ]
  grep -q "error: no address for the head node0" <<<"${output}"
  [ ! -e "${BATS_TEST_TMPDIR}/started" ]
}

@test "ray_cluster.sh: a stop while the nodes come up ends the wait at once" {
  ray_script
  STUB_WAIT_S=30 bash "${BATS_TEST_TMPDIR}/bring_up.sh" >"${BATS_TEST_TMPDIR}/out" 2>&1 &
  local script=$! start=${SECONDS}
  while ! grep -q " wait " "${STUB_CALLS}" 2>/dev/null; do sleep 0.2; ((SECONDS - start < 20)); done
  kill -s TERM "${script}"
  local status=0
  wait "${script}" || status=$?
  ((SECONDS - start < 15)) # not the 30 s the wait would take
  [ "${status}" -eq 143 ]
  grep -q "ray_run: 143" "${BATS_TEST_TMPDIR}/out"
  [ "$(grep -c '^started' "${BATS_TEST_TMPDIR}/started")" -eq 2 ] # both nodes were starting, and were stopped
}

@test "ray_cluster.sh: the teardown file stays until every node has answered, and the silent ones are named" {
  # As under ssh: no signal reaches the tasks, the file does. node0 answers once it sees the file;
  # node1's client ends without an answer (a dropped connection), so its task may still run.
  ray_script
  sed -i -e 's|^ray_on_node() .*|ray_on_node() { local index="$1"; shift; if ((index == 0)); then until [[ -e "${RAY_LOG_DIR}/.teardown" ]]; do sleep 0.1; done; echo down >"${RAY_LOG_DIR}/node0.down"; else exec sleep 1; fi; }|' \
    -e 's|^ray_stop_nodes() .*|ray_stop_nodes() { :; }|' "${BATS_TEST_TMPDIR}/bring_up.sh"
  run bash "${BATS_TEST_TMPDIR}/bring_up.sh"
  [ "${status}" -eq 0 ]
  grep -q "warning: no answer to the teardown from node1 (their step ended without one, or 20 s passed); .*/ray-7/.teardown is kept for them" <<<"${output}"
  [ -e "${LOG_DIR}/ray-7/.teardown" ]
  # Both answer: the file goes.
  sed -i -e 's|else exec sleep 1; fi|else until [[ -e "${RAY_LOG_DIR}/.teardown" ]]; do sleep 0.1; done; echo down >"${RAY_LOG_DIR}/node1.down"; fi|' "${BATS_TEST_TMPDIR}/bring_up.sh"
  run bash "${BATS_TEST_TMPDIR}/bring_up.sh"
  [ "${status}" -eq 0 ]
  ! grep -q "no answer to the teardown" <<<"${output}"
  [ ! -e "${LOG_DIR}/ray-7/.teardown" ]
}

@test "job.sh: a stop signal after the run is recorded, not fatal, and the first still decides" {
  # What slurm/train.sbatch and slurm/ray.sbatch do once their run has ended (they restored the
  # default handling there, and a late SIGTERM killed the script before its requeue).
  after_run() {
    bash -c 'log() { :; }; stop_run() { :; }; source slurm/job.sh; trap "on_stop_signal USR1" USR1
             kill -USR1 $$; stop_signals_recorded; kill -TERM $$; kill -USR1 $$; echo "alive after ${STOP_SIGNAL}"'
  }
  run after_run
  [ "${status}" -eq 0 ]
  [ "${output}" = "alive after USR1" ]
  ! grep -n 'trap - USR1 TERM' slurm/train.sbatch slurm/ray.sbatch
  grep -q '^  stop_signals_recorded$' slurm/train.sbatch
  grep -q '^  stop_signals_recorded$' slurm/ray.sbatch
}

@test "elastic.sh: MIN_NODES from 1 to the node count, else exit 2 naming it; MIN:N only below N" {
  # shellcheck source=batch/elastic.sh
  source batch/elastic.sh
  [ "$(elastic_min_nodes 3)" = 3 ] # unset: every node, a fixed count as before
  [ "$(MIN_NODES=2 elastic_min_nodes 3)" = 2 ]
  [ "$(MIN_NODES= elastic_min_nodes 3)" = 3 ] # qsub -v MIN_NODES= : unset
  for bad in 0 4 -1 2.5 two 02; do
    MIN_NODES="${bad}" run elastic_min_nodes 3
    [ "${status}" -eq 2 ]
    [[ "${output}" == "error: MIN_NODES=${bad} must be a whole number of nodes from 1 to the job's 3" ]]
  done
  [ "$(elastic_num_nodes 3 2)" = 2:3 ]
  [ "$(elastic_num_nodes 3 3)" = 3 ]
  elastic_goes_on 2 137 2 2   # node 2 lost, two left of MIN 2: on
  ! elastic_goes_on 0 137 2 2 || false # node 0 holds the rendezvous: never
  ! elastic_goes_on 1 137 1 2 || false # one left of MIN 2: the job fails
  ! elastic_goes_on 1 137 2 3 || false # a fixed count (MIN = N): any loss fails it, as before
  ! elastic_goes_on 2 0 2 2 || false   # a node that finished is no loss
  ! elastic_goes_on 2 2 2 2 || false   # bad input (exit 2) is every node's: the job's failure
  elastic_goes_on 2 3 2 2              # a node that failed its health checks is left out
  [ "$(elastic_lost_line node2 137)" = "$(printf 'node2\tlost mid-run, exit code 137')" ]
  [ -z "$(elastic_lost_line node2 3)" ] # the health check names its node itself
  [ -z "$(elastic_lost_line node2 2)" ]
}

# slurm/train.sbatch with MIN_NODES=2 of three nodes, over stand-ins for srun (one step per node:
# it runs until second STUB_RUN_S_<rank> (60), ends with STUB_CODE_<rank> at second STUB_DIES_<rank>, or with 143 once
# scancel has signalled the steps, node 0 a second after the others as it writes the checkpoint),
# scancel and scontrol (each call recorded). What the script decides from those codes is the test.
elastic_sbatch() {
  local dir="${BATS_TEST_TMPDIR}/job"
  mkdir -p "${dir}/bin"
  ln -sfn "${REPO}/slurm" "${dir}/slurm"
  ln -sfn "${REPO}/batch" "${dir}/batch"
  cat >"${dir}/bin/srun" <<'EOF'
#!/usr/bin/env bash
for arg; do [[ "${arg}" == --relative=* ]] && rank="${arg#--relative=}"; done
dies="STUB_DIES_${rank}" code="STUB_CODE_${rank}" run="STUB_RUN_S_${rank}"
while ((SECONDS < ${!run:-60})); do
  if [[ -e "${STUB_STOPPED}" ]]; then ((rank)) || sleep 1; exit 143; fi
  if [[ -n "${!dies:-}" ]] && ((SECONDS >= ${!dies})); then exit "${!code:-137}"; fi
  sleep 0.1
done
EOF
  printf '#!/bin/sh\necho "scancel $*" >>"%s/calls"\ntouch "%s"\n' "${dir}" "${dir}/stopped" >"${dir}/bin/scancel"
  cat >"${dir}/bin/scontrol" <<EOF
#!/usr/bin/env bash
echo "scontrol \$*" >>"${dir}/calls"
[[ "\$1 \$2" != "show hostnames" ]] || printf 'node0\nnode1\nnode2\n'
EOF
  chmod +x "${dir}/bin/"*
  export PATH="${dir}/bin:${PATH}" STUB_STOPPED="${dir}/stopped" SLURM_SUBMIT_DIR="${dir}" SLURM_JOB_ID=7
  export SLURM_JOB_NUM_NODES=3 SLURM_JOB_NODELIST='node[0-2]' MIN_NODES=2 MASTER_PORT=29500
  bash "${REPO}/slurm/train.sbatch" >"${dir}/out" 2>&1 &
  JOB_PID=$!
}

# Until the job's output has node 2's loss line (at most 20 s): the stop below comes after it.
after_the_loss() {
  local tries=200
  until grep -q "node 2 (node2) ended" "${BATS_TEST_TMPDIR}/job/out" 2>/dev/null; do
    ((--tries)) || return 1
    sleep 0.1
  done
}

# Node 2 lost, then the job stopped by the signal $1; its output in `out`.
stopped_after_the_loss() {
  rm -rf "${BATS_TEST_TMPDIR}/job"
  STUB_DIES_2=1 elastic_sbatch
  after_the_loss
  kill "-$1" "${JOB_PID}"
  wait "${JOB_PID}" || true
  out="$(cat "${BATS_TEST_TMPDIR}/job/out")"
}

@test "train.sbatch elastic: a node lost goes on; a stop after it requeues without that node only, a scancel never" {
  stopped_after_the_loss USR1
  [[ "${out}" == *"node 2 (node2) ended with exit code 137: the job goes on with 2 of 3 nodes (MIN_NODES=2)"* ]]
  [[ "${out}" == *"requeueing without node2; the next run resumes"* ]]
  [[ "${out}" != *"node 1 (node1) ended"* ]] # its 143 after the stop is no loss
  grep -q "scontrol update JobId=7 ExcNodeList=node2$" "${BATS_TEST_TMPDIR}/job/calls"

  stopped_after_the_loss TERM
  [[ "${out}" == *"stopped by SIGTERM (scancel or preemption): not requeueing"* ]]
  ! grep -q "requeue" "${BATS_TEST_TMPDIR}/job/calls" || false
}

@test "train.sbatch elastic: bad input on one node ends the job with 2, no node excluded; node 0's success is the job's" {
  STUB_DIES_1=1 STUB_CODE_1=2 elastic_sbatch
  status=0
  wait "${JOB_PID}" || status=$?
  out="$(cat "${BATS_TEST_TMPDIR}/job/out")"
  [ "${status}" -eq 2 ]
  [[ "${out}" == *"node 1 (node1) ended with exit code 2, leaving 2 of 3 nodes (MIN_NODES=2): stopping the others"* ]]
  [[ "${out}" == *"exit code 2 (bad input or a failed check): not requeueing"* ]]
  [ ! -s "${BATS_TEST_TMPDIR}/job/logs/.bad-nodes-slurm-7" ]

  rm -rf "${BATS_TEST_TMPDIR}/job"
  STUB_RUN_S_0=1 STUB_RUN_S_1=1 STUB_DIES_2=2 elastic_sbatch # node 2 fails a second after node 0 finished
  status=0
  wait "${JOB_PID}" || status=$?
  [ "${status}" -eq 0 ]
  grep -q "training finished" "${BATS_TEST_TMPDIR}/job/out"
}
