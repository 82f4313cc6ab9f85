"""run_python: what a program sees and gets back, the limits of one run, and refusals."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from benchmarks import subprocess_env
from decentrl.config import SandboxConfig, load_config
from decentrl.sandbox import SandboxUnavailable, bubblewrap, run_python

FAST = SandboxConfig(wall_seconds=3.0, cpu_seconds=2)


def test_program_gets_its_files_stdin_and_a_private_work_directory() -> None:
    source = (
        "import os, sys\n"
        "print(sys.stdin.read().upper(), open('pkg/data.txt').read(), os.getcwd(), sorted(os.listdir('.')))\n"
        "print('uid', os.getuid(), 'root' if os.getuid() == 0 else 'unprivileged')\n"
        "open('out.txt', 'w').write('scratch is writable')\n"
        "sys.exit(3)\n"
    )
    result = run_python(source, files={"pkg/data.txt": "payload"}, stdin="hello", config=FAST)
    assert result.stdout.splitlines()[0] == "HELLO payload /tmp ['main.py', 'pkg']"
    assert result.stdout.splitlines()[1].endswith("unprivileged")
    assert result.exit_code == 3 and result.killed_reason is None and not result.timed_out
    assert result.stderr == ""


def test_a_sandbox_that_cannot_be_set_up_raises_instead_of_scoring_zero(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    isolation = bubblewrap._isolation_args
    monkeypatch.setattr(bubblewrap, "_isolation_args", lambda c: [*isolation(c), "--remount-ro", "/missing"])
    with pytest.raises(SandboxUnavailable, match="could not set up the sandbox"):
        run_python("print('never runs')", config=FAST)


def test_stdin_is_read_only() -> None:
    result = run_python("import os\nos.write(0, b'x')", stdin="data", config=FAST)
    assert "Bad file descriptor" in result.stderr


def test_stderr_and_exceptions_come_back() -> None:
    result = run_python("raise ValueError('boom')", config=FAST)
    assert result.exit_code == 1
    assert "ValueError: boom" in result.stderr


def test_wall_clock_kills_a_sleeping_program() -> None:
    config = FAST.model_copy(update={"wall_seconds": 1.0})
    result = run_python("import time\nprint('up', flush=True)\ntime.sleep(60)", config=config)
    assert result.timed_out and result.killed_reason == "wall_time"
    assert result.stdout == "up\n" and result.exit_code == 128 + 9
    assert 1.0 <= result.wall_s < 3.0


def test_cpu_limit_kills_a_busy_loop() -> None:
    config = FAST.model_copy(update={"cpu_seconds": 1, "wall_seconds": 10.0})
    result = run_python("while True:\n    pass", config=config)
    assert result.killed_reason in ("cpu_time", "signal") and not result.timed_out


def test_output_past_the_cap_is_cut_and_the_run_killed() -> None:
    config = FAST.model_copy(update={"max_output_bytes": 4096})
    result = run_python("while True:\n    print('x' * 1000)", config=config)
    assert result.output_truncated and result.killed_reason == "output_limit"
    assert len(result.stdout) == 4096


def test_process_limit_is_per_sandbox() -> None:
    """RLIMIT_NPROC is set inside each sandbox's user namespace, so two sandboxes of the same uid
    each get the whole budget (a shared count would starve the second)."""
    config = FAST.model_copy(update={"processes": 12})
    source = (
        "import os, time\n"
        "n = 0\n"
        "try:\n"
        "    while n < 9:\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(1.5)\n"
        "            os._exit(0)\n"
        "        n += 1\n"
        "except OSError:\n"
        "    pass\n"
        "print(n, flush=True)\n"
        "for _ in range(n):\n"
        "    os.wait()  # the sandboxes overlap while the children sleep\n"
    )
    results: list = [None, None]

    def run(index: int) -> None:
        results[index] = run_python(source, config=config)

    threads = [threading.Thread(target=run, args=(index,)) for index in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [result.stdout for result in results] == ["9\n", "9\n"]


def test_bad_file_names_are_refused() -> None:
    for name in ("../escape.py", "/etc/passwd", "a/../../b"):
        with pytest.raises(ValueError, match="plain relative path"):
            run_python("pass", files={name: "x"}, config=FAST)


def test_backend_none_refuses_with_the_fix() -> None:
    with pytest.raises(SandboxUnavailable, match="install bubblewrap"):
        run_python("print('unsandboxed!')", config=SandboxConfig(backend="none"))


def test_missing_bwrap_refuses_with_the_fix(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    bubblewrap._check_available.cache_clear()
    try:
        with pytest.raises(SandboxUnavailable, match="apt-get install -y bubblewrap"):
            run_python("print('unsandboxed!')", config=FAST)
    finally:
        bubblewrap._check_available.cache_clear()


def test_interpreter_outside_usr_is_refused() -> None:
    with pytest.raises(SandboxUnavailable, match="sandbox.python"):
        run_python("pass", config=FAST.model_copy(update={"python": "/opt/python/bin/python3"}))


def test_sandbox_section_in_config(tmp_path) -> None:
    path = tmp_path / "run.toml"
    path.write_text("[sandbox]\nwall_seconds = 2.5\nprocesses = 8\n")
    config = load_config(path, ["sandbox.backend=none"])
    assert (config.sandbox.wall_seconds, config.sandbox.processes, config.sandbox.backend) == (2.5, 8, "none")


def test_the_sandbox_and_code_reward_import_without_torch() -> None:
    """The coordinator scores code, and it imports no torch."""
    code = (
        "import sys, decentrl.sandbox, decentrl.envs.coding.hidden_tests, benchmarks.sandbox.attacks\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, env=subprocess_env())
    assert run.returncode == 0, run.stderr
