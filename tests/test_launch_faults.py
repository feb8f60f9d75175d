"""The launcher's refusals (one line, exit 2) and its start-up deadline, with stand-in programs
and a stand-in ssh: everything stays on 127.0.0.1."""
import os
import socket
import stat
import subprocess
import sys
import time

import pytest

from manual_dp.multiprocess import launcher as launch

# Each role sleeps as long as the stand-in's argument for it says, then prints that it is done.
STAND_IN = ("import os, sys, time; role = os.environ['DMLC_ROLE']; "
            "time.sleep(float(dict(a.split('=') for a in sys.argv[1:-1])[role])); print(role, 'done')")


def stand_in(tmp_path, **seconds):
    """A command line for the job; its last argument marks it (see running)."""
    return [sys.executable, "-c", STAND_IN, *(f"{k}={v}" for k, v in seconds.items()),
            f"marker={tmp_path}"]


def fake_ssh(tmp_path, body):
    """A stand-in ssh that records its arguments (one a line) and then runs `body` (sh)."""
    path = tmp_path / "fake-ssh"
    path.write_text(f"#!/bin/sh\nprintf '%s\\n' \"$@\" > {tmp_path}/ssh-args.$$\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def hosts_file(tmp_path, *hosts):
    path = tmp_path / "hosts"
    path.write_text("\n".join(hosts) + "\n")
    return path


def running(tmp_path):
    """Pids of processes (other than this one) whose command line mentions `tmp_path`."""
    found = []
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) != os.getpid():
            try:
                if str(tmp_path) in open(f"/proc/{d}/cmdline", "rb").read().decode(errors="replace"):
                    found.append(int(d))
            except OSError:
                pass
    return found


def launch_run(*argv, timeout=60):
    """(exit status, stdout, stderr lines, seconds taken) of `python -m manual_dp.launch argv`."""
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "manual_dp.launch", *map(str, argv)],
                          capture_output=True, text=True, timeout=timeout)
    return done.returncode, done.stdout, done.stderr.strip().splitlines(), time.monotonic() - start


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_a_host_that_never_answers_stops_the_job_at_the_start_timeout(tmp_path, host):
    """ssh hangs before the remote shell starts (as on a host that drops packets)."""
    ssh = fake_ssh(tmp_path, "while :; do sleep 0.2; done")
    code, out, err, took = launch_run(
        "--workers", 2, "--servers", 1, "--hosts", hosts_file(tmp_path, host), "--scheduler-host",
        "127.0.0.1", "--ssh", ssh, "--start-timeout", 2, "--",
        *stand_in(tmp_path, scheduler=60, server=60, worker=60))
    assert code == 1 and len(err) == 1, (code, err, out)
    assert err[0] == (f"manual_dp.launch: error: server 0 on {host} did not start within "
                      f"--start-timeout 2 s; stopping the job"), err
    assert 2 <= took < 8, took
    args = [p.read_text().splitlines() for p in tmp_path.glob("ssh-args.*")]
    assert len(args) == 3 and all(a[:6] == ["-o", "BatchMode=yes", "-o", "ConnectTimeout=2", "-tt", host]
                                  for a in args), args
    time.sleep(0.5)
    assert not running(tmp_path)


def test_a_remote_process_that_started_may_run_past_the_start_timeout(tmp_path):
    """ssh takes 0.5 s to connect; the workers then run beyond the 2 s deadline and succeed.
    The start marker of each remote shell is not part of the job's output."""
    ssh = fake_ssh(tmp_path, 'for a; do last=$a; done; sleep 0.5; exec sh -c "$last"')
    code, out, err, took = launch_run(
        "--workers", 2, "--servers", 1, "--hosts", hosts_file(tmp_path, "127.0.0.1"),
        "--scheduler-host", "127.0.0.1", "--ssh", ssh, "--start-timeout", 2, "--",
        *stand_in(tmp_path, scheduler=3, server=3.5, worker=3))
    assert code == 0 and err == [], (code, err, out)
    assert sorted(out.splitlines()) == ["[scheduler] scheduler done", "[server 0] server done",
                                        "[worker 0] worker done", "[worker 1] worker done"], out
    assert launch.STARTED not in out


def test_a_local_line_that_looks_like_the_marker_is_forwarded(tmp_path):
    code, out, err, _ = launch_run("--workers", 1, "--", sys.executable, "-c",
                                   f"print({launch.STARTED!r})")
    assert code == 0 and err == [], (code, err)
    assert f"[worker 0] {launch.STARTED}" in out.splitlines(), out


def test_a_port_in_use_is_refused_before_anything_starts(tmp_path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        code, out, err, _ = launch_run("--port", port, "--", *stand_in(tmp_path, scheduler=0, server=0,
                                                                       worker=0))
    assert code == 2 and out == "" and len(err) == 1, (code, out, err)
    assert err[0] == (f"manual_dp.launch: error: --port {port} cannot be used on 127.0.0.1: "
                      f"Address already in use"), err


def test_a_free_port_passes_the_check():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launch.check_port_free("127.0.0.1", port)  # returns: nothing holds it any more


def test_a_hosts_file_that_is_not_utf8_is_refused(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_bytes(b"hostA\nh\xf6stB\n")
    code, out, err, _ = launch_run("--hosts", hosts, "--", "true")
    assert code == 2 and len(err) == 1, err
    assert err[0] == (f"manual_dp.launch: error: --hosts {hosts} is not UTF-8 text "
                      f"(byte 0xf6 at offset 7)"), err


@pytest.mark.parametrize("flag", ["--grace", "--start-timeout"])
@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "-inf", "1e999", "soon"])
def test_seconds_must_be_positive_and_finite(flag, value):
    code, out, err, _ = launch_run(f"{flag}={value}", "--", "true")  # = : "-inf" is no option
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"manual_dp.launch: error: argument {flag}: "), err
    assert repr(value) in err[0] or value in err[0], err
