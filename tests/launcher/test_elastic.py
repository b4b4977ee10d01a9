"""An elastic job (`cluster_train.sh CONFIG 2:3 ...`) that loses a node goes on without it, and
takes it back when it returns.

Three launchers on loopback, one rank each, `trainer.global_batch_size=12` with 2 samples a
micro-batch: 3 ranks x 2 x 2 micro-batches a step. Every rank is held at the end of step 8 (a gate:
tests/helpers.hold_env), node 1 is killed whole there (SIGKILL to every process of it at once: the
launcher, torchrun's agent, the fork server and the worker), and the gate opens. The two others fail
their next collective, their agents meet again without node 1 (c10d's rendezvous: 2 of 2:3), node
2's rank becomes rank 1 (ranks ordered among the nodes present: nodes 0 and 2, a gap), and the
workers resume from the step-5 checkpoint on 2 ranks x 2 x 3 micro-batches: 12 samples a step still.

Held again at step 14, node 1's launcher is started anew (RESUME=auto: the run is in its folder
already, and a start without it is refused): the two agents see it waiting, stop their
workers (SIGTERM: a checkpoint at the end of step 14 or 15), and the three meet and resume from that
checkpoint, nothing trained lost, on 3 ranks x 2 x 2 again. Every step of the run trained 12 samples
(an epoch's last, shorter window aside), no epoch trained a sample twice, and each whole epoch
trained every sample but the sampler's tail. 128 samples: 126 a pass on 3 ranks (2 left out), 128
on 2; 11 steps an epoch on either world, the last one short.
"""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from pathlib import Path
from typing import Any

from tests.helpers import held_marker, hold_env, python_env, record_samples_env, recorded_steps
from tests.launcher.conftest import Cluster, kill_whole, wait_for

GLOBAL_BATCH, BATCH, STEPS, KILLED_AT, SAVED_AT, JOIN_AT = 12, 2, 30, 8, 5, 14


def resumed_and_training(log: Path, offset: int) -> bool:
    """Whether the node log, from ``offset`` on, has a resume and a training step after it."""
    _, resumed, after = log.read_text(errors="replace")[offset:].partition("resuming from checkpoint")
    return bool(resumed) and re.search(rf"step \d+/{STEPS}", after) is not None


def steps_trained(records: Path, killed_ns: int, joined_ns: int, joined_at: int) -> dict[int, list[dict[str, Any]]]:
    """step -> the micro-batches every rank trained for it, in the attempt whose steps the
    checkpoints kept: the first 3-rank attempt's up to the resume from step SAVED_AT, the 2-rank
    attempt's from there to the join's checkpoint, the second 3-rank attempt's after it."""
    attempts = ((0, 3, 0, SAVED_AT), (killed_ns, 2, SAVED_AT, joined_at), (joined_ns, 3, joined_at, STEPS))
    steps: dict[int, list[dict[str, Any]]] = {}
    for path in sorted(records.glob("*.jsonl")):
        started_ns = int(path.name.split("-", 1)[0])
        _, world, after, through = max(attempt for attempt in attempts if attempt[0] < started_ns)
        for record, micro_batches in recorded_steps(path):
            if record["world"] == world and after < record["step"] <= through:
                steps.setdefault(record["step"], []).extend(micro_batches)
    return steps


def test_a_node_killed_mid_run_leaves_two_that_resume_at_the_exact_position_then_it_rejoins_with_the_global_batch_kept(
    cluster: Cluster, tmp_path: Path
) -> None:
    gate, records = tmp_path / "released-after-the-kill", tmp_path / "samples"
    join_gate = tmp_path / "released-only-by-the-joins-stop"
    # RDZV_LAST_CALL_S 4 (2 by default): three launchers starting on two busy cores meet in one first
    # round; a second round to admit a late one would restart the first from scratch.
    env = {"NPROC_PER_NODE": "1", "BACKEND": "gloo", "RDZV_LAST_CALL_S": "4", **record_samples_env(records, python_env())}
    env |= hold_env({KILLED_AT: gate, JOIN_AT: join_gate}, python_env())
    overrides: dict[str, Any] = dict(
        data__batch_size=BATCH, trainer__global_batch_size=GLOBAL_BATCH, trainer__max_steps=STEPS,
        checkpoint__every_n_steps=SAVED_AT, checkpoint__keep_last=10, logging__every_n_steps=1,
        trainer__val_every_n_steps=1000,
    )  # fmt: skip
    # The workers first: they wait for the master, so the three join its first round together.
    nodes = {rank: cluster.start("2:3", rank, env=env, **overrides) for rank in (1, 2)}
    time.sleep(2)
    nodes[0] = cluster.start("2:3", 0, env=env, **overrides)
    held = wait_for(lambda: all(held_marker(gate, rank).exists() for rank in range(3)), timeout=300)
    assert held, [node.text()[-2000:] for node in nodes.values()]

    # A node lost whole: every process of it at once, the forked worker too (the fork server's
    # children are in a process group of their own, so a killpg alone let the worker see its
    # agent die and stop with a checkpoint: an orderly stop, not a loss).
    log = cluster.log_dir / "latest_node0.log"
    before_the_loss = len(log.read_text(errors="replace"))  # what follows is the loss's answer
    killed_ns = time.time_ns()
    kill_whole(nodes[1].proc.pid)
    lost = time.monotonic()
    gate.touch()

    assert wait_for(lambda: resumed_and_training(log, before_the_loss), timeout=180, interval=0.2), log.read_text(errors="replace")[
        -4000:
    ]
    again_s = time.monotonic() - lost

    # The node back, once the two hold at step JOIN_AT: only the stop its arrival brings releases them.
    assert wait_for(lambda: all(held_marker(join_gate, rank).exists() for rank in range(2)), timeout=180)
    before_the_join = len(log.read_text(errors="replace"))
    joined_ns = time.time_ns()
    nodes[1] = cluster.start("2:3", 1, env={**env, "RESUME": "auto"}, **overrides)  # joins the run in its folder
    started = time.monotonic()

    assert wait_for(lambda: resumed_and_training(log, before_the_join), timeout=180, interval=0.2), log.read_text(errors="replace")[
        -4000:
    ]
    join_s = time.monotonic() - started
    assert all(nodes[n].wait(timeout=300) == 0 for n in (0, 2, 1)), log.read_text(errors="replace")[-4000:]
    whole = log.read_text(errors="replace")
    text, joined = whole[before_the_loss:before_the_join], whole[before_the_join:]
    print(f"a node lost at step {KILLED_AT}: the others trained again {again_s:.1f} s after the kill")
    print(f"the node back at step {JOIN_AT}: three training {join_s:.1f} s after its launcher's start")

    assert "(elastic: goes on while 2 of up to 3 nodes remain)" in whole
    assert "elastic round of 3 node(s) [0, 1, 2]: node_rank 0 local_rank 0 is global rank 0" in whole
    assert "elastic round of 2 node(s) [0, 2]: node_rank 0 local_rank 0 is global rank 0" in text
    assert "elastic round of 2 node(s) [0, 2]: node_rank 2 local_rank 0 is global rank 1" in cluster.node_log(2)
    assert "global batch 12 = 3 processes x 2 (data.batch_size) x 2 micro-batches per step" in whole
    assert "global batch 12 = 2 processes x 2 (data.batch_size) x 3 micro-batches per step" in text
    # The survivors' failed collective in one line each, no traceback wall
    for survivor in (text, cluster.node_log(2)):
        assert re.search(r"error: a peer process is gone \(Connection (closed|reset) by peer", survivor), survivor[-4000:]
        assert "Traceback" not in survivor, survivor[-4000:]
    resumed = re.search(r"resuming from checkpoint .*step-(\d+)\.ckpt", text)
    assert resumed and int(resumed.group(1)) == SAVED_AT, text[-3000:]
    assert again_s < 90, again_s  # the measured figure is bench's (docs/RELIABILITY.md); this bounds a hang

    # The join: announced, a checkpoint at the step's end, the three resume from it, nothing lost.
    assert "torchrun: 1 node(s) waiting to join" in joined, joined[-4000:]
    assert "elastic round of 3 node(s) [0, 1, 2]: node_rank 0 local_rank 0 is global rank 0" in joined
    assert "elastic round of 3 node(s) [0, 1, 2]: node_rank 1 local_rank 0 is global rank 1" in cluster.node_log(1)
    assert "global batch 12 = 3 processes x 2 (data.batch_size) x 2 micro-batches per step" in joined
    assert "a peer process is gone" not in joined and "Traceback" not in joined, joined[-4000:]
    saved = re.findall(r"checkpoint saved: .*step-(\d+)\.ckpt", joined)
    rejoined = re.search(r"resuming from checkpoint .*step-(\d+)\.ckpt", joined)
    assert saved and rejoined and int(saved[0]) == int(rejoined.group(1)), joined[-4000:]
    joined_at = int(saved[0])
    assert JOIN_AT <= joined_at <= JOIN_AT + 1, joined_at  # held at 14: the stop lands at its end or the next's

    # Nothing trained lost: the two stopped at the step the three resume from, not past it.
    last_on_two = max(
        record["step"]
        for path in records.glob("*.jsonl")
        if killed_ns < int(path.name.split("-", 1)[0]) < joined_ns
        for record, _ in recorded_steps(path)
    )
    assert last_on_two == joined_at, (last_on_two, joined_at)

    steps = steps_trained(records, killed_ns, joined_ns, joined_at)
    assert sorted(steps) == list(range(1, STEPS + 1)), sorted(steps)
    epochs = {step: {batch["epoch"] for batch in batches} for step, batches in steps.items()}
    for step, batches in steps.items():
        samples = sum(len(batch["ids"]) for batch in batches)
        last_of_epoch = step == STEPS or max(epochs[step + 1]) > max(epochs[step])
        assert samples == GLOBAL_BATCH or (last_of_epoch and samples < GLOBAL_BATCH), (step, samples)
    every_id = {json.loads(line)["id"] for line in (cluster.synthetic_dir / "train.jsonl").read_text().splitlines()}
    by_epoch: dict[int, list[str]] = {}
    for batches in steps.values():
        for batch in batches:
            by_epoch.setdefault(batch["epoch"], []).extend(batch["ids"])
    for epoch, taken in sorted(by_epoch.items()):
        twice = sorted(sample for sample, count in Counter(taken).items() if count > 1)
        assert not twice, f"trained twice in epoch {epoch}: {twice}"
        if epoch < max(by_epoch):  # a whole epoch: every sample but the sampler's tail (at most 2 of 128)
            assert len(every_id - set(taken)) <= 2, (epoch, sorted(every_id - set(taken)))

    report = (cluster.run_dir / "report.md").read_text()
    assert report.count("| 3 x 2 x 2 = 12 |") == 2 and "| 2 x 2 x 3 = 12 |" in report, report
