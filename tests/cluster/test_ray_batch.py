"""slurm/ray.sbatch, pbs/ray.pbs (through slurm-wlm-torque's qsub) and slurm/prepare.sbatch on
the real three-node SLURM cluster (see conftest.py).

Each job starts real Ray (a head and a worker node, `ray start` on the test nodes' own loopback
addresses), submits the training through purrsight.ray_engine.submit and stops its Ray at the end.
Every way the site stops a job is real: a qdel, which is a plain scancel here (SIGTERM to every
process of the job, SIGKILL after KillWait), a preemption by a job of a higher partition (the same signals, then
SLURM's requeue), USR1 before the time limit.
"""

from __future__ import annotations

import json
import re
import secrets
import subprocess
import time
from pathlib import Path

import pytest
import torch

from purrsight.ray_node.ports import JobPorts
from tests.cluster.conftest import SlurmCluster
from tests.cluster.test_pbs import qsub, qsub_script
from tests.cluster.test_slurm import batch_output, job_env, sbatch, submit
from tests.helpers import (
    REPO,
    check_every_sample_once,
    held_marker,
    hold_env,
    log_time,
    rank0_steps,
    record_samples_env,
    tiny_overrides,
)
from tests.host_scan import SecretWatch, processes_using, processes_with_env

pytest.importorskip("ray", reason="slurm/ray.sbatch needs the ray extra (scripts/test.sh installs it)")
pytestmark = pytest.mark.root  # SLURM's daemons run as root here

ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}
# Memory per node: SLURM's limit sizes each node's object store (30% of it), and keeps four
# Ray nodes on this machine from claiming /dev/shm four times over.
RAY_ALLOCATION = ("--mem=1000",)
# The shipped config's loop: 2 loader workers per rank, 2 micro-batches per optimizer step.
REAL_SHAPE = {"data__num_workers": 2, "data__batch_size": 4, "trainer__accumulate_grad_batches": 2}


# Tracker credentials in the submitting user's environment (sbatch passes it on): like the job's
# own Ray token, on no command line and in no file that other users may read.
# Made at import, never written in this file: `ray job submit --working-dir .` uploads the repo,
# this file included, into Ray's temp dirs (mode 644), where the scan would find a literal.
SECRETS = {"WANDB_API_KEY": f"wandb-{secrets.token_hex(12)}", "MLFLOW_TRACKING_PASSWORD": f"mlflow-{secrets.token_hex(12)}"}


def temp_prefix(job: str) -> str:
    return f"/tmp/prs-{job}-"  # each node's Ray temp dir: /tmp/prs-<job>-<slot>[-<suffix>]


def ray_tokens(*folders: Path) -> list[str]:
    """The tokens the jobs made for their Ray (0600 files under their log folders: ``folder/logs``
    or, for jobs submitted from subfolders, ``folder/*/logs``), while they exist."""
    found = []
    for folder in folders:
        for path in [*folder.glob("logs/ray-*/.auth-token"), *folder.glob("*/logs/ray-*/.auth-token")]:
            try:
                found.append(path.read_text())
            except OSError:
                continue
    return [token for token in found if token]


def watch_secrets(*folders: Path, jobs: list[str]) -> SecretWatch:
    """Command lines, and the files of the jobs' folders, the cluster's and their Ray temp dirs."""

    def roots() -> list[Path]:
        return [*folders, *(path for job in jobs for path in Path("/tmp").glob(f"prs-{job}-*"))]

    return SecretWatch(lambda: [*SECRETS.values(), *ray_tokens(*folders)], roots)


def ray_processes_seen(job: str) -> dict[int, str]:
    """This job's Ray on the nodes now, found by what no teardown looks at: open files and working
    folders under its temp dirs (Ray renames its processes: ray::RayTrainWorker...)."""
    return processes_using(temp_prefix(job))


def no_ray_left(slurm: SlurmCluster, job: str, seen: dict[int, str], node_logs: Path) -> None:
    """Our teardown stopped every process of the job's Ray (no node log in ``node_logs`` says it
    could not), and once SLURM is done with the job, none of the job's Ray processes seen while it
    ran, renamed workers included, nor any other holding its temp dirs, nor any with the job's
    SLURM_JOB_ID in its environment (every process of the job inherits it: a daemon that left the
    temp dirs and closed its files still has it), is alive; and the temp dirs are gone.

    Done means ended (scontrol shows COMPLETING until every node has reported its end) and its
    slurmstepd gone: they outlive that report while they clean up, and a start that had begun when
    a cancel came tears its Ray down from them."""
    logs = sorted(node_logs.glob("*.log"))
    assert logs, f"no node log in {node_logs}"
    unstopped = [path.name for path in logs if "could not stop pids" in path.read_text(errors="replace")]
    assert not unstopped, f"our teardown left processes of job {job}'s Ray: {unstopped}"
    deadline = time.monotonic() + 120
    slurm.wait_state(job, ENDED, timeout=120)
    while step_daemons(job):
        assert time.monotonic() < deadline, step_daemons(job)
        time.sleep(1)
    assert any(title.startswith("ray::") for title in seen.values()), seen  # the check sees renamed workers
    alive = {pid: title for pid, title in seen.items() if Path(f"/proc/{pid}").exists() and title in _title(pid)}
    assert not alive and not ray_processes_seen(job), (alive, ray_processes_seen(job))
    assert not processes_with_env("SLURM_JOB_ID", job), processes_with_env("SLURM_JOB_ID", job)
    assert not list(Path("/tmp").glob(f"prs-{job}-*")), f"job {job}'s Ray temp dirs left"


def _title(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def wait_for_text(path: Path, text: str, slurm: SlurmCluster, job: str, seen: dict[int, str], timeout: float = 300) -> None:
    """Until ``text`` is in the job's output, noting its Ray processes meanwhile."""
    deadline = time.monotonic() + timeout
    while not (path.exists() and text in path.read_text(errors="replace")):
        running = time.monotonic() < deadline and slurm.job_field(job, "JobState") not in ENDED
        assert running, (path.read_text(errors="replace") if path.exists() else "(no output)")[-3000:]
        seen.update(ray_processes_seen(job))
        time.sleep(1)


def step_daemons(job: str = "") -> list[str]:
    """The slurmstepd processes alive (each names its job: ``slurmstepd: [12.batch]``), ``job``'s alone when given."""
    done = subprocess.run(["pgrep", "-a", "slurmstepd"], capture_output=True, text=True, check=False)
    return [line for line in done.stdout.splitlines() if f"[{job}." in line or not job]


def wait_for_file(path: Path, slurm: SlurmCluster, job: str, seen: dict[int, str], timeout: float = 300) -> None:
    """Until ``path`` exists (a hold's marker: tests/helpers.held_marker), noting the job's Ray processes meanwhile."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        running = time.monotonic() < deadline and slurm.job_field(job, "JobState") not in ENDED
        assert running, f"{path.name} never appeared (job {job} {slurm.job_field(job, 'JobState')})"
        seen.update(ray_processes_seen(job))
        time.sleep(1)


def test_two_ray_jobs_on_the_same_nodes_a_qdel_and_a_preemption_each_stop_one_with_a_checkpoint(
    slurm: SlurmCluster, synthetic_dir: Path, tmp_path: Path
) -> None:
    """docs/DATA.md's array (slurm/prepare.sbatch, 2 parts), then two Ray jobs at once on node0
    and node1, both with tracker credentials in their environment: A, pbs/ray.pbs through `qsub -V`
    (slurm-wlm-torque), from the index; B, slurm/ray.sbatch, from the prepared set.

    `qdel` stops A (a plain scancel here: SIGTERM to every process of the job, Ray's included,
    which hold it and stay up while the driver stops the run): a checkpoint at the step it reached,
    and no requeue. A's teardown leaves B's Ray training on the same nodes. Then a job of the
    `urgent` partition preempts B (SIGTERM to everything, SIGKILL after KillWait, SLURM's requeue):
    a checkpoint at its step, a resume once the urgent job is done, and B finishes with every
    sample trained once per epoch. B runs in the shipped real config's shape (2 loader workers per
    rank, 2 micro-batches per step), whose loader workers the preemption's SIGTERM reaches too.
    Each job's ports come from its own id, each node's Ray is sized from the allocation; no command
    line and no file others may read holds a job's Ray token or a tracker credential, at any moment
    of the jobs; neither job leaves a Ray process (renamed ones counted) or temp dir.

    Nothing waits for one job to be slower than another: B is held at gates it reads
    (tests/helpers.hold_env) at step 10 until A's teardown is done, and at step 21 until the
    preemption's SIGTERM releases it.
    """
    env = job_env(slurm, tmp_path)
    prepared = tmp_path / "prepared"
    array = sbatch(
        slurm, env, "--array=0-1", "--cpus-per-task=1", "--time=20", f"--output={tmp_path}/prepare-%A_%a.out",
        "slurm/prepare.sbatch", "config/train_config.yaml", str(prepared), "--shard-size", "32",
        *tiny_overrides(synthetic_dir, tmp_path / "runs"),
    )  # fmt: skip
    deadline = time.monotonic() + 300
    # Gone from the queue, and their slurmstepd gone too: a job started on a node while the last
    # one's slurmstepd still cleans up its cgroups was SIGKILLed there 1 s after its start once
    # (slurmd: "[6.batch] get_exit_code task 0 died by signal: 9", its freezer cgroup already gone).
    while slurm.run("squeue", "-h", "-j", array, check=False).strip() or step_daemons():
        assert time.monotonic() < deadline, slurm.run("squeue", check=False)
        time.sleep(1)
    parts = [(tmp_path / f"prepare-{array}_{task}.out").read_text() for task in (0, 1)]
    assert "part 0/2" in parts[0] and "part 1/2" in parts[1], parts
    assert json.loads((prepared / "manifest.json").read_text()), parts

    on_shared_nodes = ("--nodelist=node0,node1", *RAY_ALLOCATION)
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    # B: 128 samples, 2 workers x 4 x 2 a step: 8 steps an epoch, 4 epochs. Held at step 10 until A's
    # teardown is done (then it must train on: its steps 15 and 20 logged after the teardown, as
    # it logs every 5), at step 21 until the preemption stops it: the preemption finds it training
    # however fast or slow this machine is, and a few steps before the end (with 2 micro-batches a
    # step its stop lands at 22: the vote started at 22's first micro-batch is read at its second).
    steps = 32
    a_down, never = tmp_path / "a-torn-down", tmp_path / "released-only-by-a-stop"
    gates = hold_env({10: a_down, 21: never}, slurm.env)
    records = tmp_path / "samples"
    # node0 and node1 by name (-w), one slot each, and SLURM's --mem: as on_shared_nodes gives B.
    first = qsub(
        slurm, tmp_path / "a", qsub_script(tmp_path / "a", "ray.pbs", "nodes=node0+node1,mem=1000mb"), synthetic_dir,
        extra_env=SECRETS, trainer__max_steps=100000, checkpoint__every_n_steps=100000,
    )  # fmt: skip
    second = submit(
        slurm, tmp_path / "b", synthetic_dir, extra_env={**SECRETS, **record_samples_env(records, slurm.env), **gates},
        script="slurm/ray.sbatch", sbatch_args=on_shared_nodes,
        trainer__max_steps=steps, checkpoint__every_n_steps=100000, data__prepared=str(prepared), **REAL_SHAPE,
    )  # fmt: skip
    out_a, out_b = tmp_path / "a" / "job.out", tmp_path / "b" / f"purrsight-ray-{second}.out"
    seen: dict[str, dict[int, str]] = {first: {}, second: {}}
    with watch_secrets(tmp_path, slurm.root, jobs=[first, second]) as watch:
        wait_for_text(out_a, "step 5/", slurm, first, seen[first])
        wait_for_text(out_b, "step 5/", slurm, second, seen[second])
        seen[first].update(ray_processes_seen(first))
        subprocess.run(["qdel", first], env=slurm.env, check=True, timeout=60)
        assert slurm.wait_state(first, ENDED, timeout=120) == "CANCELLED", out_a.read_text()[-3000:]
        (teardown,) = [line for line in out_a.read_text().splitlines() if "Ray on every node" in line]
        wait_for_file(held_marker(a_down), slurm, second, seen[second])
        a_down.touch()
        # B trains on after A's teardown: two of its steps stamped after it, up to its next gate.
        wait_for_file(held_marker(never), slurm, second, seen[second])
        # Its step lines reach the job's output through Ray's log monitor, which batches them (and
        # holds lines alike for up to 5 s): B, held, cannot run away meanwhile.
        deadline = time.monotonic() + 60
        while len([when for when, _ in rank0_steps(out_b.read_text(errors="replace")) if when > log_time(teardown)]) < 2:
            assert time.monotonic() < deadline, out_b.read_text(errors="replace")[-3000:]
            time.sleep(1)
        urgent = sbatch(
            slurm, env, "--partition=urgent", "--nodes=2", "--nodelist=node0,node1", "--exclusive", "--time=5",
            f"--output={tmp_path}/urgent-%j.out", "--wrap", "sleep 5",
        )  # fmt: skip
        wait_for_text(out_b, "stopped by SIGTERM (scancel or preemption)", slurm, second, seen[second])
        assert slurm.wait_state(urgent, ENDED, timeout=300) == "COMPLETED", slurm.log("slurmctld")
        wait_for_text(out_b, "resume=auto: continuing from", slurm, second, seen[second], timeout=400)
        assert slurm.wait_state(second, ENDED, timeout=500) == "COMPLETED", out_b.read_text()[-4000:]
    outs = {first: out_a.read_text(errors="replace"), second: batch_output(tmp_path / "b", second, "purrsight-ray")}

    for job, name in ((first, "a"), (second, "b")):
        out = outs[job]
        assert f"submit --address http://127.0.1.1:{JobPorts.of(job).dashboard} " in out, out[-3000:]
        assert "all 2 node(s) up: node0, node1" in out
        for node, address in (("node0", "127.0.1.1"), ("node1", "127.0.1.2")):
            log = (tmp_path / name / "logs" / f"ray-{job}" / f"{node}.log").read_text()
            source = "SLURM" if job == second else "none in the job"  # ray.pbs: no NGPUS, no CUDA_VISIBLE_DEVICES
            sized = re.search(rf"at {address}: 1 CPUs \(affinity mask\), 0 GPUs \({source}\), object store 0\.3 GiB", log)
            assert sized, log[-2000:]
            assert f"stopping this job's Ray on {node}" in log
        no_ray_left(slurm, job, seen[job], tmp_path / name / "logs" / f"ray-{job}")
    assert JobPorts.of(first).base != JobPorts.of(second).base
    watch.assert_clean(set(SECRETS.values()))
    assert len(watch.seen) >= len(SECRETS) + 3, "the scans never saw the jobs' Ray tokens"  # A's, B's and B's requeued run's

    # A, qdel'd: a checkpoint at the step it reached, SIGTERM having reached every process of it.
    assert "Ray over 2 node(s) node0 node1; head 127.0.1.1" in outs[first], outs[first][-3000:]
    stopped = re.findall(r"stopped by SIGTERM at step (\d+); checkpoint", outs[first])
    assert len(stopped) == 1, outs[first][-3000:]
    saved = sorted((tmp_path / "a" / "runs" / "phase2-tiny" / "checkpoints").glob("step-*.ckpt"))
    assert [path.name for path in saved] == [f"step-{int(stopped[0]):08d}.ckpt"], saved  # no periodic one was due
    assert f"the checkpoints are kept (qrerun {first} resumes)" in outs[first], outs[first][-3000:]
    assert slurm.job_field(first, "Restarts") == "0"
    for node in ("node0", "node1"):
        log = (tmp_path / "a" / "logs" / f"ray-{first}" / f"{node}.log").read_text()
        assert "SIGTERM: the job is stopping; Ray stays up" in log, log[-2000:]

    # B, preempted: the stop's checkpoint, SLURM's requeue (the script, which cannot tell a
    # preemption from a scancel, requeues nothing itself), the resume from it, the end.
    assert f"data: 128 train samples (prepared {prepared})" in outs[second]
    assert "stopped by SIGTERM (scancel or preemption): not requeueing; the checkpoints are kept" in outs[second]
    stopped = re.findall(r"stopped by SIGTERM at step (\d+); checkpoint", outs[second])
    resumed = re.search(r"resume=auto: continuing from .*step-(\d+)\.ckpt", outs[second])
    assert len(stopped) == 1 and resumed and resumed.group(1) == f"{int(stopped[0]):08d}", outs[second][-4000:]
    assert int(stopped[0]) == 22, stopped  # held at 21, 2 micro-batches a step: the vote of 22's first is read at its second
    assert slurm.job_field(second, "Restarts") == "1" and "training finished" in outs[second]
    assert (tmp_path / "b" / "runs" / "phase2-tiny" / "checkpoints" / f"step-{steps:08d}.ckpt").exists()
    every_id = {json.loads(line)["id"] for line in (synthetic_dir / "train.jsonl").read_text().splitlines()}
    check_every_sample_once(records, every_id, whole_epochs=steps // 8, accumulation=2)


def failing_ray_on_the_second_node(folder: Path) -> Path:
    """A VENV whose `ray` fails to start on the job's second node, on the first run only.

    Stands in for a node whose Ray cannot start (a full /tmp, a broken install), which this
    one-machine cluster cannot have; every other start runs the real `ray`.
    """
    (folder / "bin").mkdir(parents=True)
    (folder / "bin" / "activate").write_text(f'source {REPO / ".venv" / "bin" / "activate"}\nPATH="{folder / "bin"}:$PATH"\n')
    fake = folder / "bin" / "ray"
    fake.write_text(
        "#!/usr/bin/env bash\n"
        'second="$(scontrol show hostnames "${SLURM_JOB_NODELIST}" | sed -n 2p)"\n'
        'if [[ "$1" == start && "${SLURMD_NODENAME}" == "${second}" && "${SLURM_RESTART_COUNT:-0}" == 0 ]]; then\n'
        '  echo "ray: cannot start on ${SLURMD_NODENAME} (test)" >&2\n'
        "  exit 1\n"
        "fi\n"
        f'exec {REPO / ".venv" / "bin" / "ray"} "$@"\n'
    )
    fake.chmod(0o755)
    return folder


def test_a_node_whose_ray_fails_to_start_is_excluded_then_usr1_requeues_the_job(
    slurm: SlurmCluster, synthetic_dir: Path, tmp_path: Path
) -> None:
    """Run 1: the second node's Ray fails to start; the wait ends at once, names it (exit 3), and
    the job requeues without it. Run 2, on the two other nodes, trains until USR1 (what
    --signal=B:USR1@240 sends before the time limit) stops it with a checkpoint, and the script
    requeues the job (its second requeue), which is then cancelled. The job asks for 2 CPUs a task:
    under the cluster's CPU binding each node's Ray gets both (an srun step that does not ask for
    its CPUs gets one). Run 2 is held at step 20, its checkpoint written, until the stop releases
    it (tests/helpers.hold_env): USR1 finds it training however fast this machine is.

    Merged (tests/README.md): a third run resumed from the stop's checkpoint and finished, every
    sample once per epoch in the real config's shape; the resume after a requeue, in that shape,
    is job B's of the two-jobs test above.
    """
    never = tmp_path / "released-only-by-a-stop"
    extra = {"VENV": str(failing_ray_on_the_second_node(tmp_path / "venv")), **hold_env({20: never}, slurm.env)}
    job = submit(
        slurm, tmp_path, synthetic_dir, extra_env=extra, script="slurm/ray.sbatch",
        sbatch_args=(*RAY_ALLOCATION, "--cpus-per-task=2"), trainer__max_steps=40, checkpoint__every_n_steps=20, **REAL_SHAPE,
    )  # fmt: skip
    checkpoints = tmp_path / "runs" / "phase2-tiny" / "checkpoints"
    seen: dict[int, str] = {}
    deadline = time.monotonic() + 400
    while not ((checkpoints / "step-00000020.ckpt").exists() and held_marker(never).exists()):
        running = time.monotonic() < deadline and slurm.job_field(job, "JobState") not in ENDED
        assert running, batch_output(tmp_path, job, "purrsight-ray")[-3000:]
        seen.update(ray_processes_seen(job))
        time.sleep(0.5)
    run2_nodes = slurm.run("scontrol", "show", "hostnames", slurm.job_field(job, "NodeList")).split()
    slurm.run("scancel", "--signal=USR1", "--batch", job)
    # Requeued by the script (its second requeue), then cancelled: its third start is held back by
    # SLURM (cred_expire), and should it have begun, the cancel stops it as any scancel does.
    deadline = time.monotonic() + 300
    while slurm.job_field(job, "Restarts") != "2":
        assert time.monotonic() < deadline and slurm.job_field(job, "JobState") not in ENDED, slurm.job_field(job, "JobState")
        seen.update(ray_processes_seen(job))
        time.sleep(0.5)
    slurm.run("scancel", job)
    assert slurm.wait_state(job, ENDED, timeout=120) == "CANCELLED"
    out = batch_output(tmp_path, job, "purrsight-ray")

    named = re.search(r"error: node (node\d)'s Ray step ended before the cluster was up", out)
    assert named, out[-3000:]
    bad = named.group(1)
    assert f"node {bad} failed its health checks (ray start): excluding it from this job" in out
    assert f"requeueing without {bad}; the next run resumes" in out
    assert slurm.job_field(job, "ExcNodeList") == bad and bad not in run2_nodes
    assert "received SIGUSR1: stopping the training (every worker saves a checkpoint)" in out
    assert "run ended with code 143 after SIGUSR1: requeueing; the next run resumes" in out
    stopped = re.search(r"stopped by SIGTERM at step (\d+); checkpoint: (\S+)", out)
    # Held at 20, 2 micro-batches a step: 21 at the latest; 20 when step 20's validation pass, which
    # reads the vote at each batch, comes first (docs/RELIABILITY.md).
    assert stopped and 20 <= int(stopped.group(1)) <= 21, out[-3000:]
    saved = Path(stopped.group(2))
    assert saved == checkpoints / f"step-{int(stopped.group(1)):08d}.ckpt", saved
    position = torch.load(saved, weights_only=True)["purrsight"]["position"]  # whole: it loads, its position the stop's
    assert position["epoch"] == int(stopped.group(1)) // 8, position  # 8 steps an epoch
    for node in run2_nodes:
        log = (tmp_path / "logs" / f"ray-{job}" / f"{node}.log").read_text()
        assert re.search(r"at 127\.0\.1\.\d: 2 CPUs \(affinity mask\)", log), log[-2000:]
    no_ray_left(slurm, job, seen, tmp_path / "logs" / f"ray-{job}")
