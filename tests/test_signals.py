"""Issue 25 (faults round three), signals: the memory probe ends with the trainer however that is
stopped (item 2), and SIGTERM and SIGHUP end every long command with one line and its child
processes (item 4). Each case waits, reading /proc, for the state it signals in: a child started,
a handler installed."""
import os
import signal
import subprocess
import sys
import time

import pytest

TINY = ["--train-size", "100", "--test-size", "64", "--batch-size", "32", "--no-progress", "--epochs", "1"]
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; PR_SET_PDEATHSIG is Linux's")


# The memory probe dies with the trainer (item 2) -------------------------------------------------------

def children(pid, text):
    """The process ids of `pid`'s live children whose command line holds `text`."""
    found = []
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = open(f"/proc/{d}/stat").read().rsplit(") ", 1)[1].split()
            if stat[1] == str(pid) and stat[0] != "Z" and text in open(f"/proc/{d}/cmdline").read():
                found.append(int(d))
        except (OSError, IndexError):
            pass
    return found


def running(pid):
    """True while `pid` exists and is not a zombie (an orphan's zombie waits for its reaper)."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(") ", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGKILL], ids=lambda s: s.name)
def test_the_memory_probe_ends_with_the_trainer_however_it_is_stopped(data_dir, sig):
    """--width 16 --memory-per-device: the probe measures for about 11 s; signalled 0.5 s into it,
    the trainer ends and its probe within 2 s (it outlived SIGTERM's and SIGKILL's trainer by 30 s)."""
    proc = subprocess.Popen([sys.executable, "-m", "manual_dp.train", "--data-dir", str(data_dir), "--cpus", "2",
                             "--width", "16", "--memory-per-device", "64GiB", *TINY], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not children(proc.pid, "manual_dp.cli.memprobe") and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        probe, = children(proc.pid, "manual_dp.cli.memprobe")
        time.sleep(0.5)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    deadline = time.monotonic() + 2
    while running(probe) and time.monotonic() < deadline:
        time.sleep(0.05)
    outlived = running(probe)
    if outlived:
        os.kill(probe, signal.SIGKILL)                # no leftover when the test fails
    assert not outlived, f"the probe {probe} outlived the trainer ({sig.name})"
    assert proc.returncode == (-sig if sig == signal.SIGKILL else 130 if sig == signal.SIGINT else 128 + sig), err


def test_an_interrupted_read_of_probes_ends_them():
    """In a process that lives on (a notebook catching Ctrl-C), run_probes kills its probes."""
    from manual_dp.cli import memcheck
    from manual_dp.config import RunConfig
    from manual_dp.modes import resolve
    started = []
    real = memcheck.start_probe
    cfg = resolve(RunConfig(cpus=1, width=16))

    def start(*a, **k):
        started.append(real(*a, **k))
        return started[-1]

    def interrupt(*_):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    memcheck.start_probe = start
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        with pytest.raises(KeyboardInterrupt):
            memcheck.run_probes({"a": (cfg, 1), "b": (cfg, 1)}, "cpu")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        memcheck.start_probe = real
    assert len(started) == 2 and all(p.poll() is not None for p in started)


# SIGTERM and SIGHUP end every long command with one line, its child processes with it (item 4) ------

def caught(pid, sig):
    """True once process `pid` has a handler for `sig` (its SigCgt mask)."""
    try:
        mask = next(l for l in open(f"/proc/{pid}/status") if l.startswith("SigCgt:")).split()[1]
    except (OSError, StopIteration):
        return False
    return bool(int(mask, 16) >> (sig - 1) & 1)


def descendants(pid):
    """The live processes below `pid`."""
    found, parents = [], {pid}
    for _ in range(3):
        for d in filter(str.isdigit, os.listdir("/proc")):
            try:
                stat = open(f"/proc/{d}/stat").read().rsplit(") ", 1)[1].split()
            except OSError:
                continue
            if int(stat[1]) in parents and stat[0] != "Z" and int(d) not in found:
                found.append(int(d))
        parents |= set(found)
    return found


SIGNALLED = [   # (command, signal, children to wait for, exit status, the one line)
    (["manual_dp.plan", "--devices", "2", "--memory-per-device", "1G", "--verify", "--steps", "50"], signal.SIGTERM,
     0, 143, "manual_dp.plan: error: stopped by SIGTERM"),
    (["manual_dp.diverge", "d.jsonl", "d.jsonl", "--replay", "--update", "2"], signal.SIGHUP, 1, 129,
     "manual_dp.diverge: error: stopped by SIGHUP"),
    (["manual_dp.launch", "--workers", "2", "--", sys.executable, "-c", "import time; time.sleep(60)"], signal.SIGHUP,
     4, 130, "manual_dp.launch: error: interrupted; stopping the job"),
]


@pytest.mark.parametrize("command,sig,children,code,line", SIGNALLED,
                         ids=[f"{c[0][0].split('.')[-1]} {c[1].name}" for c in SIGNALLED])
def test_sigterm_and_sighup_end_a_long_command_with_one_line_and_its_children(data_dir, tmp_path, command, sig,
                                                                              children, code, line):
    """Before: plan, bench, diverge, timeline died silently by the signal (diverge's replay worker
    ran on), timeline and diverge printed a traceback for Ctrl-C, and SIGHUP killed the launcher
    alone, its scheduler, servers and workers running on in sessions of their own."""
    if "manual_dp.diverge" in command:                    # a run to replay
        subprocess.run([sys.executable, "-m", "manual_dp.train", "--data-dir", str(data_dir), *TINY, "--cpus", "1",
                        "--digests", str(tmp_path / "d.jsonl")], check=True, capture_output=True, timeout=120)
    proc = subprocess.Popen([sys.executable, "-m", *command], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 60
        while not (caught(proc.pid, sig) and len(descendants(proc.pid)) >= children) and time.monotonic() < deadline:
            time.sleep(0.05)
        below = descendants(proc.pid)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    time.sleep(0.5)
    left = [p for p in below if running(p)]
    for p in left:
        os.kill(p, signal.SIGKILL)
    lines = [l for l in err.strip().splitlines() if not l.startswith("[")]
    assert (proc.returncode, lines, left) == (code, [line], []), err
