"""pbs/train.pbs under a simulated PBS job, and pbs/train.pbs and pbs/ray.pbs through a real batch system (below).

No PBS server can be installed on these machines, so this stands in for one: a PBS_NODEFILE
with each host repeated per core (as PBS writes it), PBS_O_WORKDIR and PBS_JOBID set as qsub
sets them, and tests/cluster/fake_pbsdsh as `pbsdsh`, which runs each node's command on this
machine with PBS_NODENUM set. Everything the script starts after that is real: the launchers,
torchrun, gloo and the trainer.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.cluster.conftest import SlurmCluster
from tests.helpers import REPO, free_port, tiny_overrides
from tests.host_scan import processes_using


def pbs_job(
    tmp: Path,
    synthetic_dir: Path,
    script: str,
    workdir: Path = REPO,
    *,
    max_steps: int = 20,
    hosts: tuple[str, str] = ("127.0.0.1", "localhost"),
    extra_env: dict[str, str] | None = None,
) -> tuple[Path, dict[str, str]]:
    """A copy of pbs/SCRIPT in a PBS spool folder and the environment PBS runs it with, on two hosts of two cores."""
    fake_bin = tmp / "bin"
    fake_bin.mkdir(exist_ok=True)
    (fake_bin / "pbsdsh").unlink(missing_ok=True)
    (fake_bin / "pbsdsh").symlink_to(REPO / "tests" / "cluster" / "fake_pbsdsh")
    nodefile = tmp / "nodefile"
    nodefile.write_text("".join(f"{host}\n{host}\n" for host in hosts))  # two hosts, two cores each
    overrides = tiny_overrides(synthetic_dir, tmp / "runs", trainer__max_steps=max_steps)
    env = {
        "PATH": f"{fake_bin}:{REPO / '.venv' / 'bin'}:/usr/local/bin:/usr/bin:/bin",
        "HOME": str(tmp),
        "PBS_NODEFILE": str(nodefile),
        "PBS_O_WORKDIR": str(workdir),
        "PBS_JOBID": "4242.pbs-server",
        "CONFIG": "config/train_config.yaml",
        "OVERRIDES": " ".join(overrides),
        "LOG_DIR": str(tmp / "logs"),
        "OMP_NUM_THREADS": "1",
        "RDZV_TIMEOUT": "120",
        "FAKE_PBSDSH_CALLS": str(tmp / "calls"),
        **(extra_env or {}),
    }
    spooled = tmp / "4242.pbs-server.SC"  # PBS runs a copy of the script from its spool folder
    spooled.write_text((REPO / "pbs" / script).read_text())
    return spooled, env


def run_pbs(
    tmp: Path, synthetic_dir: Path, workdir: Path = REPO, **extra_env: str
) -> tuple[subprocess.CompletedProcess[str], float]:
    spooled, env = pbs_job(tmp, synthetic_dir, "train.pbs", workdir, extra_env=extra_env)
    start = time.monotonic()
    done = subprocess.run(["bash", str(spooled)], cwd=tmp, env=env, capture_output=True, text=True, timeout=400)
    return done, time.monotonic() - start


def test_every_node_gets_its_rank_and_training_completes(synthetic_dir: Path, tmp_path: Path) -> None:
    done, _ = run_pbs(tmp_path, synthetic_dir)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert "2 node(s): 127.0.0.1 localhost; master 127.0.0.1:24242" in done.stdout  # 20000 + job id 4242
    assert sorted((tmp_path / "calls").read_text().split()) == ["0", "2"]  # first vnode of each host
    assert "process group ready: global rank 0 of 2" in (tmp_path / "logs" / "latest_node0.log").read_text()
    assert "process group ready: global rank 1 of 2" in (tmp_path / "logs" / "latest_node1.log").read_text()
    assert (tmp_path / "runs" / "phase2-tiny" / "checkpoints" / "step-00000020.ckpt").exists()
    assert "training finished on all 2 node(s)" in done.stdout


def test_one_failing_node_fails_the_job_and_stops_the_others(synthetic_dir: Path, tmp_path: Path) -> None:
    """A node whose spawn fails: OpenPBS's pbsdsh prints it and exits 0, as it does when a task
    ends, whatever the task's code; no answer from the task (node_task.sh's exit code) within
    PBS_STATUS_WAIT_S fails the job."""
    done, elapsed = run_pbs(tmp_path, synthetic_dir, FAKE_PBSDSH_FAIL_INDEX="2", PBS_STATUS_WAIT_S="3")
    assert done.returncode == 1, (done.stdout + done.stderr)[-4000:]
    assert "pbsdsh: spawn failed on node 2" in done.stderr, done.stderr[-2000:]
    assert "node 1 failed with exit code 1: stopping the other nodes" in done.stdout
    assert elapsed < 60, elapsed  # node 0 was stopped, not left waiting for its rendezvous timeout
    time.sleep(2)
    leftover = [
        p
        for p in psutil.process_iter(["cmdline"])
        if str(tmp_path) in " ".join(p.info["cmdline"] or []) and "cluster_train" in " ".join(p.info["cmdline"] or [])
    ]
    assert leftover == []


def test_an_elastic_job_goes_on_without_a_failed_node_while_min_nodes_remain(synthetic_dir: Path, tmp_path: Path) -> None:
    """MIN_NODES=1 of two hosts (batch/elastic.sh): the same failed spawn on node 1 is logged and left
    behind, node 0 (launched with 1:2) trains alone to the end, and the job exits 0."""
    done, _ = run_pbs(tmp_path, synthetic_dir, FAKE_PBSDSH_FAIL_INDEX="2", PBS_STATUS_WAIT_S="3", MIN_NODES="1")
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert "2 node(s): 127.0.0.1 localhost (elastic: goes on while 1 remain)" in done.stdout
    assert "node 1 (localhost) ended with exit code 1: the job goes on with 1 of 2 nodes (MIN_NODES=1)" in done.stdout
    assert "stopping the other nodes" not in done.stdout
    assert "training finished on 1 of 2 node(s)" in done.stdout
    log = (tmp_path / "logs" / "latest_node0.log").read_text()
    assert "node 0/1:2 (elastic: goes on while 1 of up to 2 nodes remain)" in log, log[-3000:]
    assert "global batch 8 = 1 processes x 8 (data.batch_size)" in log, log[-3000:]  # node 0 alone
    assert (tmp_path / "runs" / "phase2-tiny" / "checkpoints" / "step-00000020.ckpt").exists()
    refused_dir = tmp_path / "refused"
    refused_dir.mkdir()
    refused, _ = run_pbs(refused_dir, synthetic_dir, MIN_NODES="3")  # more nodes than the job has: refused before any starts
    assert refused.returncode == 2, (refused.stdout + refused.stderr)[-2000:]
    assert refused.stderr.strip() == "error: MIN_NODES=3 must be a whole number of nodes from 1 to the job's 2"


def test_a_task_that_fails_fails_the_job_though_pbsdsh_exits_0(synthetic_dir: Path, tmp_path: Path) -> None:
    """OpenPBS's pbsdsh exits 0 once its task has ended, whatever the task's code: the job's code is
    the tasks' own (node_task.sh writes it), not the clients'. A config override the trainer
    refuses ends every node with 2; the job must too, and must not say it finished."""
    done, _ = run_pbs(tmp_path, synthetic_dir, OVERRIDES="trainer.max_steps=twenty")
    assert done.returncode == 2, (done.stdout + done.stderr)[-4000:]
    assert "trainer.max_steps" in done.stdout + done.stderr  # the trainer's own refusal, not another failure
    assert "failed with exit code 2" in done.stdout and "training finished" not in done.stdout


def test_train_pbs_stopped_by_qdel_through_pbsdsh_checkpoints_on_every_node_and_leaves_nothing(
    synthetic_dir: Path, tmp_path: Path
) -> None:
    """pbs/train.pbs through OpenPBS's pbsdsh as it behaves (its clients exit 1 as soon as they have
    forwarded qdel's SIGTERM, their tasks running on): the script waits for the tasks' own end,
    both ranks checkpoint at the same step, and no process of the job is left (job_processes)."""
    text, stopped = qdel_a_job(tmp_path, synthetic_dir, "train.pbs", "4244", running="train_phase2.py")
    assert len(stopped) == 2 and stopped[0] == stopped[1], text[-3000:]  # both ranks, at the same step
    assert (tmp_path / "runs" / "phase2-tiny" / "checkpoints" / f"step-{int(stopped[0]):08d}.ckpt").exists()
    assert "pbsdsh: killing task" in text  # the clients forwarded the signal, then left


def test_the_jobs_environment_reaches_every_node(synthetic_dir: Path, tmp_path: Path) -> None:
    """What the job exported arrives on each node, by name and by family (NCCL_*, TORCH_*, ...),
    through a file only the user can read, never on the task's command line (a token among them).

    The launcher on the nodes is replaced by a script that writes its environment to a file:
    this test is about what train.pbs hands over (the tests above run the real launcher).
    fake_pbsdsh starts each task in a bare environment, as pbsdsh does.
    """
    workdir = tmp_path / "work"
    (workdir / "pbs").mkdir(parents=True)
    (workdir / "batch").mkdir()
    for name in ("pbs/train.pbs", "pbs/nodes.sh", "pbs/node_task.sh", "batch/elastic.sh"):
        (workdir / name).write_bytes((REPO / name).read_bytes())
        (workdir / name).chmod(0o755)
    dump = workdir / "cluster_train.sh"
    dump.write_text('#!/bin/sh\nenv > "$PWD/env.node$3"\n')
    dump.chmod(0o755)
    sent = {
        "NCCL_IB_HCA": "mlx5_0,mlx5_1",
        "NCCL_SOCKET_IFNAME": "ib0",
        "TORCH_NCCL_BLOCKING_WAIT": "1",
        "HF_HOME": "/shared/hf cache",
        "CUDA_DEVICE_MAX_CONNECTIONS": "1",
        "LD_LIBRARY_PATH": "/opt/nccl/lib",
        "MAX_RESTARTS": "5",
        "RDZV_STORE_TIMEOUT": "600",  # the launcher's rendezvous settings, each by name
        "RDZV_LAST_CALL_S": "10",
        "MONITOR_INTERVAL": "5",
        "WORKER_START": "subprocess",
        "HF_TOKEN": "hf_secret_for_the_nodes_only",
        "PURRSIGHT_SECRET_KEY": "one secret with spaces",
        "WANDB_API_KEY": "wandb_secret_for_rank_0",
        "MLFLOW_TRACKING_URI": "http://tracker:5000",
        "MLFLOW_TRACKING_PASSWORD": "mlflow_secret",
    }
    args = tmp_path / "pbsdsh-args"
    done, _ = run_pbs(tmp_path, synthetic_dir, workdir=workdir, UNRELATED_SETTING="stays", FAKE_PBSDSH_ARGS=str(args), **sent)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    for rank in (0, 1):
        received = dict(line.split("=", 1) for line in (workdir / f"env.node{rank}").read_text().splitlines() if "=" in line)
        assert {key: received.get(key) for key in sent} == sent
        assert "UNRELATED_SETTING" not in received  # forwarded by name or family only
        assert received["PBS_NODENUM"] in {"0", "2"}
    shown = args.read_text()
    assert shown.count("env file mode 600") == 2 and "hf_secret" not in shown and "one secret" not in shown, shown
    assert "wandb_secret" not in shown and "mlflow_secret" not in shown, shown
    assert not list((workdir / "logs").glob(".pbs-env-*"))  # read and removed on each node


def job_processes(tag: str, tmp: Path, ray_job: str) -> dict[int, str]:
    """The job's processes on every "host", by what the scripts' own teardown never walks: the
    tag in their environment (the MoM's record of the job: what pbsdsh's tasks inherit), their
    command line naming the job's folder, or a working folder or open file in its Ray temp dirs
    (Ray's renamed workers; under ssh, where sshd gives the task a fresh environment)."""
    found = processes_using(f"/tmp/prs-{ray_job}-")
    for proc in Path("/proc").iterdir():
        try:
            if not proc.name.isdigit() or int(proc.name) == os.getpid():
                continue
            title = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if title.startswith("sshd: ") and "[listener]" in title:
                continue  # the test's sshd itself, not the job's
            if f"FAKE_PBSDSH_TAG={tag}\0".encode() in (proc / "environ").read_bytes() or str(tmp) in title:
                found[int(proc.name)] = title[:120]
        except OSError:
            continue
    return found


def start_job(spooled: Path, env: dict[str, str], tmp: Path) -> tuple[subprocess.Popen[bytes], Path]:
    """The spooled job script started as PBS starts it: a session of its own, its output in job.out."""
    out = tmp / "job.out"
    with out.open("w") as sink:
        job = subprocess.Popen(
            ["bash", str(spooled)], cwd=tmp, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
        )
    return job, out


def qdel_at_step_5(job: subprocess.Popen[bytes], out: Path, tmp: Path, tag: str, number: str, running: str) -> dict[int, str]:
    """Once the run reached step 5 (and ``running`` is in a title the count finds: it sees the job):
    SIGTERM to every process of the job's sessions (its script's and each pbsdsh task's, as the MoM
    sends qdel's), the script's end awaited; the job's processes left."""
    deadline = time.monotonic() + 300
    while "step 5/" not in out.read_text(errors="replace"):
        assert job.poll() is None and time.monotonic() < deadline, out.read_text(errors="replace")[-3000:]
        time.sleep(0.5)
    assert any(running in title for title in job_processes(tag, tmp, number).values()), job_processes(tag, tmp, number)
    tasks = tmp / "tasks"
    sessions = {job.pid, *(map(int, tasks.read_text().split()) if tasks.exists() else ())}
    for pid in job_processes(tag, tmp, number):
        with contextlib.suppress(OSError):
            if os.getsid(pid) in sessions:
                os.kill(pid, signal.SIGTERM)
    job.wait(timeout=150)
    deadline = time.monotonic() + 10  # the MoMs' and sshd's last words to clients already gone
    while job_processes(tag, tmp, number) and time.monotonic() < deadline:
        time.sleep(0.2)
    return job_processes(tag, tmp, number)


def qdel_a_job(
    tmp: Path,
    synthetic_dir: Path,
    script: str,
    number: str,
    running: str,
    hosts: tuple[str, str] = ("127.0.0.1", "localhost"),
    extra_env: dict[str, str] | None = None,
) -> tuple[str, list[str]]:
    """pbs/SCRIPT as job NUMBER through the faithful pbsdsh (``extra_env`` may put ssh in its
    place), stopped by qdel_at_step_5, the kill delay's SIGKILL after: asserts no process of it is
    left; its output and the steps its ranks' stop checkpoints were taken at."""
    tag = f"job-{tmp.name}"
    extra = {"FAKE_PBSDSH_TAG": tag, "FAKE_PBSDSH_TASKS": str(tmp / "tasks"), "PBS_JOBID": f"{number}.pbs-server"}
    spooled, env = pbs_job(tmp, synthetic_dir, script, max_steps=100000, hosts=hosts, extra_env=extra | (extra_env or {}))
    started, out = start_job(spooled, env, tmp)
    try:
        left = qdel_at_step_5(started, out, tmp, tag, number, running=running)
    finally:
        end_job(tmp, tag, number)
    text = out.read_text(errors="replace")
    assert left == {}, (left, text[-3000:])
    return text, re.findall(r"stopped by SIGTERM at step (\d+); checkpoint", text)


def end_job(tmp: Path, tag: str, number: str) -> None:
    """The kill delay's SIGKILL to whatever is left, and the stopped job's rerun marker in the repo's logs."""
    (REPO / "logs" / f".pbs-ran-{number}.pbs-server").unlink(missing_ok=True)
    for pid in job_processes(tag, tmp, number):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def real_sshd(tmp: Path, hosts: tuple[str, ...]) -> Iterator[str]:
    """OpenSSH's sshd on ``hosts`` (loopback addresses), root's logins by a key made here; yields
    the ssh command (PBS_SSH) that reaches them. Root: sshd changes to the user it logs in."""
    keys = tmp / "ssh"
    keys.mkdir()
    for name in ("host_key", "id"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(keys / name)], check=True)
    (keys / "authorized_keys").write_text((keys / "id.pub").read_text())
    port = free_port()
    config = keys / "sshd_config"
    config.write_text(
        f"Port {port}\n" + "".join(f"ListenAddress {host}\n" for host in hosts)
        + f"HostKey {keys / 'host_key'}\nPidFile {keys / 'sshd.pid'}\nAuthorizedKeysFile {keys / 'authorized_keys'}\n"
        "PermitRootLogin prohibit-password\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
        "UsePAM no\nStrictModes no\n"
    )  # fmt: skip
    client = keys / "ssh_config"
    client.write_text(
        f"Host {' '.join(hosts)}\n  Port {port}\n  IdentityFile {keys / 'id'}\n  IdentitiesOnly yes\n"
        "  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n"
    )
    Path("/run/sshd").mkdir(exist_ok=True)  # its privilege separation folder
    sshd = subprocess.Popen(["/usr/sbin/sshd", "-D", "-e", "-f", str(config)], stderr=(keys / "sshd.log").open("w"))
    try:
        deadline = time.monotonic() + 30
        while not all(port_answers(host, port) for host in hosts):
            assert sshd.poll() is None and time.monotonic() < deadline, (keys / "sshd.log").read_text()
            time.sleep(0.1)
        yield f"ssh -F {client} -o BatchMode=yes"
    finally:
        sshd.terminate()  # the listener only: sessions live on in their own sshd processes, as a real sshd's
        sshd.wait(timeout=30)


def port_answers(host: str, port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=1):
        return True
    return False


@pytest.mark.parametrize("launcher", ["pbsdsh", pytest.param("ssh", marks=pytest.mark.root)])
def test_ray_pbs_stopped_by_qdel_through_pbsdsh_or_ssh_checkpoints_and_leaves_nothing_on_any_host(
    launcher: str, synthetic_dir: Path, tmp_path: Path
) -> None:
    """pbs/ray.pbs with its tasks started as a real site starts them: OpenPBS's pbsdsh as it behaves
    (fake_pbsdsh: the task no child of the client, HUP/INT/TERM forwarded, any other signal fatal to
    the client alone), or a real sshd on two loopback addresses (ssh forwards no signal). A qdel as
    the MoM sends it: SIGTERM to every process of the job's sessions (its script's, and each
    pbsdsh task's; an ssh task's session is sshd's, which PBS does not know), the kill delay after.
    The run stops with a checkpoint at the step it reached; every node answers the teardown,
    whose file goes only then; no process of the job is left on any "host" (job_processes)."""
    hosts = ("127.0.0.2", "127.0.0.3")
    with contextlib.ExitStack() as stack:
        ssh = {"PBS_LAUNCHER": "ssh", "PBS_SSH": stack.enter_context(real_sshd(tmp_path, hosts))} if launcher == "ssh" else {}
        text, stopped = qdel_a_job(tmp_path, synthetic_dir, "ray.pbs", "4343", running="ray::", hosts=hosts, extra_env=ssh)
    assert len(stopped) == 1, text[-3000:]
    assert (tmp_path / "runs" / "phase2-tiny" / "checkpoints" / f"step-{int(stopped[0]):08d}.ckpt").exists()
    ray_logs = tmp_path / "logs" / "ray-4343"
    for node in hosts:
        assert (ray_logs / f"{node}.down").read_text() == "down\n", (ray_logs / f"{node}.log").read_text()[-2000:]
    assert not (ray_logs / ".teardown").exists()  # removed once every node had answered
    assert not list(Path("/tmp").glob("prs-4343-*")), "the job's Ray temp dirs left"


# --- PBS through a real batch system ------------------------------------------------------------
# slurm-wlm-torque's qsub, qdel and qrerun drive the real SLURM test cluster (conftest.py): sbatch
# reads the script's #PBS lines, spank_pbs sets PBS_JOBID, PBS_O_WORKDIR and the other PBS_*
# variables, a TaskProlog writes PBS_NODEFILE (one line per slot), and since SLURM has no pbsdsh
# the scripts start each host's task with srun (pbs/nodes.sh). Not covered: pbsdsh itself (the
# simulated tests above), a Torque server's "N.server" job ids, select=...:ngpus= (dropped).
# pbs/ray.pbs through qsub, stopped by qdel, is job A of tests/cluster/test_ray_batch.py's
# two-jobs test: a Ray job beside another one's on the same nodes.


def qsub_script(tmp: Path, name: str, resources: str) -> Path:
    """The shipped script with its select line set to this cluster's nodes, as a site edits its header."""
    text = (REPO / "pbs" / name).read_text()
    script = tmp / name
    script.write_text(re.sub(r"^#PBS -l select=.*$", f"#PBS -l {resources}", text, count=1, flags=re.M))
    return script


def qsub(
    slurm: SlurmCluster, tmp: Path, script: Path, synthetic_dir: Path, extra_env: dict[str, str] | None = None, **overrides: object
) -> str:
    """`CONFIG=... OVERRIDES=... qsub -V -j oe -o OUT SCRIPT` from the repo, as docs/SCHEDULERS.md shows; the job id."""
    env = dict(
        slurm.env,
        **(extra_env or {}),
        PATH=f"{REPO / '.venv' / 'bin'}:{slurm.env['PATH']}",
        CONFIG="config/train_config.yaml",
        OVERRIDES=" ".join(tiny_overrides(synthetic_dir, tmp / "runs", **overrides)),
        LOG_DIR=str(tmp / "logs"),
        OMP_NUM_THREADS="1",
    )
    args = ["qsub", "-V", "-j", "oe", "-o", str(tmp / "job.out"), str(script)]
    done = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip().isdigit(), done.stdout + done.stderr
    return done.stdout.strip()


def wait_for(path: Path, text: str, slurm: SlurmCluster, job: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not (path.exists() and text in path.read_text(errors="replace")):
        assert time.monotonic() < deadline, f"no {text!r} in {path}; job {job} {slurm.job_field(job, 'JobState')}"
        time.sleep(0.5)


def rerun(slurm: SlurmCluster, job: str) -> None:
    """`qrerun JOB`. slurm-wlm-torque 22.05's qrerun stops in its own Perl (it calls
    Slurm->requeue without the state argument) before reaching SLURM; where it does, this runs
    `scontrol requeue JOB`, the call qrerun makes."""
    done = subprocess.run(["qrerun", job], env=slurm.env, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        assert "Usage: Slurm::requeue(self, job_id, state)" in done.stderr, done.stderr
        slurm.run("scontrol", "requeue", job)


@pytest.mark.root
def test_qsub_train_pbs_on_two_nodes_qrerun_resumes_and_qdel_leaves_a_checkpoint(
    slurm: SlurmCluster, synthetic_dir: Path, tmp_path: Path
) -> None:
    script = qsub_script(tmp_path, "train.pbs", "nodes=2:ppn=1")
    job = qsub(slurm, tmp_path, script, synthetic_dir, trainer__max_steps=100000, checkpoint__every_n_steps=10)
    checkpoints = tmp_path / "runs" / "phase2-tiny" / "checkpoints"
    deadline = time.monotonic() + 300
    while not (checkpoints / "step-00000010.ckpt").exists():
        assert time.monotonic() < deadline, (tmp_path / "job.out").read_text(errors="replace")[-3000:]
        time.sleep(0.5)
    nodefile = (slurm.root / "nodefiles" / job).read_text().split()
    assert nodefile == ["node0", "node1"], nodefile  # one line per slot, from PBS_NODEFILE
    rerun(slurm, job)
    node0 = tmp_path / "logs" / "latest_node0.log"
    wait_for(node0, "resume=auto: continuing from", slurm, job)
    wait_for(node0, "training from step", slurm, job)  # the resumed run trains
    subprocess.run(["qdel", job], env=slurm.env, check=True, timeout=60)
    assert slurm.wait_state(job, {"CANCELLED", "COMPLETED", "FAILED"}, timeout=120) == "CANCELLED"
    out = (tmp_path / "job.out").read_text(errors="replace")  # the rerun's: SLURM starts the file anew
    assert f"[train.pbs {job}] job {job} ran before (qrerun): resuming from the newest checkpoint" in out
    assert re.search(rf"\[train.pbs {job}\] 2 node\(s\): node0 node1; master 127\.0\.1\.1:{20000 + int(job)}", out)
    stopped = re.findall(r"stopped by SIGTERM at step (\d+); checkpoint", out)
    assert len(stopped) == 2 and stopped[0] == stopped[1], out[-3000:]  # both ranks, at the same step
    assert (checkpoints / f"step-{int(stopped[0]):08d}.ckpt").exists()
