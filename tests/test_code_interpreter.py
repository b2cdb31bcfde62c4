"""The code interpreter, driven only by the official e2b-code-interpreter SDK
(`Sandbox.create()` uses its default template, code-interpreter-v1)."""

import base64
import time

import pytest
from e2b import NotFoundException, TimeoutException
from conftest import wheel
from e2b_code_interpreter import Sandbox

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def sbx(gateway):
    sandbox = Sandbox.create(timeout=180)
    try:
        yield sandbox
    finally:
        sandbox.kill()


def test_state_persists_across_calls(sbx):
    first = sbx.run_code("import math\nx = 41\ndef inc(v):\n    return v + 1")
    assert first.error is None
    assert first.results == []

    second = sbx.run_code("inc(x)")
    assert second.error is None
    assert second.text == "42"
    assert second.results[0].is_main_result

    third = sbx.run_code("math.floor(x / 2)")
    assert third.text == "20"
    assert third.execution_count == second.execution_count + 1


def test_stdout_comes_before_the_result(sbx):
    events = []
    execution = sbx.run_code(
        "print('hello')\n'done'",
        on_stdout=lambda msg: events.append(("stdout", msg.line)),
        on_result=lambda result: events.append(("result", result.text)),
    )
    assert execution.error is None
    assert execution.logs.stdout == ["hello\n"]
    assert execution.logs.stderr == []
    # A str result comes back without its repr quotes, as E2B returns it.
    assert execution.text == "done"
    assert events == [("stdout", "hello\n"), ("result", "done")]


def test_display_calls_are_extra_results(sbx):
    execution = sbx.run_code("from IPython.display import display\ndisplay(1)\ndisplay('two')\n3")
    assert execution.error is None
    assert [(r.text, r.is_main_result) for r in execution.results] == [
        ("1", False),
        ("two", False),
        ("3", True),
    ]
    assert execution.text == "3"


def test_error_has_name_value_and_traceback(sbx):
    errors = []
    execution = sbx.run_code(
        "print('before')\ndef explode():\n    raise ValueError('boom')\nexplode()",
        on_error=errors.append,
    )
    assert execution.logs.stdout == ["before\n"]
    assert execution.results == []
    assert execution.error is not None
    assert execution.error.name == "ValueError"
    assert execution.error.value == "boom"
    assert "explode()" in execution.error.traceback
    assert "ValueError" in execution.error.traceback
    assert len(errors) == 1 and errors[0].name == "ValueError"

    # The kernel is still there after an error.
    assert sbx.run_code("1 + 1").text == "2"


def test_stdout_callbacks_stream_while_the_code_runs(sbx):
    code = "import time\nfor i in range(3):\n    print(f'tick {i}', flush=True)\n    time.sleep(1)\n"
    arrivals = []
    start = time.monotonic()
    execution = sbx.run_code(code, on_stdout=lambda msg: arrivals.append((msg.line, time.monotonic() - start)))
    total = time.monotonic() - start

    assert execution.error is None
    assert "".join(line for line, _ in arrivals) == "tick 0\ntick 1\ntick 2\n"
    assert [line for line, _ in arrivals] == execution.logs.stdout
    assert len(arrivals) >= 3
    # The first line reached the caller about two seconds before the call
    # returned, and the lines arrived spread over the run, not in one burst.
    assert arrivals[0][1] < total - 1.5, (arrivals, total)
    assert arrivals[-1][1] - arrivals[0][1] >= 1.5, (arrivals, total)


def test_matplotlib_figures_come_back_as_png(sbx):
    shown = sbx.run_code(
        "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [1, 4, 9])\nplt.title('squares')\nplt.show()",
        timeout=150,
    )
    assert shown.error is None, shown.error
    pngs = [r.png for r in shown.results if r.png]
    assert len(pngs) == 1
    assert base64.b64decode(pngs[0]).startswith(PNG_MAGIC)

    # No plt.show(): the figure still comes back at the end of the cell.
    implicit = sbx.run_code("fig, ax = plt.subplots()\nax.bar(['a', 'b'], [3, 5])\nNone")
    assert implicit.error is None, implicit.error
    pngs = [r.png for r in implicit.results if r.png]
    assert len(pngs) == 1
    assert base64.b64decode(pngs[0]).startswith(PNG_MAGIC)


def test_pandas_dataframe_comes_back_with_html(sbx):
    execution = sbx.run_code("import pandas as pd\npd.DataFrame({'name': ['ada', 'bob'], 'score': [3, 5]})", timeout=150)
    assert execution.error is None, execution.error
    [result] = execution.results
    assert result.is_main_result
    assert "<table" in result.html
    assert "ada" in result.html and "score" in result.html
    assert "ada" in result.text


def test_contexts_honour_cwd_and_are_isolated(sbx):
    in_tmp = sbx.create_code_context(cwd="/tmp")
    other = sbx.create_code_context()
    assert in_tmp.language == "python" and in_tmp.cwd == "/tmp"
    assert other.language == "python" and other.cwd == "/home/user"
    assert in_tmp.id != other.id

    assert sbx.run_code("import os\nos.getcwd()", context=in_tmp).text == "/tmp"
    assert sbx.run_code("import os\nos.getcwd()", context=other).text == "/home/user"
    assert sbx.run_code("import os\nos.getcwd()").text == "/home/user"

    sbx.run_code("only_here = 'tmp context'", context=in_tmp)
    assert sbx.run_code("only_here", context=in_tmp).text == "tmp context"
    for elsewhere in (sbx.run_code("only_here", context=other), sbx.run_code("only_here")):
        assert elsewhere.error is not None and elsewhere.error.name == "NameError"


def test_contexts_list_restart_and_remove(sbx):
    ctx = sbx.create_code_context()
    listed = {c.id: c for c in sbx.list_code_contexts()}
    assert ctx.id in listed
    assert listed[ctx.id].language == "python" and listed[ctx.id].cwd == "/home/user"

    sbx.run_code("survivor = 1", context=ctx)
    sbx.run_code("kept = 'default'")
    sbx.restart_code_context(ctx)
    gone = sbx.run_code("survivor", context=ctx)
    assert gone.error is not None and gone.error.name == "NameError"
    assert sbx.run_code("1 + 2", context=ctx).text == "3"
    # Restarting one context leaves the others alone.
    assert sbx.run_code("kept").text == "default"

    sbx.remove_code_context(ctx)
    assert ctx.id not in {c.id for c in sbx.list_code_contexts()}
    with pytest.raises(NotFoundException):
        sbx.run_code("1", context=ctx)


def test_per_call_envs_apply_to_that_call_only(sbx):
    code = "import os, subprocess\n" "(os.environ.get('COPSE_CI_VAR', 'unset'), " "subprocess.run(['sh', '-c', 'echo $COPSE_CI_VAR'], capture_output=True, text=True).stdout.strip())"
    with_env = sbx.run_code(code, envs={"COPSE_CI_VAR": "it's here"})
    assert with_env.error is None, with_env.error
    assert with_env.text == "(\"it's here\", \"it's here\")"

    without = sbx.run_code(code)
    assert without.text == "('unset', '')"

    in_bash = sbx.run_code("echo \"[$COPSE_CI_VAR]\"", language="bash", envs={"COPSE_CI_VAR": "bash value"})
    assert "".join(in_bash.logs.stdout) == "[bash value]\n"
    after = sbx.run_code("echo \"[$COPSE_CI_VAR]\"", language="bash")
    assert "".join(after.logs.stdout) == "[]\n"


def test_timeout_interrupts_and_the_context_still_answers(sbx):
    sbx.run_code("before_timeout = 'still here'")
    start = time.monotonic()
    with pytest.raises(TimeoutException):
        sbx.run_code("import time\ntime.sleep(30)", timeout=2)
    assert time.monotonic() - start < 10

    # The sleep was interrupted, not waited out, and the state survived.
    start = time.monotonic()
    assert sbx.run_code("1+1", timeout=20).text == "2"
    assert time.monotonic() - start < 15
    assert sbx.run_code("before_timeout").text == "still here"


def test_a_crashed_kernel_is_reported_and_restarted(sbx):
    crashed = sbx.run_code("import os\nos._exit(1)")
    assert crashed.error is not None
    assert crashed.error.name == "UnexpectedEndOfExecution"
    assert sbx.run_code("1+1").text == "2"


def test_bash(sbx):
    first = sbx.run_code("GREETING=hello\necho \"$GREETING world\"\necho oops >&2\ncd /tmp", language="bash")
    assert first.error is None, first.error
    assert "".join(first.logs.stdout) == "hello world\n"
    assert "".join(first.logs.stderr) == "oops\n"

    # Variables and the working directory persist in the default bash context.
    second = sbx.run_code("echo \"$GREETING\"; pwd", language="bash")
    assert "".join(second.logs.stdout) == "hello\n/tmp\n"

    failed = sbx.run_code("echo partial; false", language="bash")
    assert "".join(failed.logs.stdout) == "partial\n"
    assert failed.error is not None and failed.error.value == "1"

    ctx = sbx.create_code_context(cwd="/tmp", language="bash")
    assert ctx.language == "bash" and ctx.cwd == "/tmp"
    own = sbx.run_code("pwd; echo \"[${GREETING:-}]\"", context=ctx)
    assert "".join(own.logs.stdout) == "/tmp\n[]\n"
    assert ctx.id in {c.id for c in sbx.list_code_contexts()}

    # A bash cell that outlives its timeout is interrupted; the shell lives on.
    with pytest.raises(TimeoutException):
        sbx.run_code("KEEP=1; sleep 30; echo never", context=ctx, timeout=2)
    after = sbx.run_code("echo \"keep=$KEEP\"", context=ctx, timeout=20)
    assert "".join(after.logs.stdout) == "keep=1\n"


def test_javascript_and_typescript_contexts(sbx):
    """As E2B's JavaScript kernel: state persists, the last expression is the
    result, top-level await works; TypeScript's types are stripped."""
    first = sbx.run_code("const seen = [1, 2, 3]; console.log('listed'); seen.length", language="js")
    assert first.error is None, first.error
    assert first.text == "3" and first.logs.stdout == ["listed\n"]
    assert sbx.run_code("await Promise.resolve(seen.map((n) => n * 2))", language="javascript").text == "[ 2, 4, 6 ]"

    ctx = sbx.create_code_context(cwd="/tmp", language="typescript")
    assert ctx.language == "typescript" and ctx.cwd == "/tmp"
    typed = sbx.run_code("const here: string = process.cwd(); here", context=ctx)
    assert typed.text == "/tmp"
    failed = sbx.run_code("seen", context=ctx)  # contexts are separate processes
    assert failed.error is not None and failed.error.name == "ReferenceError"

    # An endless cell is interrupted at its timeout; the context lives on.
    with pytest.raises(TimeoutException):
        sbx.run_code("while (true) {}", language="js", timeout=2)
    assert sbx.run_code("seen.length", language="js", timeout=20).text == "3"


def server_ready_at(sbx) -> float:
    """When the sandbox's interpreter found its default kernel ready (the
    server says so on /health, asked from inside the sandbox)."""
    probe = sbx.commands.run(
        "python3 -c \"import urllib.request as u; "
        "print(u.urlopen('http://127.0.0.1:49999/health').headers['X-Copse-Ready-At'])\""
    )
    return float(probe.stdout)


@pytest.mark.timeout(300, func_only=True)
def test_with_no_pool_a_create_restores_the_warm_kernel_with_its_own_identity(gateway):
    """The suite's gateway keeps no code-interpreter pool, so every create
    misses it: the sandbox is restored from the template's memory snapshot,
    its server and kernel started before the create was asked for and not
    started again; each restored sandbox still has its own hostname, token
    and environment."""
    # The gateway's first code-interpreter boot may be the one that takes
    # the warm snapshot.
    Sandbox.create(timeout=60).kill()
    asked_at = time.time()
    first = Sandbox.create(timeout=120, envs={"MARK": "first"})
    second = Sandbox.create(timeout=120, envs={"MARK": "second"})
    try:
        hosts = []
        for sbx, mark in ((first, "first"), (second, "second")):
            answer = sbx.run_code("import os, socket\n[os.environ.get('MARK'), socket.gethostname()]")
            assert answer.error is None
            got_mark, host = eval(answer.text)
            assert got_mark == mark
            assert sbx.sandbox_id.startswith(host)
            hosts.append(host)
            # Ready before anyone asked: restored, not started.
            assert server_ready_at(sbx) < asked_at
        assert hosts[0] != hosts[1]
        assert first._envd_access_token != second._envd_access_token
        # One snapshot, many kernels: no random state is shared, neither
        # Python's nor the OpenSSL generator in its process, nor JavaScript's
        # (V8's Math.random, and OpenSSL's behind Node's `crypto`).
        python = "import random, ssl\nf'{random.getrandbits(64)} {ssl.RAND_bytes(16).hex()}'"
        javascript = "[Math.random(), require('node:crypto').randomUUID()].join(' ')"
        for code, language in ((python, "python"), (javascript, "js")):
            draws = [sbx.run_code(code, language=language).text.strip("'").split() for sbx in (first, second)]
            assert len(draws[0]) == 2 and all(a != b for a, b in zip(*draws)), (language, draws)
        # The kernel is the same process as before the first cell: the
        # cell above ran in it, state persists.
        assert first.run_code("x = 6 * 7").error is None
        assert first.run_code("x").text == "42"
    finally:
        first.kill()
        second.kill()


def test_a_package_pip_installed_in_a_cell_imports_in_the_next(sbx, tmp_path):
    """What agents do on E2B: `!pip install` in one cell, `import` in the
    next. The package is a wheel the test made (no index is reached)."""
    wheel(tmp_path, "copse_cell_probe", "installed-from-a-cell")
    name = "copse_cell_probe-1.0-py3-none-any.whl"
    sbx.files.write(f"/home/user/{name}", (tmp_path / name).read_bytes())
    installed = sbx.run_code(f"!pip install --no-index /home/user/{name}")
    assert installed.error is None, installed
    assert any("Successfully installed copse-cell-probe-1.0" in line for line in installed.logs.stdout), installed.logs
    imported = sbx.run_code("import copse_cell_probe\ncopse_cell_probe.VALUE")
    assert imported.error is None, imported.error
    assert imported.text == "installed-from-a-cell"
