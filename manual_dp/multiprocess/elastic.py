"""`python -m manual_dp.launch [--max-restarts R] ...`: the launcher's jobs, restarted when one fails.

    python -m manual_dp.launch --workers 3 --max-restarts 1 -- python -m manual_dp.train \
        --backend dist_sync --cpus 1 --checkpoint-dir runs/ck --resume

ps-lite fixes the number of workers when a job starts, so a job that lost a worker cannot go on
as it is. With --max-restarts R, when a part is lost (a worker killed by a signal, or exiting with
PEER_LOST, 4, because a collective failed or its watchdog gave up on a hung peer; a server or the
scheduler exiting 1 or ending early; a host not starting; on a host, ssh's 255 or the remote
shell's 128 + signal) the launcher stops every part, says so in one line and starts a new job,
scheduler and servers as before and the workers that remain, running the same COMMAND; at most R
times. The failed worker is left out: the one that failed first, unless the progress board
(manual_dp.multiprocess.board) shows workers that had gone silent, stopped rather than dead, whose
peers then gave up through their watchdogs: those are left out instead. A worker's own error ends
the job at once, since it would fail again: its input (status 1: data, checkpoint, outputs), bad
flags (2), divergence (3) or an interruption.

The trainer must then continue from its checkpoint: --checkpoint-dir DIR --resume (refused
otherwise, before anything starts). Checkpoints hold the full, unsharded state, so they load on
any number of processes, and --batch-size stays the global batch: every rank takes its rows of
the same batches (distributed.rank_rows), so the job on fewer workers computes the same updates,
its sums taken in another order (equal to float rounding; bit for bit with --deterministic).
"""
import signal
import sys

from ..errors import PEER_LOST, UsageError
from .board import ENV, Board
from .launcher import LOOPBACK, Job, check_port_free, parse, plan

SILENT = 2.5              # seconds without a heartbeat after which a worker counts as stopped
INTERRUPTED = (128 + signal.SIGINT, 128 + signal.SIGTERM)   # a trainer's (or shell's) Ctrl-C, SIGTERM


def check_resumes(args, command):
    """UsageError if restarts are asked for but manual_dp.train would not resume after one."""
    trainer = any(a == "manual_dp.train" or a.endswith("manual-dp-train") for a in command)
    has_dir = any(a == "--checkpoint-dir" or a.startswith("--checkpoint-dir=") for a in command)
    if args.max_restarts and trainer and not (has_dir and "--resume" in command):
        raise UsageError(f"--max-restarts {args.max_restarts}: a restarted job must continue from "
                         f"the checkpoint: give manual_dp.train --checkpoint-dir DIR --resume")


def worker_number(label):
    """3 for "worker 3" or "worker 3 on host", else None (a server, the scheduler)."""
    parts = (label or "").split()
    return int(parts[1]) if len(parts) > 1 and parts[0] == "worker" else None


def lost(label, status):
    """True if the part `label` that ended with Popen's `status` (None: it did not start, or
    ended early) was lost, so that a job without it may succeed; False for its own error."""
    if status is None or status < 0 or status == PEER_LOST:
        return True
    if " on " in label and status > 128:
        return status not in INTERRUPTED      # ssh's 255 (connection lost), the remote shell's 128 + signal
    return status == 1 and worker_number(label) is None     # a server or the scheduler failed


class Elastic:
    """The jobs of one launch: the first, and the restarts on the workers that remain."""

    def __init__(self, args, command):
        self.args, self.command, self.job = args, command, None
        self.starting = self.interrupted = False      # a signal while starting waits for the end of it
        self.workers, self.restarts = list(range(args.workers)), 0
        self.board = Board(LOOPBACK if not args.hosts else "0.0.0.0")

    def attempt(self):
        """One job on self.workers to its end; returns (status, reason or None, whether a part was
        lost, workers to leave out)."""
        procs = plan(self.args, self.workers)
        for name, _, env in procs:
            if name.startswith("worker"):
                env[ENV] = f"{env['DMLC_PS_ROOT_URI']}:{self.board.port}"
        self.board.reset()
        self.job = Job(self.args.start_timeout)
        self.starting = True
        try:
            self.job.start(procs, self.command, self.args.ssh)
        finally:
            self.starting = False
        if self.interrupted:
            raise KeyboardInterrupt
        code, reason = self.job.supervise(self.args.grace)
        silent = [worker_number(slot) for slot in self.board.silent(SILENT)]
        failed = worker_number(self.job.failed)
        self.job.stop()
        return code, reason, code != 0 and lost(self.job.failed, self.job.status), [
            w for w in silent if w in self.workers] or ([failed] if failed is not None else [])

    def run(self):
        """Jobs until one succeeds, fails for good or the restarts run out; the launch's status."""
        while True:
            code, reason, restartable, left_out = self.attempt()
            if not restartable or self.restarts == self.args.max_restarts:
                return self.end(code, reason)
            remaining = [w for w in self.workers if w not in left_out]
            if not remaining:
                return self.end(code, f"{reason}; no worker left to restart on")
            self.restarts, self.workers = self.restarts + 1, remaining
            without = f" without {', '.join(f'worker {w}' for w in left_out)}" if left_out else ""
            print(f"manual_dp.launch: {reason}; restart {self.restarts} of {self.args.max_restarts}"
                  f"{without}: {len(remaining)} worker(s) resume from the last checkpoint",
                  file=sys.stderr, flush=True)

    def interrupt(self, signum, frame):
        """SIGTERM, SIGINT, SIGHUP (a closed terminal or ssh session): KeyboardInterrupt, once every
        process being started is in self.job (a process started but not yet recorded would outlive
        the launcher; each runs in a session of its own, so a hang-up reaches none of them)."""
        self.interrupted = True
        if not self.starting:
            raise KeyboardInterrupt

    def end(self, code, reason):
        if reason:
            done = f" after {self.restarts} restart(s)" if self.restarts else ""
            print(f"manual_dp.launch: error: {reason}; stopping the job{done}", file=sys.stderr,
                  flush=True)
        return code

    def stop(self):
        if self.job is not None:
            self.job.stop()
        self.board.close()


def main(argv=None):
    """`python -m manual_dp.launch [options] -- COMMAND...`: the launch's exit status."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        args, command = parse(argv)
        check_resumes(args, command)
        procs = plan(args)
        if args.port is not None:
            check_port_free(procs[0][2]["DMLC_PS_ROOT_URI"], args.port)
    except (UsageError, OSError) as e:
        print(f"manual_dp.launch: error: {e}", file=sys.stderr)
        return 2

    elastic = Elastic(args, command)
    previous = {s: signal.signal(s, elastic.interrupt) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        code = elastic.run()
    except KeyboardInterrupt:
        code = elastic.end(130, "interrupted")
    except OSError as e:
        code = elastic.end(1, f"could not start {command[0]}: {e}")
    elastic.stop()
    for s, handler in previous.items():
        signal.signal(s, handler)
    return code
