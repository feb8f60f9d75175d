"""The job's progress board: who is behind when a collective hangs.

A collective that waits for a stopped peer cannot tell which peer it waits for (ps-lite and Gloo
do not say). The launcher therefore keeps a board, a UDP socket beside the scheduler whose address
its workers find in $MANUAL_DP_BOARD. Every worker sends one datagram, fire and forget, whenever
it enters a collective (rank, its sequence number, the training step, the operation), and a
heartbeat with the same fingerprint from its watchdog thread every BEAT seconds or so. A stopped
or killed process sends nothing more; one that only waits for a peer keeps beating. A watchdog
that gives up asks the board (`Reporter.ask`) and `verdict` names the silent ranks, else the
ranks whose last collective is behind the others'. Under horovodrun, which has no launcher of
ours, rank 0 keeps the board (as $HOROVOD_HOSTNAME, the name horovodrun gave its host); it cannot
then name itself. Best effort: a lost datagram, a firewall or a board that does not answer leaves
the message with this rank's own fingerprint only.
"""
import json
import os
import socket
import threading
import time

ENV = "MANUAL_DP_BOARD"          # host:port of the launcher's board, for workers
SLOT = "MANUAL_DP_WORKER"        # the launcher's name for a worker: "worker 1"


class Board:
    """The launcher's side: the last report of every rank of the current job, and answers."""

    def __init__(self, host):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((host, 0))
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.reports, self.closed = {}, threading.Event()
        threading.Thread(target=self._serve, name="manual_dp-board", daemon=True).start()

    def reset(self):
        """Afterwards the board holds no report (a restarted job's ranks are new)."""
        self.reports = {}

    def _serve(self):
        while not self.closed.is_set():
            try:
                data, peer = self.sock.recvfrom(4096)
            except (socket.timeout, OSError):
                continue
            if data == b"?":
                now = time.monotonic()
                reply = {r: [*rep[:4], now - rep[4]] for r, rep in self.reports.items()}
                self.sock.sendto(json.dumps(reply).encode(), peer)
            else:
                self.take(data.decode(errors="replace"))

    def take(self, text):
        """A report "rank seq step slot|op" recorded with its arrival time; garbage ignored."""
        try:
            rank, seq, step, rest = text.split(" ", 3)
            slot, _, op = rest.partition("|")
            self.reports[int(rank)] = (int(seq), int(step), op, slot, time.monotonic())
        except ValueError:
            pass

    def silent(self, after):
        """The slots (launcher names) of the ranks that have sent nothing for `after` seconds."""
        now = time.monotonic()
        return [rep[3] for rep in list(self.reports.values()) if now - rep[4] > after]

    def close(self):
        self.closed.set()


class Reporter:
    """A worker's side: reports to the board at $MANUAL_DP_BOARD (silently nothing without one)."""

    def __init__(self, address=None, slot=None):
        address = os.environ.get(ENV) if address is None else address
        self.slot = (os.environ.get(SLOT, "") if slot is None else slot).replace("|", " ")
        self.target, self.sock = None, None
        if address:
            host, _, port = address.rpartition(":")
            try:
                self.target = (socket.gethostbyname(host), int(port))   # resolved once
            except (OSError, ValueError):
                return
            self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            self.sock.setblocking(False)

    def report(self, rank, seq, step, op):
        """One datagram with this rank's fingerprint, if there is a board; never blocks or raises."""
        if self.sock is not None:
            try:
                self.sock.sendto(f"{rank} {seq} {step} {self.slot}|{op}".encode(), self.target)
            except OSError:
                pass

    def ask(self, timeout=1.0):
        """{rank: (seq, step, op, slot, seconds since its last report)}, or None if no answer."""
        if self.target is None:
            return None
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.settimeout(timeout)
            try:
                s.sendto(b"?", self.target)
                data = s.recv(1 << 16)
            except OSError:
                return None
        return {int(r): tuple(v) for r, v in json.loads(data).items()}


def bind_address(host):
    """Where a board reachable as `host` listens: loopback if `host` is this machine's loopback,
    else every interface."""
    try:
        return "127.0.0.1" if socket.gethostbyname(host).startswith("127.") else "0.0.0.0"
    except OSError:
        return "0.0.0.0"


def fingerprint(seq, step, op):
    return f"collective #{seq} ({op}, step {step})"


def name(rank, slot):
    return f"rank {rank}" + (f" ({slot})" if slot else "")


def verdict(reports, size, rank, silent_after, unanswered="the board did not answer"):
    """One clause naming who holds the job up, from the board's `reports` (None: `unanswered`
    says why there are none), as rank `rank` sees it."""
    if reports is None:
        return f"{unanswered}: the other ranks' progress is unknown here"
    missing = [r for r in range(size) if r not in reports]
    if missing:
        return f"{', '.join(f'rank {r}' for r in missing)} never reported to the board"
    silent = sorted((r for r, rep in reports.items() if r != rank and rep[4] > silent_after),
                    key=lambda r: -reports[r][4])
    if silent:
        return "; ".join(f"{name(r, reports[r][3])} stopped: silent for {reports[r][4]:.1f} s, last "
                         f"entered {fingerprint(*reports[r][:3])}" for r in silent)
    low, high = min(rep[0] for rep in reports.values()), max(rep[0] for rep in reports.values())
    if low == high:
        return (f"every rank is alive and entered collective #{high}: the hold-up is elsewhere "
                f"(a server, the scheduler or the network)")
    return "; ".join(f"{name(r, rep[3])} is behind: alive, last entered {fingerprint(*rep[:3])}"
                     for r, rep in sorted(reports.items()) if rep[0] == low)
