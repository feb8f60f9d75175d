"""Start a parameter-server job (scheduler, servers, workers), forward its output, keep it whole.

    python -m manual_dp.launch --workers 2 --servers 1 -- \
        python -m manual_dp.train --backend dist_sync --cpus 1

Every process runs COMMAND with the DMLC_* environment of its role: MXNet turns a server or the
scheduler into its server loop as soon as COMMAND imports mxnet. Output lines get a prefix such
as "[worker 1]". When a process fails, or a server or the scheduler ends before the workers, the
launcher stops all the others and exits non-zero (or, with --max-restarts, starts the job again
on the workers that remain: manual_dp.multiprocess.elastic, which runs the jobs); when every
worker succeeds it exits 0. Workers get $MANUAL_DP_WORKER ("worker 1") and the address of the
progress board (manual_dp.multiprocess.board), to which they report the collectives they enter.
With --hosts FILE (one host per line) servers and workers go round-robin over the hosts via ssh
(keys, no password), the scheduler runs here.

Start-up deadline: a process run here has started once it runs. A process on a host has started
when its remote shell, after ssh has connected, logged in and entered this directory, prints the
launcher's start marker (a line of its own, not forwarded) just before running COMMAND; ssh gets
`-o ConnectTimeout` of the same length. A remote process that has not started within
--start-timeout seconds stops the job, with one line naming its host, since no trainer there
would ever reach its own --timeout. --port is checked free here (where the scheduler runs)
before anything starts.
"""
import argparse
import errno
import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from ..errors import PEER_LOST, UsageError
from ..fast.runtime import environment_problem

LOOPBACK = "127.0.0.1"
STARTED = "manual_dp.launch: remote command started"  # a remote shell's first own line
MIN_SECONDS = 0.5     # --grace, --start-timeout: below it a finished job's servers race its workers' end


class Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(message)


def build_parser():
    p = Parser(prog="python -m manual_dp.launch", usage="%(prog)s [options] -- COMMAND...",
               description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--workers", type=int, default=2, help="worker processes (DMLC_NUM_WORKER)")
    p.add_argument("--servers", type=int, default=1, help="server processes (DMLC_NUM_SERVER)")
    p.add_argument("--hosts", help="file with one host (address) per line; default: all on loopback")
    p.add_argument("--scheduler-host", help="this machine's address as the hosts reach it "
                   "(default: 127.0.0.1 without --hosts, else the address of the route to the first host)")
    p.add_argument("--port", type=int, help="scheduler port (DMLC_PS_ROOT_PORT; default: a free one)")
    p.add_argument("--ssh", default="ssh", help="ssh client used for --hosts")
    p.add_argument("--grace", type=seconds, default=10.0,
                   help="seconds servers and scheduler get to end after the last worker")
    p.add_argument("--start-timeout", type=seconds, default=60.0,
                   help="seconds a process on a host gets to start (ssh connect and login)")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="times a failed job restarts on the workers that remain, from the last "
                        "checkpoint (manual_dp.multiprocess.elastic)")
    return p


def seconds(text):
    """A positive, finite float of seconds, or argparse's one-line refusal. (A --grace of 0
    would leave no time between the last worker's end and the servers' and scheduler's, which
    end at about the same moment, so a finished job would fail by chance; infinity would wait
    for ever on a lost part; a --start-timeout of 0 would fail every remote start.)"""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not (math.isfinite(value) and value >= MIN_SECONDS):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds, at least {MIN_SECONDS}, got {text}")
    return value


def parse(argv):
    """(options, COMMAND) from `[options] -- COMMAND...`."""
    if "--" not in argv:
        build_parser().parse_args(argv)     # --help prints the options and exits 0; bad options their line
        raise UsageError("give the command after --, e.g. -- python -m manual_dp.train --backend dist_sync")
    cut = argv.index("--")
    args, command = build_parser().parse_args(argv[:cut]), argv[cut + 1:]
    if not command:
        raise UsageError("no command after --")
    for name in ("workers", "servers"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.max_restarts < 0:
        raise UsageError(f"--max-restarts must be at least 0, got {args.max_restarts}")
    if args.port is not None and not 0 < args.port < 65536:
        raise UsageError(f"--port must be in 1..65535, got {args.port}")
    try:
        if not shlex.split(args.ssh):
            raise ValueError("it names no program")
    except ValueError as e:
        raise UsageError(f"--ssh {args.ssh!r} is not a command line: {e}") from None
    problem = environment_problem()          # the job's processes inherit the environment and load MXNet
    if problem:
        raise UsageError(problem)
    return args, command


def read_hosts(path):
    try:
        lines = Path(path).read_bytes().decode("utf-8-sig").splitlines()    # -sig: a byte-order mark is no host
    except OSError as e:
        raise UsageError(f"--hosts {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise UsageError(f"--hosts {path} is not UTF-8 text (byte 0x{e.object[e.start]:02x} "
                         f"at offset {e.start})") from None
    hosts = [ln.split("#")[0].strip() for ln in lines]
    hosts = [h for h in hosts if h]
    for h in hosts:
        if len(h.split()) > 1:
            raise UsageError(f"--hosts {path}: a line names one host, not {h!r} (for two workers on a host, "
                             f"list it twice; 'slots=' is MPI's syntax)")
    if not hosts:
        raise UsageError(f"--hosts {path} names no host")
    return hosts


def free_port(host=""):
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_port_free(host, port):
    """Returns once `port` binds on `host` (or on every address, if `host` is not one of this
    machine's) as the scheduler will bind it; UsageError if another program holds it."""
    for address in (host, ""):
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZeroMQ does
            try:
                return s.bind((address, port))
            except (socket.gaierror, OSError) as e:
                if isinstance(e, socket.gaierror) or e.errno == errno.EADDRNOTAVAIL:
                    continue
                raise UsageError(f"--port {port} cannot be used on {address or 'this machine'}: "
                                 f"{e.strerror}") from None


def route_address(host):
    """This machine's address on the route to `host` (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return s.getsockname()[0]


def plan(args, workers=None, extra=None):
    """[(name, host or None for here, role environment)] for scheduler, servers and the workers
    numbered `workers` (default: all of --workers), with `extra` in every environment."""
    hosts = read_hosts(args.hosts) if args.hosts else None
    root = args.scheduler_host or (route_address(hosts[0]) if hosts else LOOPBACK)
    workers = range(args.workers) if workers is None else workers
    common = {"DMLC_PS_ROOT_URI": root, "DMLC_PS_ROOT_PORT": str(args.port or free_port(LOOPBACK if not hosts else "")),
              "DMLC_NUM_SERVER": str(args.servers), "DMLC_NUM_WORKER": str(len(workers)),
              "PYTHONUNBUFFERED": "1", **(extra or {})}
    procs = [("scheduler", None, dict(common, DMLC_ROLE="scheduler", DMLC_NODE_HOST=root))]
    for i in range(args.servers):
        host = hosts[i % len(hosts)] if hosts else None
        procs.append((f"server {i}", host, dict(common, DMLC_ROLE="server", DMLC_NODE_HOST=host or LOOPBACK)))
    for i in workers:
        host = hosts[i % len(hosts)] if hosts else None
        local_rank = i // len(hosts) if hosts else i
        procs.append((f"worker {i}", host, dict(common, DMLC_ROLE="worker", DMLC_NODE_HOST=host or LOOPBACK,
                                                MANUAL_DP_LOCAL_RANK=str(local_rank),
                                                MANUAL_DP_WORKER=f"worker {i}")))
    return procs


def argv_for(command, host, env, ssh, start_timeout=60.0):
    """The local argv that runs `command` with `env` here, or on `host` through ssh (printing
    STARTED first there)."""
    if host is None:
        return command
    assignments = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    remote = (f"cd {shlex.quote(os.getcwd())} && echo {shlex.quote(STARTED)} && "
              f"env {assignments} {shlex.join(command)}")
    # -tt: a terminal on the far side, so that ending ssh here hangs up the remote process too.
    return [*shlex.split(ssh), "-o", "BatchMode=yes", "-o", f"ConnectTimeout={math.ceil(start_timeout)}",
            "-tt", host, remote]


def forward(name, stream, lock, started):
    """Every line of `stream` written out with its prefix, except the first STARTED line, which
    sets `started` instead; returns at the end of the stream."""
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace").rstrip("\r\n")
        if line == STARTED and not started.is_set():
            started.set()
            continue
        with lock:
            sys.stdout.write(f"[{name}] {line}\n")
            sys.stdout.flush()
    stream.close()


def describe(code):
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with status {code}"


class Job:
    """The started processes, each in its own process group, and their output readers."""

    def __init__(self, start_timeout=60.0):
        self.procs, self.readers, self.lock = [], [], threading.Lock()
        self.start_timeout, self.pending, self.started_at = start_timeout, [], None
        self.failed = self.status = None              # the label of the part that failed the job, its status

    def start(self, procs, command, ssh):
        """Every process of `procs` runs, its output forwarded; remote ones wait in `pending`."""
        self.started_at = time.monotonic()
        for name, host, env in procs:
            p = subprocess.Popen(argv_for(command, host, env, ssh, self.start_timeout),
                                 env=dict(os.environ, **env), stdin=subprocess.DEVNULL,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
            label, started = (name if host is None else f"{name} on {host}"), threading.Event()
            self.procs.append((label, p))
            if host is None:
                started.set()
            else:
                self.pending.append((label, p, started))
            reader = threading.Thread(target=forward, args=(name, p.stdout, self.lock, started), daemon=True)
            reader.start()
            self.readers.append(reader)

    def late(self):
        """A remote process still running but not started after start_timeout s, else None."""
        if time.monotonic() - self.started_at <= self.start_timeout:
            return None
        return next((label for label, p, started in self.pending
                     if not started.is_set() and p.poll() is None), None)

    def failure(self, done_at):
        """(label, Popen status) of a part that has failed, else None: a worker's non-zero exit, a
        server's or the scheduler's before the workers are done. A worker that lost a peer
        (PEER_LOST) is named only if no other part failed too: that part's failure is the cause."""
        failed = [(name, code) for name, p in self.procs for code in [p.poll()]
                  if code not in (None, 0) and (name.startswith("worker") or done_at is None)]
        return min(failed, key=lambda f: f[1] == PEER_LOST, default=None)

    def supervise(self, grace):
        """Wait until every worker has ended; returns (exit status, what went wrong or None).

        A server or the scheduler may end cleanly while the last workers finalise; if the
        workers have not all ended `grace` seconds after that, the job has lost a part. A
        remote process not started after start_timeout s fails the job. Afterwards self.failed
        names the part that failed, self.status holds its Popen status (None: it did not start,
        or ended early).
        """
        workers = [p for name, p in self.procs if name.startswith("worker")]
        done_at = early = None
        while True:
            failed = self.failure(done_at)
            if failed:
                self.failed, self.status = failed
                return (self.status if self.status > 0 else 1), f"{self.failed} {describe(self.status)}"
            if done_at is None and early is None:
                early = next(((name, time.monotonic()) for name, p in self.procs
                              if p.poll() == 0 and not name.startswith("worker")), None)
            late = self.late()
            if late:
                self.failed = late
                return 1, f"{late} did not start within --start-timeout {self.start_timeout:g} s"
            if done_at is None and all(p.poll() == 0 for p in workers):
                done_at = time.monotonic()
            if done_at is None and early and time.monotonic() - early[1] > grace:
                self.failed = early[0]
                return 1, f"{early[0]} ended while workers still ran"
            if done_at is not None and (all(p.poll() is not None for _, p in self.procs)
                                        or time.monotonic() - done_at > grace):
                return 0, None  # servers that linger after a finished job are stopped
            time.sleep(0.05)

    def stop(self, wait=3.0):
        """SIGTERM every process group that is still there, SIGKILL what remains after `wait` s."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for _, p in self.procs:
                if p.poll() is None:
                    for s in (sig, signal.SIGCONT):  # SIGCONT: a stopped process takes its SIGTERM
                        try:
                            os.killpg(p.pid, s)
                        except ProcessLookupError:
                            pass
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and any(p.poll() is None for _, p in self.procs):
                time.sleep(0.05)
        for r in self.readers:
            r.join(timeout=1)
