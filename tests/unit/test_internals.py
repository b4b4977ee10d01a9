"""Each coupling to another project's internals (purrsight/internals/, docs/INTERNALS.md), checked
against the installed versions: a test here fails on the upgrade that moves one, not a user's
job far away. The guarded ones are also shown to degrade, not to stop training."""

from __future__ import annotations

import importlib
import inspect
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import pytorch_lightning as pl

from purrsight.internals import ray_logging, torch_c10d, torch_elastic, transformers_keys
from purrsight.internals.lightning_loops import BATCH_PROGRESS, LightningLayoutError, check_layout, set_batches_done
from purrsight.ray_engine.ray_noise import filter_forwarded_output, quiet_checkpoint_reports
from tests.helpers import REPO


def test_lightning_keeps_the_batch_counters_a_resume_sets() -> None:
    """Fails on a Lightning upgrade that moves them: the start would stop with LightningLayoutError."""
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_checkpointing=False)
    check_layout(trainer)
    current = {"ready": 10, "started": 10, "processed": 10, "completed": 9}
    checkpoint = {"loops": {"fit_loop": {"state_dict": {}, BATCH_PROGRESS: {"current": current}}}}
    set_batches_done(checkpoint, 4)
    assert checkpoint["loops"]["fit_loop"][BATCH_PROGRESS]["current"] == {"ready": 4, "started": 4, "processed": 4, "completed": 3}


def test_lightnings_per_micro_batch_sigterm_broadcast_is_where_we_skip_it() -> None:
    """The installed Lightning broadcasts its SIGTERM flag from the epoch loop's advance (what the
    skip replaces; a real 2-rank run counts no broadcast: tests/integration/test_train_ddp.py); a
    Lightning without it has nothing to skip."""
    import inspect

    from pytorch_lightning.loops.training_epoch_loop import _TrainingEpochLoop

    from purrsight.internals import lightning_loops

    assert f"self.{lightning_loops.SIGTERM_BROADCAST}()" in inspect.getsource(_TrainingEpochLoop.advance)
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_checkpointing=False)
    assert lightning_loops.leave_stops_to_the_stop_vote(trainer)
    assert getattr(trainer.fit_loop.epoch_loop, lightning_loops.SIGTERM_BROADCAST) is lightning_loops._no_broadcast
    without = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_checkpointing=False)
    setattr(without.fit_loop.epoch_loop, lightning_loops.SIGTERM_BROADCAST, None)  # as a Lightning without the method
    assert not lightning_loops.leave_stops_to_the_stop_vote(without)


def test_empty_per_batch_hooks_are_skipped_and_overridden_ones_still_run() -> None:
    """A real fit on the installed Lightning: the hooks a callback overrides run at every batch
    (training and validation), those it leaves as pl.Callback's are hidden and Lightning's
    dispatcher passes over them (a dispatcher that called them would raise on None)."""
    from pytorch_lightning.demos.boring_classes import BoringModel

    from purrsight.internals.lightning_loops import PER_BATCH_HOOKS, skip_empty_batch_hooks

    class Counting(pl.Callback):
        def __init__(self) -> None:
            self.calls: dict[str, int] = {}

        def on_train_batch_end(self, *args: object) -> None:
            self.calls["train"] = self.calls.get("train", 0) + 1

        def on_validation_batch_start(self, *args: object) -> None:
            self.calls["validation"] = self.calls.get("validation", 0) + 1

    counting, idle = Counting(), pl.Callback()
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=5,
        limit_val_batches=3,
        val_check_interval=4,
        num_sanity_val_steps=0,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        callbacks=[counting, idle],
    )
    assert skip_empty_batch_hooks([counting, idle]) == 2 * len(PER_BATCH_HOOKS) - 2
    assert counting.on_before_backward is None and idle.on_train_batch_end is None  # type: ignore[comparison-overlap]
    assert callable(counting.on_train_batch_end) and callable(counting.on_validation_batch_start)
    trainer.fit(BoringModel())
    assert counting.calls == {"train": 5, "validation": 3}
    assert skip_empty_batch_hooks([counting]) == 0  # hidden once: a second pass finds nothing left to hide


def test_the_trainers_builder_and_the_saver_hide_the_empty_hooks_of_every_callback_they_add(
    synthetic_dir: Path, tmp_path: Path
) -> None:
    """The wiring: build_trainer hides them for the callbacks it builds, the saver for the
    SaveAtStepEnd it appends at setup (after the build); an overridden hook stays callable."""
    from purrsight.internals.lightning_loops import PER_BATCH_HOOKS
    from purrsight.runs.checkpoint_saver import CheckpointSaver
    from purrsight.training.trainer_builder import build_trainer
    from tests.helpers import tiny_config

    config = tiny_config(synthetic_dir, tmp_path)
    saver = CheckpointSaver(tmp_path / "checkpoints", 5, 2)
    trainer = build_trainer(config, saver)
    saver.setup(trainer, pl.LightningModule(), "fit")
    assert saver.at_step_end in trainer.callbacks  # type: ignore[attr-defined]
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        for hook in PER_BATCH_HOOKS:
            overridden = getattr(type(callback), hook) is not getattr(pl.Callback, hook)
            assert callable(getattr(callback, hook)) == overridden, (type(callback).__name__, hook)
    assert saver.on_train_batch_end is not None and saver.at_step_end.on_before_backward is None  # type: ignore[comparison-overlap]


def test_a_dispatcher_that_would_call_a_hidden_hook_gets_none_hidden(monkeypatch: pytest.MonkeyPatch) -> None:
    """Guarded: a Lightning whose dispatcher calls every hook attribute (no ``callable`` test) would
    raise on None at the first batch, so then every hook stays as it is."""
    from pytorch_lightning.trainer import call

    from purrsight.internals import lightning_loops

    def calls_every_hook(trainer: object, hook_name: str, *args: object, **kwargs: object) -> None:
        for callback in trainer.callbacks:  # type: ignore[attr-defined]
            getattr(callback, hook_name)(trainer, None, *args, **kwargs)

    monkeypatch.setattr(call, "_call_callback_hooks", calls_every_hook)
    lightning_loops._dispatcher_skips_uncallable.cache_clear()
    try:
        idle = pl.Callback()
        assert lightning_loops.skip_empty_batch_hooks([idle]) == 0 and callable(idle.on_train_batch_end)
    finally:
        lightning_loops._dispatcher_skips_uncallable.cache_clear()  # the installed dispatcher's answer again


def test_a_sigterm_lightnings_handler_noted_before_training_is_taken_over_once() -> None:
    """Lightning's handler notes a SIGTERM on its signal connector (what the take-over reads and
    clears); the checkpoint saver then requests the stop the stop vote agrees on
    (runs/checkpoint_saver.py, on_train_start)."""
    import inspect

    from pytorch_lightning.trainer.connectors.signal_connector import _SignalConnector

    from purrsight.internals import lightning_loops

    assert "self.received_sigterm = True" in inspect.getsource(_SignalConnector._sigterm_notifier_fn)
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_checkpointing=False)
    assert not lightning_loops.take_over_a_noted_sigterm(trainer)
    getattr(trainer, lightning_loops.SIGNAL_CONNECTOR).received_sigterm = True  # as the handler leaves it
    assert trainer.received_sigterm
    assert lightning_loops.take_over_a_noted_sigterm(trainer)
    assert not trainer.received_sigterm  # Lightning's own checks no longer end this rank alone
    assert not lightning_loops.take_over_a_noted_sigterm(trainer)


def test_a_checkpoint_without_the_counters_is_one_clear_error() -> None:
    with pytest.raises(LightningLayoutError, match=r"pytorch_lightning .* keeps no fit-loop batch counters at .*install"):
        set_batches_done({"loops": {"fit_loop": {}}}, 3)


def test_torchelastic_installs_the_handler_by_the_name_we_replace(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent
    from torch.distributed.elastic.multiprocessing import api

    assert torch_elastic.HANDLER_NAME in inspect.getsource(api.PContext.start)  # looked up by name at each start
    monkeypatch.setattr(api, torch_elastic.HANDLER_NAME, getattr(api, torch_elastic.HANDLER_NAME))

    def ours(signum: int, frame: object) -> None: ...

    assert torch_elastic.install_terminate_handler(ours) and getattr(api, torch_elastic.HANDLER_NAME) is ours
    # the rendezvous line reads the metric torchelastic's @prof names after this method
    assert "@prof\n    def _rendezvous" in inspect.getsource(SimpleElasticAgent)
    assert f".{SimpleElasticAgent._rendezvous.__name__}.duration.ms" == torch_elastic.RENDEZVOUS_METRIC


def test_a_moved_terminate_handler_is_one_line_not_a_failure(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from torch.distributed.elastic.multiprocessing import api

    monkeypatch.delattr(api, torch_elastic.HANDLER_NAME)
    assert not torch_elastic.install_terminate_handler(lambda signum, frame: None)
    assert capsys.readouterr().err.count("\n") == 1 and not hasattr(api, torch_elastic.HANDLER_NAME)


def test_torchrun_names_the_run_path_entry_where_we_replace_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed import run

    monkeypatch.setattr(run, torch_elastic.WORKER_ENTRY_NAME, getattr(run, torch_elastic.WORKER_ENTRY_NAME))

    def ours(script: str, *args: str) -> None: ...

    assert torch_elastic.install_worker_entry(ours)
    parsed = run.parse_args(["--run-path", "--nproc-per-node", "1", "/abs/script.py", "a"])
    _, entry, entry_args = run.config_from_args(parsed)
    assert entry is ours and entry_args == ["/abs/script.py", "a"]  # looked up in its module at each call


def test_a_moved_worker_entry_is_one_line_and_subprocess_workers(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from torch.distributed import run

    monkeypatch.delattr(run, torch_elastic.WORKER_ENTRY_NAME)
    assert not torch_elastic.install_worker_entry(lambda script: None)
    assert "starting the workers as subprocesses" in capsys.readouterr().err


def test_the_agent_polls_for_waiting_nodes_by_the_name_we_wrap(monkeypatch: pytest.MonkeyPatch) -> None:
    """A lost store reads as no node waiting; a count above 0 is handed on; any other failure of the poll still raises."""
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    handler_class = dynamic_rendezvous.DynamicRendezvousHandler
    assert f"rdzv_handler.{torch_elastic.WAITING_POLL_NAME}()" in inspect.getsource(SimpleElasticAgent._invoke_run)
    answers: list[int | Exception] = [RendezvousConnectionError("store gone"), 0, 2, RuntimeError("a bug")]

    def poll(handler: object) -> int:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(handler_class, torch_elastic.WAITING_POLL_NAME, poll)
    lost: list[Exception] = []
    waiting: list[int] = []
    assert torch_elastic.watch_waiting_nodes(lost.append, waiting.append)
    assert torch_elastic.watch_waiting_nodes(lost.append, waiting.append)  # a second main() in one process wraps once
    wrapped = getattr(handler_class, torch_elastic.WAITING_POLL_NAME)

    class Handler:
        heartbeats = True

        def _stop_heartbeats(self) -> None:
            self.heartbeats = False

    assert torch_elastic.HEARTBEAT_STOP_NAME in vars(handler_class)
    handler, other = Handler(), Handler()
    assert [wrapped(handler), wrapped(handler), wrapped(other), wrapped(other)] == [0, 0, 0, 2]
    assert not handler.heartbeats and other.heartbeats  # stopped once the store was found gone
    assert [str(err) for err in lost] == ["store gone"] and waiting == [2]  # the lost handler is not polled again
    with pytest.raises(RuntimeError, match="a bug"):
        wrapped(object())


def test_the_running_round_is_handed_on_after_each_poll(monkeypatch: pytest.MonkeyPatch) -> None:
    """A node waiting to join included: the nodes restarting for it stay present (the wait list)."""
    from types import SimpleNamespace

    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    handler_class = dynamic_rendezvous.DynamicRendezvousHandler
    answers = [0, 1]
    monkeypatch.setattr(handler_class, torch_elastic.WAITING_POLL_NAME, lambda handler: answers.pop(0))
    rounds: list[torch_elastic.RoundView] = []
    assert torch_elastic.watch_waiting_nodes(lambda err: None, lambda count: None, rounds.append)
    state = SimpleNamespace(
        participants={"a_1_0": 0}, wait_list={"b_2_0"}, redundancy_list=set(), complete=True, closed=False, round=3
    )
    handler = SimpleNamespace(**{torch_elastic.STATE_HOLDER_NAME: SimpleNamespace(state=state)})
    polled = [getattr(handler_class, torch_elastic.WAITING_POLL_NAME)(handler) for _ in range(2)]
    assert polled == [0, 1]
    assert [(view.round, view.present) for view in rounds] == [(3, frozenset({"'a_1_0'", "'b_2_0'"}))] * 2, rounds
    assert not rounds[0].ending()  # no store to read: not ending


def test_a_moved_waiting_poll_is_one_line_and_the_old_behaviour(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    monkeypatch.delattr(dynamic_rendezvous.DynamicRendezvousHandler, torch_elastic.WAITING_POLL_NAME)
    assert not torch_elastic.watch_waiting_nodes(lambda err: None, lambda count: None)
    assert "a lost store ends the agent" in capsys.readouterr().err


def test_the_rendezvous_store_waits_read_timeout_to_connect_then_store_op_timeout_per_operation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The agent's own store, through the function c10d's backend calls: a read of a key nobody
    writes (what a store cut off from this node looks like to the reader) gives up after
    ``store_op_timeout`` (1 s), not ``read_timeout`` (60 s); without the key, read_timeout holds."""
    import time
    from datetime import timedelta

    from torch.distributed.elastic.rendezvous import RendezvousParameters, c10d_rendezvous_backend
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    from tests.helpers import free_port

    assert f"{torch_elastic.STORE_FACTORY_NAME}(params)" in inspect.getsource(c10d_rendezvous_backend.create_backend)
    monkeypatch.setattr(c10d_rendezvous_backend, torch_elastic.STORE_FACTORY_NAME, c10d_rendezvous_backend._create_tcp_store)
    assert torch_elastic.limit_store_operations()
    assert torch_elastic.limit_store_operations()  # a second main() in one process wraps once

    def backend(**conf: object) -> object:
        params = RendezvousParameters("c10d", f"127.0.0.1:{free_port()}", "run", 1, 1, is_host=True, read_timeout=60, **conf)
        return c10d_rendezvous_backend.create_backend(params)

    rendezvous, store = backend(store_op_timeout=1)
    assert store.timeout == timedelta(seconds=1)
    # its connection to the store is closed by the kernel once a request goes unacknowledged 1 s
    assert 1000 in user_timeouts_of_connections_to(store.port)
    start = time.monotonic()
    with pytest.raises(RendezvousConnectionError):
        rendezvous._call_store("get", "never-written")
    assert time.monotonic() - start < 10
    _, unlimited = backend()
    assert unlimited.timeout == timedelta(seconds=60)
    assert set(user_timeouts_of_connections_to(unlimited.port)) == {0}  # the kernel's default: none


def user_timeouts_of_connections_to(port: int) -> list[int]:
    """TCP_USER_TIMEOUT (ms) of each of this process's sockets connected to ``port`` on loopback."""
    import socket

    timeouts = []
    for fd in torch_elastic._socket_fds():  # the same listing the wrapper diffs
        try:
            sock = socket.socket(fileno=fd)
        except OSError:
            continue
        try:
            if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.getpeername()[1] == port:
                timeouts.append(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT))
        except OSError:
            pass
        finally:
            sock.detach()
    return timeouts


def test_a_moved_store_factory_is_one_line_and_read_timeout_per_operation(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend

    monkeypatch.delattr(c10d_rendezvous_backend, torch_elastic.STORE_FACTORY_NAME)
    assert not torch_elastic.limit_store_operations()
    assert "each store operation may take read_timeout" in capsys.readouterr().err


def test_the_running_rounds_participants_are_read_where_torch_keeps_them() -> None:
    """A real one-node rendezvous on a real store: after it, round_participants reads its round and
    this node, as the agent's poll leaves the state; once closed, nothing (the job is ending)."""
    from torch.distributed.elastic.agent.server.api import _TERMINAL_STATE_SYNC_ID as TERMINAL_STATE_SYNC_ID
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
    from torch.distributed.elastic.utils import store as store_util

    from tests.helpers import free_port

    params = RendezvousParameters(
        "c10d", f"127.0.0.1:{free_port()}", "run", 1, 1, is_host=True, local_addr="127.0.0.1", keep_alive_interval=1
    )  # 1 s: its shutdown joins the keep-alive timer

    backend, store = create_backend(params)
    handler = create_handler(store, backend, params)
    assert torch_elastic.round_participants(handler) is None  # no round complete yet
    info = handler.next_rendezvous()
    handler.num_nodes_waiting()  # the agent's poll: a fresh read of the state
    running = torch_elastic.round_participants(handler)
    assert running is not None
    assert running.round == 0 and list(running.participants.values()) == ["127.0.0.1"], running
    assert running.present == frozenset(running.participants), running
    # The agents' exit barrier, entered by this node alone of two: its counter is where we read it.
    assert not running.ending()
    with pytest.raises(Exception, match=r"[Tt]imed? ?out|Timeout"):
        store_util.barrier(info.store, world_size=2, key_prefix=TERMINAL_STATE_SYNC_ID, barrier_timeout=1)
    assert running.ending()
    handler.shutdown()
    assert torch_elastic.round_participants(handler) is None


def test_the_local_agent_checks_its_workers_by_the_name_we_wrap(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each failed check's result is handed on; a healthy one is not; the result itself is returned unchanged."""
    from torch.distributed.elastic.agent.server.api import RunResult, SimpleElasticAgent, WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    assert f"self.{torch_elastic.MONITOR_NAME}(self._worker_group)" in inspect.getsource(SimpleElasticAgent._invoke_run)
    results = [RunResult(state=WorkerState.HEALTHY), RunResult(state=WorkerState.FAILED, failures={})]
    monkeypatch.setattr(LocalElasticAgent, torch_elastic.MONITOR_NAME, lambda agent, group: results.pop(0))
    failed: list[object] = []
    assert torch_elastic.watch_worker_failures(failed.append)
    assert torch_elastic.watch_worker_failures(failed.append)  # wraps once
    check = getattr(LocalElasticAgent, torch_elastic.MONITOR_NAME)
    healthy, failure = check(object(), object()), check(object(), object())
    assert healthy.state == WorkerState.HEALTHY and failed == [failure]


def test_a_moved_worker_check_is_one_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    monkeypatch.delattr(LocalElasticAgent, torch_elastic.MONITOR_NAME)
    assert not torch_elastic.watch_worker_failures(lambda result: None)
    assert "ends with torchrun's 1" in capsys.readouterr().err


def test_pythons_exit_handlers_run_on_request() -> None:
    """What a forked worker runs at its script's end: the handlers registered, once."""
    done = subprocess.run(
        [sys.executable, "-c", "import atexit\nfrom purrsight.internals.python_exit import run_exit_handlers\n"
         "atexit.register(print, 'handler ran')\nrun_exit_handlers()\nprint('after')"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.stdout.splitlines() == ["handler ran", "after"], done.stderr  # run where asked, not again at exit


def test_the_flight_recorder_dumps_on_this_torch() -> None:
    """Read back as PyTorch's analyser reads it: a pickled dict with the recorder's version."""
    import pickle

    trace = torch_c10d.flight_recorder_trace()
    assert trace is not None and "version" in pickle.loads(trace)


def test_rays_internals_are_where_we_read_them() -> None:
    loggers = ray_logging.train_report_loggers()
    assert loggers is not None and loggers[1].name == "ray.train.v2._internal.execution.storage"
    assert loggers[0].name.endswith("context.py")  # Ray names this logger by its file's path
    assert ray_logging.stdstream_dispatcher() is not None
    for name in ray_logging.RUNTIME_ENV_LOGGERS:
        importlib.import_module(name)  # a logger named after a module that no longer exists filters nothing


def test_rays_moved_internals_leave_the_lines_and_training_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("ray.train.v2._internal.execution.context", "ray._private.ray_logging"):
        monkeypatch.setitem(sys.modules, name, None)  # import fails as if the module had moved
    storage = logging.getLogger("ray.train.v2._internal.execution.storage")
    filters = list(storage.filters)
    quiet_checkpoint_reports()  # no exception: the worker goes on training
    assert storage.filters == filters  # and filters nothing
    assert ray_logging.train_report_loggers() is None and not filter_forwarded_output()


def _tiny_causal_lm(config_class: str, **extra: object) -> object:
    import transformers
    from transformers import AutoModelForCausalLM

    shape = {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
    return AutoModelForCausalLM.from_config(getattr(transformers, config_class)(num_key_value_heads=1, **shape, **extra))


def test_transformers_names_weight_file_keys_as_it_loads_them() -> None:
    """EXAONE's files rename (a plain rename: read by rows as it lies); Mixtral's per-expert
    tensors are merged into one (a converter: not readable by rows)."""
    exaone = _tiny_causal_lm("ExaoneConfig", eos_token_id=1)
    names = [name for name, _ in exaone.named_parameters()]  # type: ignore[attr-defined]
    keys = ["transformer.h.0.attn.attention.out_proj.weight", "lm_head.weight"]
    assert transformers_keys.loaded_names(exaone, keys, names) == {
        "transformer.h.0.attn.attention.out_proj.weight": ("model.layers.0.self_attn.o_proj.weight", False),
        "lm_head.weight": ("lm_head.weight", False),
    }
    mixtral = _tiny_causal_lm("MixtralConfig", num_local_experts=2)
    names = [name for name, _ in mixtral.named_parameters()]  # type: ignore[attr-defined]
    key = "model.layers.0.block_sparse_moe.experts.0.w1.weight"
    assert transformers_keys.loaded_names(mixtral, [key], names) == {key: ("model.layers.0.mlp.experts.gate_up_proj", True)}


def test_a_moved_key_conversion_reads_keys_as_names_with_one_line(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    exaone = _tiny_causal_lm("ExaoneConfig", eos_token_id=1)
    monkeypatch.setitem(sys.modules, "transformers.conversion_mapping", None)  # import fails as if it had moved
    key = "transformer.h.0.attn.attention.out_proj.weight"
    with caplog.at_level(logging.WARNING):
        assert transformers_keys.loaded_names(exaone, [key], []) == {key: (key, False)}
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == ["transformers' weight-key conversion not found"]


def test_a_stop_iteration_from_a_validation_batch_hook_ends_the_pass_and_runs_its_end_hooks() -> None:
    """end_validation_now relies on Lightning's evaluation loop ending its pass on StopIteration
    from a batch's hooks and then calling its epoch-end and end hooks as after the last batch."""
    import torch
    from torch.utils.data import DataLoader

    from purrsight.internals.lightning_loops import end_validation_now

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(1))
            self.validated: list[int] = []
            self.ended = False

        def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
            self.validated.append(batch_idx)

        def on_validation_batch_end(self, outputs: object, batch: object, batch_idx: int, dataloader_idx: int = 0) -> None:
            if batch_idx == 2:
                end_validation_now()

        def on_validation_end(self) -> None:
            self.ended = True

    module = Tiny()
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_checkpointing=False)
    trainer.validate(module, DataLoader(torch.arange(10.0)), verbose=False)
    assert module.validated == [0, 1, 2] and module.ended


def test_the_fork_server_runs_its_preload_and_its_children_under_the_names_we_read(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The preload's own import (the servers hold signals then) against a fork's: both named here,
    and a Python without them keeps every server's default signals, with one line."""
    import multiprocessing.forkserver

    from purrsight.internals import python_forkserver

    assert callable(multiprocessing.forkserver.main) and callable(multiprocessing.forkserver._serve_one)
    assert "preload" in inspect.getsource(multiprocessing.forkserver.main)
    assert not python_forkserver.in_preload()  # a test is no fork server's preload
    monkeypatch.delattr(multiprocessing.forkserver, "_serve_one")
    assert not python_forkserver.in_preload()
    assert "fork servers keep the default signals" in capsys.readouterr().err


def test_a_fork_servers_children_skip_the_parents_main_where_multiprocessing_names_its_fix_ups(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The two fix-ups spawn.prepare calls to run the parent's __main__ again are the ones replaced
    (a real worker: tests/unit/test_loader_workers.py); a Python without them keeps them, with one line."""
    import multiprocessing.spawn

    from purrsight.internals import python_forkserver

    source = inspect.getsource(multiprocessing.spawn.prepare)
    assert all(f"{name}(" in source for name in python_forkserver.MAIN_FIXUPS), source
    for name in python_forkserver.MAIN_FIXUPS:
        monkeypatch.setattr(multiprocessing.spawn, name, getattr(multiprocessing.spawn, name))  # restored after
    assert python_forkserver.skip_main_in_children()
    assert all(getattr(multiprocessing.spawn, name) is python_forkserver._keep_this_main for name in python_forkserver.MAIN_FIXUPS)
    monkeypatch.delattr(multiprocessing.spawn, "_fixup_main_from_name")
    assert not python_forkserver.skip_main_in_children()
    assert "run the parent's __main__ again" in capsys.readouterr().err
