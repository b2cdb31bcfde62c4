"""Running commands in a sandbox through the official SDK's `commands` and
`pty` modules: output, exit codes, environment, streaming, stdin, timeouts,
users and terminals."""

import hashlib
import re
import threading
import time

import pytest
from e2b import CommandExitException, PtySize, Sandbox, TimeoutException


def test_stdout_stderr_and_exit_code_of_a_successful_command(sandbox):
    result = sandbox.commands.run("echo out; echo err >&2")
    assert result.stdout == "out\n"
    assert result.stderr == "err\n"
    assert result.exit_code == 0
    assert result.error in (None, "")


def test_failing_command_raises_with_its_exit_code_and_output(sandbox):
    with pytest.raises(CommandExitException) as caught:
        sandbox.commands.run("echo partial; echo boom >&2; exit 3")
    err = caught.value
    assert err.exit_code == 3
    assert err.stdout == "partial\n"
    assert "boom" in err.stderr


def test_command_runs_in_the_requested_working_directory(sandbox):
    assert sandbox.commands.run("pwd", cwd="/tmp").stdout == "/tmp\n"
    sandbox.commands.run("mkdir -p '/tmp/a dir'")
    assert sandbox.commands.run("pwd", cwd="/tmp/a dir").stdout == "/tmp/a dir\n"


def test_default_working_directory_is_the_users_home(sandbox):
    assert sandbox.commands.run("pwd").stdout == "/home/user\n"
    assert sandbox.commands.run("echo $HOME").stdout == "/home/user\n"


def test_per_command_environment_variables(sandbox):
    result = sandbox.commands.run('echo "$FOO|$BAR"', envs={"FOO": "foo value", "BAR": "ünï"})
    assert result.stdout == "foo value|ünï\n"
    # They apply to that command only.
    assert sandbox.commands.run('echo "[$FOO]"').stdout == "[]\n"


def test_sandbox_environment_variables_reach_every_command(gateway):
    sbx = Sandbox.create(timeout=60, envs={"SBX_VAR": "from-create", "SHARED": "sandbox"})
    try:
        assert sbx.commands.run("echo $SBX_VAR").stdout == "from-create\n"
        assert sbx.commands.run("echo $SBX_VAR", user="root").stdout == "from-create\n"
        handle = sbx.commands.run("echo $SBX_VAR", background=True)
        assert handle.wait().stdout == "from-create\n"
        # A per-command value wins over the sandbox's.
        assert sbx.commands.run("echo $SHARED", envs={"SHARED": "command"}).stdout == "command\n"
    finally:
        sbx.kill()


def test_output_streams_to_callbacks_in_order_while_the_command_runs(sandbox):
    stdout: list[tuple[float, str]] = []
    stderr: list[tuple[float, str]] = []
    start = time.monotonic()
    result = sandbox.commands.run(
        "for i in 1 2 3 4 5; do echo out$i; echo err$i >&2; sleep 0.2; done",
        on_stdout=lambda chunk: stdout.append((time.monotonic() - start, chunk)),
        on_stderr=lambda chunk: stderr.append((time.monotonic() - start, chunk)),
        timeout=30,
    )
    finished = time.monotonic() - start

    assert "".join(c for _, c in stdout) == "".join(f"out{i}\n" for i in range(1, 6))
    assert "".join(c for _, c in stderr) == "".join(f"err{i}\n" for i in range(1, 6))
    assert result.stdout == "".join(c for _, c in stdout)
    # The loop takes ~1 s; the first lines must have arrived long before the
    # end, not all at once when the command finished.
    assert finished >= 0.9
    assert stdout[0][0] < finished - 0.5, f"first stdout at {stdout[0][0]:.2f}s, command done at {finished:.2f}s"
    assert stderr[0][0] < finished - 0.5, f"first stderr at {stderr[0][0]:.2f}s, command done at {finished:.2f}s"
    # Several chunks spread over time (one per line, give or take merging).
    assert len(stdout) >= 3
    assert stdout[-1][0] - stdout[0][0] >= 0.5


def test_three_megabytes_of_stdout_arrive_intact(sandbox):
    n = 470_000
    expected = "".join(f"{i}\n" for i in range(1, n + 1))
    assert len(expected) >= 3 * 1024 * 1024
    result = sandbox.commands.run(f"seq 1 {n}", timeout=60)
    assert len(result.stdout) == len(expected)
    assert hashlib.sha256(result.stdout.encode()).hexdigest() == hashlib.sha256(expected.encode()).hexdigest()


def test_background_command_is_listed_and_can_be_killed(sandbox):
    handle = sandbox.commands.run("sleep 300", background=True, timeout=0)
    try:
        procs = {p.pid: p for p in sandbox.commands.list()}
        assert handle.pid in procs
        listed = procs[handle.pid]
        assert "sleep 300" in " ".join([listed.cmd, *listed.args])

        assert sandbox.commands.kill(handle.pid) is True
        with pytest.raises(CommandExitException):
            handle.wait()

        deadline = time.monotonic() + 5
        while handle.pid in {p.pid for p in sandbox.commands.list()}:
            assert time.monotonic() < deadline, "killed command is still listed after 5 s"
            time.sleep(0.1)
        # Killing what no longer exists reports False rather than raising.
        assert sandbox.commands.kill(handle.pid) is False
        assert sandbox.commands.run("pgrep -x sleep || true").stdout == ""
    finally:
        sandbox.commands.kill(handle.pid)


def test_stdin_is_fed_to_a_background_command_until_closed(sandbox):
    handle = sandbox.commands.run("cat", background=True, stdin=True, timeout=30)
    handle.send_stdin("hello\n")
    sandbox.commands.send_stdin(handle.pid, "wörld\n")
    handle.close_stdin()
    result = handle.wait()
    assert result.exit_code == 0
    assert result.stdout == "hello\nwörld\n"


def test_command_exceeding_its_timeout_raises_timeout(sandbox):
    start = time.monotonic()
    with pytest.raises(TimeoutException):
        sandbox.commands.run("sleep 30", timeout=2)
    elapsed = time.monotonic() - start
    assert 1.5 <= elapsed < 10, f"timed out after {elapsed:.1f}s"
    # The sandbox is still usable afterwards.
    assert sandbox.commands.run("echo alive").stdout == "alive\n"


def test_commands_run_as_user_by_default_and_as_root_on_request(sandbox):
    assert sandbox.commands.run("whoami").stdout == "user\n"
    assert sandbox.commands.run("id -u").stdout != "0\n"
    assert sandbox.commands.run("whoami", user="root").stdout == "root\n"
    assert sandbox.commands.run("id -u", user="root").stdout == "0\n"
    assert sandbox.commands.run("whoami", user="user").stdout == "user\n"


def test_pty_session_echoes_input_and_honours_its_size(sandbox):
    output = bytearray()
    lock = threading.Lock()
    handle = sandbox.pty.create(PtySize(rows=24, cols=80), timeout=60)
    outcome: dict = {}

    def pump():
        def on_pty(chunk: bytes):
            with lock:
                output.extend(chunk)

        try:
            outcome["result"] = handle.wait(on_pty=on_pty)
        except Exception as e:  # exit of the shell is reported by the main thread
            outcome["error"] = e

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()

    def wait_for(pattern: str, timeout: float = 10) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with lock:
                text = output.decode(errors="replace")
            if re.search(pattern, text):
                return
            time.sleep(0.05)
        with lock:
            text = output.decode(errors="replace")
        raise AssertionError(f"{pattern!r} did not appear in the terminal within {timeout}s; got {text[-500:]!r}")

    try:
        sandbox.pty.send_stdin(handle.pid, b"echo pty-$((6*7))\n")
        wait_for(r"pty-42")
        sandbox.pty.send_stdin(handle.pid, b"tty; stty size\n")
        wait_for(r"/dev/pts/\d+")
        wait_for(r"\b24 80\b")
        sandbox.pty.resize(handle.pid, PtySize(rows=30, cols=100))
        sandbox.pty.send_stdin(handle.pid, b"stty size\n")
        wait_for(r"\b30 100\b")
        sandbox.pty.send_stdin(handle.pid, b"exit 0\n")
        reader.join(timeout=10)
        assert not reader.is_alive(), "the PTY stream did not end after `exit`"
        assert "error" not in outcome, outcome.get("error")
        assert outcome["result"].exit_code == 0
    finally:
        if reader.is_alive():
            sandbox.pty.kill(handle.pid)
            reader.join(timeout=5)
