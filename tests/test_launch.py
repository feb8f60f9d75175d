"""The launcher with stand-in programs (no MXNet): roles, environment, output, teardown, ssh."""
import os
import signal
import stat
import subprocess
import sys
import time

import pytest

from jobs import Job, run_job
from manual_dp.multiprocess import launcher as launch

# A stand-in for a training command: prints its role, then behaves as the test asks by role.
STAND_IN = """
import os, sys, time
role = os.environ["DMLC_ROLE"]
print(role, os.environ["DMLC_NODE_HOST"], os.environ["DMLC_PS_ROOT_URI"],
      os.environ["DMLC_PS_ROOT_PORT"], os.environ["DMLC_NUM_WORKER"],
      os.environ["DMLC_NUM_SERVER"], os.environ.get("MANUAL_DP_LOCAL_RANK"), flush=True)
behaviour = dict(arg.split("=") for arg in sys.argv[1:])
# "SECONDS[,STATUS]": sleep, then exit with STATUS (default 0); a negative STATUS: killed by signal -STATUS
what = behaviour.get(role + os.environ.get("MANUAL_DP_LOCAL_RANK", ""), behaviour.get(role, "0.3"))
seconds, _, status = what.partition(",")
time.sleep(float(seconds))
if int(status or 0) < 0:
    os.kill(os.getpid(), -int(status))
sys.exit(int(status or 0))
"""


def launcher(tmp_path, *options, behaviour=()):
    marker = tmp_path / "marker"  # in every command line: finds leftovers
    return [sys.executable, "-m", "manual_dp.launch", *options, "--",
            sys.executable, "-c", STAND_IN, *behaviour, f"marker={marker}"], str(marker)


def leftovers(marker):
    found = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if marker in open(f"/proc/{d}/cmdline", "rb").read().decode(errors="replace"):
                    found.append(int(d))
            except OSError:
                pass
    return found


def test_loopback_job_gives_every_role_its_environment(tmp_path):
    cmd, marker = launcher(tmp_path, "--workers", "3", "--servers", "2", "--port", "9",
                           behaviour=["scheduler=0.8", "server=0.8"])
    code, out = run_job(cmd, tmp_path / "out.txt", timeout=60)
    assert code == 0, out
    lines = sorted(l for l in out.splitlines() if l.startswith("["))
    assert lines == sorted(
        ["[scheduler] scheduler 127.0.0.1 127.0.0.1 9 3 2 None"] +
        [f"[server {i}] server 127.0.0.1 127.0.0.1 9 3 2 None" for i in range(2)] +
        [f"[worker {i}] worker 127.0.0.1 127.0.0.1 9 3 2 {i}" for i in range(3)]), out
    assert not leftovers(marker)


def test_a_free_port_by_default(tmp_path):
    args, _ = launch.parse(["--", "true"])
    env = launch.plan(args)[0][2]
    assert env["DMLC_PS_ROOT_URI"] == "127.0.0.1" and 1024 <= int(env["DMLC_PS_ROOT_PORT"]) < 65536


@pytest.mark.parametrize("failing,expect", [
    ("worker1=0,3", "worker 1 exited with status 3"),
    ("server=0,1", "server 0 exited with status 1"),
    ("scheduler=0,0", "scheduler ended while workers still ran"),
])
def test_a_failing_part_stops_the_whole_job_quickly(tmp_path, failing, expect):
    cmd, marker = launcher(tmp_path, "--workers", "2", "--grace", "1",
                           behaviour=["worker=60", "server=60", "scheduler=60", failing])
    start = time.monotonic()
    code, out = run_job(cmd, tmp_path / "out.txt", timeout=60)
    assert code != 0 and f"manual_dp.launch: error: {expect}; stopping the job" in out, out
    assert time.monotonic() - start < 20
    assert not leftovers(marker)


def test_a_stopped_worker_is_killed_at_teardown(tmp_path):
    cmd, marker = launcher(tmp_path, "--workers", "2",
                           behaviour=["worker0=60", "worker1=2,2", "server=60", "scheduler=60"])
    job = Job(cmd, tmp_path / "out.txt")
    try:
        first = None
        deadline = time.monotonic() + 30
        while first is None and time.monotonic() < deadline:
            time.sleep(0.05)
            first = next((p for p in leftovers(marker) if p != job.proc.pid and
                          b"MANUAL_DP_LOCAL_RANK=0" in open(f"/proc/{p}/environ", "rb").read()), None)
        os.kill(first, signal.SIGSTOP)
        assert job.wait(30) == 2
    finally:
        job.close()
    assert not leftovers(marker)


def test_sigterm_to_the_launcher_stops_the_job(tmp_path):
    cmd, marker = launcher(tmp_path, behaviour=["worker=60", "server=60", "scheduler=60"])
    job = Job(cmd, tmp_path / "out.txt")
    try:
        deadline = time.monotonic() + 30
        while len(leftovers(marker)) < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        job.proc.send_signal(signal.SIGTERM)
        assert job.wait(30) == 130
    finally:
        job.close()
    assert "interrupted" in job.output() and not leftovers(marker)


def test_hosts_file_goes_round_robin_through_ssh(tmp_path):
    """A stand-in ssh runs the remote command here, after checking what it was given."""
    hosts = tmp_path / "hosts"
    hosts.write_text("# the cluster\nhostA\n\nhostB  # second\n")
    fake_ssh = tmp_path / "fake-ssh"
    fake_ssh.write_text("#!/bin/sh\n"
                        "[ \"$1 $2 $3 $4 $5\" = \"-o BatchMode=yes -o ConnectTimeout=60 -tt\" ] || exit 97\n"
                        "echo \"on $6\"\nexec sh -c \"$7\"\n")
    fake_ssh.chmod(fake_ssh.stat().st_mode | stat.S_IEXEC)
    cmd, marker = launcher(tmp_path, "--workers", "3", "--servers", "1", "--hosts", str(hosts),
                           "--scheduler-host", "127.0.0.1", "--port", "7", "--ssh", str(fake_ssh),
                           behaviour=["scheduler=0.8", "server=0.8"])
    code, out = run_job(cmd, tmp_path / "out.txt", timeout=60)
    assert code == 0, out
    for line in ["[server 0] on hostA", "[server 0] server hostA 127.0.0.1 7 3 1 None",
                 "[worker 0] on hostA", "[worker 0] worker hostA 127.0.0.1 7 3 1 0",
                 "[worker 1] on hostB", "[worker 1] worker hostB 127.0.0.1 7 3 1 0",
                 "[worker 2] on hostA", "[worker 2] worker hostA 127.0.0.1 7 3 1 1",
                 "[scheduler] scheduler 127.0.0.1 127.0.0.1 7 3 1 None"]:
        assert line in out.splitlines(), out
    assert "[scheduler] on" not in out  # the scheduler runs here


@pytest.mark.parametrize("argv,message", [
    (["--workers", "2"], "give the command after --"),
    (["--workers", "0", "--", "true"], "--workers must be at least 1"),
    (["--servers", "-1", "--", "true"], "--servers must be at least 1"),
    (["--", ], "no command after --"),
    (["--hosts", "/nonexistent/hosts", "--", "true"], "--hosts /nonexistent/hosts: No such file"),
    (["--port", "70000", "--", "true"], "--port must be in 1..65535"),
    (["--workers", "two", "--", "true"], "invalid int value"),
])
def test_bad_input_is_one_line_and_exit_2(argv, message):
    done = subprocess.run([sys.executable, "-m", "manual_dp.launch", *argv], capture_output=True,
                          text=True, timeout=30)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0].startswith("manual_dp.launch: error:") and message in lines[0], lines[0]


def test_a_command_that_cannot_start_is_one_line_and_exit_1(tmp_path):
    done = subprocess.run([sys.executable, "-m", "manual_dp.launch", "--", str(tmp_path / "no-such")],
                          capture_output=True, text=True, timeout=30)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1, done.stderr
    assert lines[0].startswith("manual_dp.launch: error: could not start"), lines[0]
