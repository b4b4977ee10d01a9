"""torchelastic's internals the launcher's torchrun wrapper relies on (written against torch 2.13).

- ``_terminate_process_handler``: the module-level name ``PContext.start()`` looks up when it
  installs each agent's SIGTERM/SIGINT handler. Replacing it is the one way to make the agent
  stop once per job (purrsight/launcher/torchrun.py says why). Where it has moved,
  ``install_terminate_handler`` says so in one line and torchrun keeps its own handler: the job
  still stops, a second signal may cut the workers' close short.
- ``RENDEZVOUS_METRIC``, ``RENDEZVOUS_FAILURE_METRIC``: the names torchelastic's ``@prof`` gives
  the timing of ``SimpleElasticAgent._rendezvous`` and its failure. Where they have changed, the
  rendezvous lines are simply absent (or a failed round reads as done).
- ``run_script_path``: the function ``torch.distributed.run.config_from_args`` names as the
  workers' entry point under ``--run-path``, looked up in its module at each call. Replacing it
  runs each worker through ``purrsight.launcher.forked_workers.run_worker`` (its own session and
  signals). Where it has moved, ``install_worker_entry`` says so in one line and the workers are
  started as subprocesses, as without ``--run-path``: slower to start, nothing else differs.
- ``DynamicRendezvousHandler.num_nodes_waiting``: what the agent polls, between its checks of
  its workers, for nodes waiting to join. The store it reads lives in the first node's agent;
  once that node's job has ended, torchelastic raises from the poll and the agent dies with a
  traceback while its own workers are still finishing (the watchdog's 86 became torchrun's 1).
  ``watch_waiting_nodes`` reads a lost store as no node waiting: nothing can join a rendezvous
  whose store is gone, and the agent goes on to collect its workers' own exit codes. It also
  hands on a count above 0: the agent is about to restart its workers for a joining node, which
  torchelastic logs at INFO only. Where the method has moved, one line says so, a lost store ends
  the agent as before, and a join is not announced. On a lost store it also stops the
  handler's heartbeats (``_stop_heartbeats``), and polls that handler no more: each would fail
  and log a warning (the store's client, a C++ stack) every second for as long as the workers
  take to end.
- ``DynamicRendezvousHandler._state_holder.state``: this agent's copy of the shared rendezvous
  state (its round, participants, wait and redundancy lists, ``complete`` and ``closed``), and
  ``_store`` with the exit barrier's counter under each round's prefix, read after each poll by
  ``round_participants``: an elastic job's agents see a node that stopped its keep-alives
  dropped from the running round (purrsight/launcher/lost_nodes.py acts on it). Where it has moved,
  nothing is read, and such a node is noticed only when the workers' collectives time out.
- ``LocalElasticAgent._monitor_workers``: the agent's check of its workers. ``watch_worker_failures``
  hands on each checked group (its workers' pids) and each failed result, so a job whose agent
  then cannot meet again (the store gone with node 0) still ends with its workers' documented
  code. Where it has moved, one line says so and such a job ends with torchrun's 1.
- ``c10d_rendezvous_backend._create_tcp_store``: the agent's connection to the rendezvous store,
  looked up by name in ``create_backend``. Its ``read_timeout`` is both how long the connection
  waits for the first node (a worker node started first waits for it) and how long every store
  operation may take: a node cut off the network held its agent 120 s per keep-alive and per poll
  in a test (900 s each at the launcher's default). ``limit_store_operations`` keeps the wait for
  the connection and then sets the operations' timeout to the rdzv-conf's ``store_op_timeout``.
  That alone is not enough: a ``get`` that times out sends the store a cancel and then waits for
  its answer without a timeout (TCPStore's doWait), which on a cut network lasts until TCP gives
  up on its retransmissions, some 15 min. So the agent's connection to the store also gets
  TCP_USER_TIMEOUT (Linux, RFC 5482): once its sent bytes go unacknowledged that long, the kernel
  closes it, and the call fails at once. A store found gone stays gone for that agent (the client
  does not reconnect). Where the function has moved, one line says so and each operation waits
  ``read_timeout``.
"""

from __future__ import annotations

import os
import socket
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from types import FrameType, ModuleType
from typing import Any

RENDEZVOUS_METRIC = "._rendezvous.duration.ms"
RENDEZVOUS_FAILURE_METRIC = "._rendezvous.failure"  # @prof's, emitted before the duration of a round that raised
HANDLER_NAME = "_terminate_process_handler"
WORKER_ENTRY_NAME = "run_script_path"
WAITING_POLL_NAME = "num_nodes_waiting"
HEARTBEAT_STOP_NAME = "_stop_heartbeats"
MONITOR_NAME = "_monitor_workers"
STATE_HOLDER_NAME = "_state_holder"  # DynamicRendezvousHandler's copy of the shared rendezvous state
STORE_NAME = "_store"  # DynamicRendezvousHandler's store; each round's keys under torch.rendezvous.<run_id>.<round>/
# the counter SimpleElasticAgent._exit_barrier adds to (store_util.barrier, key_prefix + "/num_members")
EXIT_BARRIER_MEMBERS_KEY = "torchelastic/agent/terminal_state/num_members"
STORE_FACTORY_NAME = "_create_tcp_store"
STORE_OP_TIMEOUT_KEY = "store_op_timeout"  # ours, in --rdzv-conf: torchelastic ignores keys it does not read

Handler = Callable[[int, FrameType | None], None]


def install_terminate_handler(handler: Handler) -> bool:
    """Make ``handler`` the one torchelastic installs in its agent; False (and one line) where it cannot."""
    from torch.distributed.elastic.multiprocessing import api

    found = callable(getattr(api, HANDLER_NAME, None))
    return _replace(api, HANDLER_NAME, handler, found, "a second stop signal may cut the workers' close short")


def install_worker_entry(entry: Callable[..., None]) -> bool:
    """Make ``entry`` the function torchrun runs each worker through under ``--run-path``; False
    (and one line) where torch.distributed.run no longer names one."""
    from torch.distributed import run

    found = callable(getattr(run, WORKER_ENTRY_NAME, None)) and WORKER_ENTRY_NAME in _source_of(run.config_from_args)
    return _replace(run, WORKER_ENTRY_NAME, entry, found, "starting the workers as subprocesses", " for --run-path")


def watch_waiting_nodes(
    on_lost: Callable[[Exception], None],
    on_waiting: Callable[[int], None],
    on_round: Callable[[RoundView], None] | None = None,
) -> bool:
    """Make the agent's poll for waiting nodes call ``on_waiting`` with a count above 0, ``on_lost``
    (answering 0) where the rendezvous store cannot be reached, and ``on_round`` with the running
    round after each poll (``round_participants``); False (and one line)
    where torchelastic no longer has that poll."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    lost: weakref.WeakSet[Any] = weakref.WeakSet()  # handlers whose store is gone: not polled again

    def watched(poll: Callable[[Any], int]) -> Callable[[Any], int]:
        def num_nodes_waiting(handler: Any) -> int:
            if handler in lost:
                return 0  # each poll would fail, and the store's client log a C++ stack, every second
            try:
                waiting = int(poll(handler))
            except RendezvousConnectionError as err:
                lost.add(handler)
                stop_heartbeats = getattr(handler, HEARTBEAT_STOP_NAME, None)
                if callable(stop_heartbeats):
                    stop_heartbeats()  # each would fail and warn, every keep-alive interval
                on_lost(err)
                return 0
            if waiting > 0:
                on_waiting(waiting)
            if on_round is not None and (running := round_participants(handler)) is not None:
                on_round(running)
            return waiting

        return num_nodes_waiting

    handler_class = dynamic_rendezvous.DynamicRendezvousHandler
    return _wrap_method(handler_class, WAITING_POLL_NAME, watched, "a lost store ends the agent")


@dataclass(frozen=True)
class RoundView:
    """The running round as this agent's last read of the shared rendezvous state holds it."""

    round: int
    participants: dict[str, str]  # node id -> its address
    present: frozenset[str]  # the nodes still keeping alive: participants, or waiting for the next round
    ending: Callable[[], bool]  # whether a node has entered the round's exit barrier (a store read)


def round_participants(handler: Any) -> RoundView | None:
    """The running round, or None while no round is complete, once the rendezvous is closed (the
    job ending), or where the state is not where torch 2.13 keeps it. A node that sent no keep-alive
    for ``keep_alive_interval`` x ``keep_alive_max_attempt`` is dropped from every list by the next
    agent's read (``_sanitize``); a node restarting its workers leaves the participants for the wait
    list (or the redundancy list) on its way to the next round, so it stays present (but for the
    moment between its two writes)."""
    state = getattr(getattr(handler, STATE_HOLDER_NAME, None), "state", None)
    participants = getattr(state, "participants", None)
    if not isinstance(participants, dict) or not getattr(state, "complete", False) or getattr(state, "closed", True):
        return None
    # Copies first, each one C call: the keep-alive thread's sync may drop a node from them meanwhile.
    members = list(participants)
    present = {*members, *list(getattr(state, "wait_list", ())), *list(getattr(state, "redundancy_list", ()))}
    round_ = int(getattr(state, "round", -1))
    return RoundView(
        round=round_,
        participants={repr(node): str(getattr(node, "addr", node)) for node in members},
        present=frozenset(repr(node) for node in present),
        ending=lambda: exit_barrier_entered(handler, round_),
    )


def exit_barrier_entered(handler: Any, round_: int) -> bool:
    """Whether a node of round ``round_`` has entered the agents' exit barrier (its workers all
    finished): its keep-alives then stop, the barrier's wait holding the store's one client, and
    the others' reads drop it though it is only waiting for them. False where unreadable."""
    store = getattr(handler, STORE_NAME, None)
    run_id = getattr(getattr(handler, "settings", None), "run_id", None)
    if store is None or run_id is None:
        return False
    try:
        return bool(store.check([f"torch.rendezvous.{run_id}.{round_}/{EXIT_BARRIER_MEMBERS_KEY}"]))
    except Exception:  # the store gone: the poll's own error path says so
        return False


def watch_worker_failures(on_failed: Callable[[Any], None], on_checked: Callable[[Any], None] | None = None) -> bool:
    """Make the agent's check of its workers hand each failed ``RunResult`` to ``on_failed``, and
    each checked ``WorkerGroup`` to ``on_checked``; False (and one line) where torchelastic's local
    agent no longer has that check."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    def watched(check: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
        def monitor_workers(agent: Any, worker_group: Any) -> Any:
            if on_checked is not None:
                on_checked(worker_group)
            result = check(agent, worker_group)
            if result.is_failed():
                on_failed(result)
            return result

        return monitor_workers

    otherwise = "a job whose rendezvous fails after its workers did ends with torchrun's 1"
    return _wrap_method(LocalElasticAgent, MONITOR_NAME, watched, otherwise)


def limit_store_operations() -> bool:
    """Make each operation on the rendezvous store time out after the rdzv-conf's
    ``store_op_timeout`` seconds (where given), once connected; False (and one line) where
    torchelastic's c10d backend no longer creates its store through that function."""
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend as backend

    create = getattr(backend, STORE_FACTORY_NAME, None)
    if getattr(create, "watched", False):
        return True
    found = callable(create) and STORE_FACTORY_NAME in _source_of(backend.create_backend)

    def create_limited(params: Any) -> Any:
        sockets_before = _socket_fds()
        store = create(params)  # type: ignore[misc]  # found: callable
        seconds = params.get_as_int(STORE_OP_TIMEOUT_KEY)
        if seconds:
            store.set_timeout(timedelta(seconds=seconds))
            for fd in _socket_fds() - sockets_before:  # new since: TCPStore does not expose its own
                close_when_unacknowledged(fd, seconds, peer_port=store.port)
        return store

    create_limited.watched = True  # type: ignore[attr-defined]
    otherwise = "each store operation may take read_timeout (RDZV_TIMEOUT) on a node cut off from it"
    return _replace(backend, STORE_FACTORY_NAME, create_limited, found, otherwise)


def _socket_fds() -> set[int]:
    """This process's open sockets (Linux's /proc; none elsewhere)."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return set()
    fds = set()
    for name in names:
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                fds.add(int(name))
        except OSError:  # closed since the listing (the listing's own fd among them)
            continue
    return fds


def close_when_unacknowledged(fd: int, seconds: int, peer_port: int) -> bool:
    """Have the kernel close ``fd``, a TCP connection to ``peer_port`` (the store's client, not the
    server node 0's agent also holds), once bytes it sent go unacknowledged for ``seconds``
    (TCP_USER_TIMEOUT, Linux); False for any other socket, one closed since it was listed (or its
    number reused), or where the option does not exist."""
    option = getattr(socket, "TCP_USER_TIMEOUT", None)
    if option is None:
        return False
    try:
        sock = socket.socket(fileno=fd)
    except OSError:  # closed since the listing, or no longer a socket
        return False
    try:
        if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
            return False
        if sock.getpeername()[1] != peer_port:
            return False
        sock.setsockopt(socket.IPPROTO_TCP, option, seconds * 1000)
        return True
    except OSError:  # not connected: a listening socket
        return False
    finally:
        sock.detach()  # the fd stays the store's


def _wrap_method(owner: type, name: str, wrap: Callable[[Any], Any], otherwise: str) -> bool:
    """Replace ``owner.name`` by ``wrap(owner.name)``, once per process (a second main() finds it
    wrapped); False and one line saying what the agent does without it where ``owner`` has no
    such method of its own (an abstract base's does not count)."""
    method = vars(owner).get(name)
    if getattr(method, "watched", False):
        return True
    if not callable(method):
        print(f"torchrun: this torch's {owner.__name__} has no {name}; {otherwise}", file=sys.stderr, flush=True)
        return False
    wrapped = wrap(method)
    wrapped.watched = True
    setattr(owner, name, wrapped)
    return True


def _replace(module: ModuleType, name: str, value: object, found: bool, otherwise: str, role: str = "") -> bool:
    """Set ``module.name`` to ``value`` where ``found``; else one line saying what the agent does without it."""
    if not found:
        print(f"torchrun: {module.__name__} has no {name}{role} in this torch; {otherwise}", file=sys.stderr, flush=True)
        return False
    setattr(module, name, value)
    return True


def _source_of(function: Callable[..., object]) -> str:
    import inspect

    try:
        return inspect.getsource(function)
    except (OSError, TypeError):
        return ""
