"""The sandbox layer (runner/rollout/sandbox): hostile commands are contained and the host's state is checked after.

Runs real bubblewrap sandboxes. Without bwrap the tests skip, except under CI (CI=true, or
MIXFLEET_REQUIRE_SANDBOX=1 as .ci/run sets), where they fail with the install message: CI must run them.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest
from mixfleet.runner.rollout.sandbox import (
    Sandbox,
    SandboxLimits,
    SandboxPool,
    SandboxUnavailable,
    apply_patch,
    check_sandbox,
    runtime,
)


@pytest.fixture(scope="module", autouse=True)
def _bwrap() -> None:
    try:
        check_sandbox()
    except SandboxUnavailable as e:
        if os.environ.get("CI", "").lower() == "true" or os.environ.get("MIXFLEET_REQUIRE_SANDBOX") == "1":
            pytest.fail(f"CI must run the sandbox tests: {e}")
        pytest.skip(str(e))


@pytest.fixture()
def repo(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "calc.py").write_text("def add(a, b):\n    return a - b\n\n\ndef half(x):\n    return x // 2\n")
    (src / "pkg" / "__init__.py").write_text("")
    (src / "test_calc.py").write_text("import unittest\nfrom pkg.calc import add\n\n\nclass T(unittest.TestCase):\n"
                                      "    def test_add(self):\n        self.assertEqual(add(2, 3), 5)\n")
    (src / "notes.txt").write_text("no newline at the end")
    return src


def run(coro):  # noqa: ANN001, ANN201
    return asyncio.run(coro)


def _live_with(fragment: str) -> list[psutil.Process]:
    """Host processes (not zombies) whose command line mentions `fragment`."""
    out = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and fragment in " ".join(p.info["cmdline"] or []):
                out.append(p)
        except psutil.Error:
            pass
    return out


def _live_children() -> set[int]:
    out = set()
    for c in psutil.Process().children(recursive=True):
        try:
            if c.status() != psutil.STATUS_ZOMBIE:
                out.add(c.pid)
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.fixture
def new_children():
    """The live children of this process started since the test began (earlier tests in the same pytest process
    may leave their own helpers running, e.g. a tracker's service; they are not this test's)."""
    before = _live_children()
    return lambda: sorted(_live_children() - before)


def _wait_gone(fragment: str, seconds: float = 5.0) -> list[psutil.Process]:
    deadline = time.monotonic() + seconds
    while (left := _live_with(fragment)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def test_limits_checked() -> None:
    with pytest.raises(ValueError, match=r"SandboxLimits.timeout_s=0.*must be"):
        SandboxLimits(timeout_s=0)
    with pytest.raises(ValueError, match=r"SandboxLimits.max_procs=2\b"):
        SandboxLimits(max_procs=2)
    with pytest.raises(ValueError, match="SandboxPool max_live=0"):
        SandboxPool(0)


def test_runs_tests_and_sees_nothing_of_the_host(repo: Path, tmp_path: Path) -> None:
    host_marker = tmp_path / "host-marker"
    host_marker.write_text("secret")

    async def go() -> None:
        async with await Sandbox.create(repo) as box:
            r = await box.exec("python3 -m unittest -q 2>&1; pwd; id -u")
            assert r.exit_code == 0 and "FAILED" in r.output and "/work/repo" in r.output, r.output
            r = await box.exec(f"ls -a / /work; cat {host_marker}; ls {repo}; ls /root /home")
            names = set(r.output.split())
            assert {"root", "home", "opt", "srv", "var"}.isdisjoint(names) and "repo" in names
            assert "secret" not in r.output and r.output.count("No such file") == 4, r.output
            etc = set((await box.exec("ls -A /etc")).output.split())
            assert etc and etc <= {"passwd", "group", "nsswitch.conf", "ld.so.cache", "ld.so.conf", "ld.so.conf.d",
                                   "localtime", "python3", "python3.11", "alternatives"}, etc
            assert (await box.exec("echo $HOME $PATH; env | wc -l")).output.split()[:2] == ["/tmp",
                                                                                          "/usr/local/bin:/usr/bin:/bin"]
    run(go())


def test_writes_outside_the_folder_fail(repo: Path, tmp_path: Path) -> None:
    host_tmp = tmp_path / "host.txt"
    host_tmp.write_text("before")
    probe = f"mixfleet-h1-probe-{os.getpid()}"
    targets = [f"/etc/{probe}", f"/usr/{probe}", f"/usr/bin/{probe}", f"/work/{probe}", f"/{probe}", f"/dev/{probe}",
               "/etc/passwd"]

    async def go() -> None:
        async with await Sandbox.create(repo) as box:
            for t in targets:
                r = await box.exec(f"echo owned > {t}")
                assert r.exit_code != 0 and "Read-only file system" in r.output, (t, r.output)
            # the private /tmp is writable, but it is not the host's
            r = await box.exec(f"mkdir -p {tmp_path} && echo after > {host_tmp} && cat {host_tmp}")
            assert r.exit_code == 0 and "after" in r.output
            r = await box.exec("echo inside > kept.txt")
            assert r.exit_code == 0 and (box.workdir / "kept.txt").read_text() == "inside\n"
    passwd = Path("/etc/passwd").read_bytes()
    run(go())
    for t in targets[:-1]:
        assert not os.path.exists(t), t
    assert Path("/etc/passwd").read_bytes() == passwd
    assert host_tmp.read_text() == "before"
    assert not (repo / "kept.txt").exists()        # the source is never modified


def test_no_network(repo: Path) -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.settimeout(0.2)
    port = server.getsockname()[1]
    accepted: list[object] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                accepted.append(server.accept())
            except TimeoutError:
                pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        # the server is reachable from the host ...
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
        time.sleep(0.5)
        assert len(accepted) == 1
        code = ("import socket\nfor host in ('127.0.0.1', 'localhost', '10.0.2.2', '1.1.1.1'):\n"
                f"    try:\n        socket.create_connection((host, {port}), timeout=2); print('CONNECTED', host)\n"
                "    except OSError as e: print('BLOCKED', host, e)\n")

        async def go() -> str:
            async with await Sandbox.create(repo) as box:
                r = await box.exec(f"python3 -c \"{code}\"; cat /proc/net/dev")
                return r.output
        out = run(go())
        time.sleep(0.5)
        assert "CONNECTED" not in out and out.count("BLOCKED") == 4, out
        assert "eth" not in out and "lo:" in out     # only a loopback of its own
        assert len(accepted) == 1                   # ... and nothing from inside reached it
    finally:
        stop.set()
        thread.join()
        server.close()


def test_fork_bomb_is_bounded_and_leaves_nothing(repo: Path, new_children) -> None:
    limits = SandboxLimits(timeout_s=4, max_procs=16)

    async def go() -> None:
        async with await Sandbox.create(repo, limits=limits) as box:
            r = await box.exec("bomb() { bomb | bomb & }; bomb; sleep 3; ps -e --no-headers | wc -l")
            assert r.elapsed_s < 15
            assert "Resource temporarily unavailable" in r.output or r.timed_out, r.output
            if not r.timed_out:
                assert int(r.output.split()[-1]) <= 16 + 2       # ps and wc themselves need slots too
            assert (await box.exec("echo alive")).output.strip() == "alive"
            assert not _wait_gone(str(box.workdir))
    run(go())
    assert not new_children()


def test_cpu_and_memory_limits(repo: Path) -> None:
    limits = SandboxLimits(cpu_s=1, memory_mb=128, timeout_s=30)

    async def go() -> None:
        async with await Sandbox.create(repo, limits=limits) as box:
            r = await box.exec("python3 -c 'while True: pass'")
            assert r.exit_code == 128 + signal.SIGXCPU and not r.timed_out and r.elapsed_s < 20, r
            r = await box.exec("python3 -c 'x = bytearray(512 << 20)'")
            assert r.exit_code == 1 and "MemoryError" in r.output, r.output
            assert (await box.exec("python3 -c 'x = bytearray(16 << 20); print(len(x))'")).output == "16777216\n"
    run(go())


def test_disk_fill_stops_at_the_cap(repo: Path) -> None:
    limits = SandboxLimits(disk_mb=8, file_size_mb=4)
    free_before = shutil.disk_usage("/tmp").free

    async def go() -> None:
        async with await Sandbox.create(repo, limits=limits) as box:
            r = await box.exec("head -c 64M /dev/zero > one; ls -l one")
            assert "File size limit exceeded" in r.output
            r = await box.exec("for i in $(seq 20); do head -c 3M /dev/zero > f$i || break; done; df -k . | tail -1")
            assert "No space left on device" in r.output, r.output
            used = sum(f.stat().st_size for f in box.workdir.rglob("*") if f.is_file())
            assert used <= 8 << 20
            r = await box.exec("for i in $(seq 20); do head -c 3M /dev/zero > /tmp/f$i || break; done")
            assert "No space left on device" in r.output
    run(go())
    # the host's disk did not take the writes (other work shares it: allow far less than the 60+ MiB attempted)
    assert free_before - shutil.disk_usage("/tmp").free < 32 << 20


def test_sleep_forever_times_out_and_leaves_nothing(repo: Path, new_children) -> None:
    async def go() -> None:
        async with await Sandbox.create(repo, limits=SandboxLimits(timeout_s=30)) as box:
            r = await box.exec("(sleep 987651 &); nohup sleep 987652 & setsid sleep 987653 & sleep 987654",
                               timeout_s=1.0)
            assert r.exit_code == 124 and r.timed_out and 1.0 <= r.elapsed_s < 8
            assert "timed out" in r.output
            r = await box.exec("sleep 987655 & echo started")     # a background job ends with its command
            assert r.exit_code == 0 and not r.timed_out and r.elapsed_s < 8
    run(go())
    for n in range(987651, 987656):
        assert not _wait_gone(f"sleep {n}"), n
    assert not new_children()


def test_gigabyte_of_output_is_capped(repo: Path) -> None:
    rss_before = psutil.Process().memory_info().rss

    async def go() -> None:
        async with await Sandbox.create(repo, limits=SandboxLimits(output_bytes=1000, timeout_s=60)) as box:
            r = await box.exec("yes | head -c 1G; echo done >&2")
            assert r.truncated and r.exit_code == 0 and not r.timed_out
            assert len(r.output.encode()) <= 1000 and r.output.startswith("y\ny\n")
            r = await box.exec("python3 -c \"import sys\nfor _ in range(2000): sys.stdout.write('x' * 10**5)\"")
            assert r.truncated and r.exit_code == 0 and len(r.output) <= 1000
            r = await box.exec("echo short")
            assert not r.truncated and r.output == "short\n"
    run(go())
    assert psutil.Process().memory_info().rss - rss_before < 200 << 20


def test_killing_its_parent_leaves_the_host_alone(repo: Path) -> None:
    bystander = subprocess.Popen(["sleep", "300"])
    try:
        async def go() -> None:
            async with await Sandbox.create(repo) as box:
                r = await box.exec("kill -9 $PPID; echo still-here")
                assert r.exit_code == 0 and "still-here" in r.output
                r = await box.exec(f"kill -9 -1; kill -9 {os.getpid()} {bystander.pid} 1; echo after-kill")
                assert "after-kill" in r.output
                r = await box.exec("echo next")
                assert r.exit_code == 0 and r.output == "next\n"
        run(go())
        assert bystander.poll() is None and psutil.pid_exists(os.getpid())
    finally:
        bystander.kill()
        bystander.wait()


def test_close_kills_a_running_command_and_deletes_the_copy(repo: Path, new_children) -> None:
    async def go() -> None:
        box = await Sandbox.create(repo, limits=SandboxLimits(timeout_s=60))
        task = asyncio.ensure_future(box.exec("sleep 987656"))
        deadline = time.monotonic() + 10
        while not _live_with("sleep 987656") and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert _live_with("sleep 987656")
        await box.close()
        r = await task
        assert r.exit_code != 0
        await box.close()                     # idempotent
        assert not box.workdir.exists() and not box.home.exists()
        with pytest.raises(RuntimeError, match="closed"):
            await box.exec("true")
    run(go())
    assert not _wait_gone("sleep 987656")
    assert not new_children()


def test_pool_bounds_live_sandboxes_and_records_waits(repo: Path) -> None:
    pool = SandboxPool(2, limits=SandboxLimits(timeout_s=20))
    live: list[int] = []
    peak = [0]

    async def one(i: int) -> str:
        async with pool.sandbox(repo) as box:
            live.append(i)
            peak[0] = max(peak[0], len(live))
            r = await box.exec(f"echo {i} > mine; sleep 0.2; cat mine")
            live.remove(i)
            return r.output.strip()

    async def go() -> list[str]:
        return await asyncio.gather(*(one(i) for i in range(5)))
    outs = run(go())
    assert outs == [str(i) for i in range(5)]
    s = pool.stats()
    assert peak[0] == 2 and s["peak_live"] == 2 and s["max_live"] == 2 and s["live"] == 0
    assert s["starts"] == 5 and s["waits"] >= 3 and s["wait_s_total"] > 0 and s["exec_count"] == 5
    assert not list(runtime.root().glob("box-*/owner.json")) or all(
        json.loads(f.read_text())["owner_pid"] != os.getpid() for f in runtime.root().glob("box-*/owner.json"))


def test_diff_and_apply_patch_round_trip(repo: Path, tmp_path: Path) -> None:
    async def go() -> str:
        async with await Sandbox.create(repo) as box:
            assert await box.diff() == ""
            r = await box.exec("sed -i 's/a - b/a + b/' pkg/calc.py && printf 'new\\n' > pkg/extra.py && "
                               "rm test_calc.py && printf 'changed, still no newline' > notes.txt && "
                               "python3 -c 'import pkg.calc' && mkdir -p pkg/__pycache__")
            assert r.exit_code == 0, r.output
            return await box.diff()
    patch = run(go())
    assert "--- a/pkg/calc.py\n+++ b/pkg/calc.py" in patch and "+++ /dev/null" in patch and "--- /dev/null" in patch
    assert "__pycache__" not in patch and "\\ No newline at end of file" in patch
    fresh = tmp_path / "fresh"
    shutil.copytree(repo, fresh)
    changed = apply_patch(fresh, patch)
    assert changed == ["notes.txt", "pkg/calc.py", "pkg/extra.py", "test_calc.py"]
    assert "return a + b" in (fresh / "pkg/calc.py").read_text() and not (fresh / "test_calc.py").exists()
    assert (fresh / "notes.txt").read_text() == "changed, still no newline"
    assert (fresh / "pkg/extra.py").read_text() == "new\n"
    # hunks of excluded files are skipped
    again = tmp_path / "again"
    shutil.copytree(repo, again)
    assert apply_patch(again, patch, exclude=lambda rel: rel.startswith("test_")) == [
        "notes.txt", "pkg/calc.py", "pkg/extra.py"]
    assert (again / "test_calc.py").read_text() == (repo / "test_calc.py").read_text()


def test_diff_does_not_follow_symlinks_out_of_the_copy(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "etc").mkdir(parents=True)
    (src / "etc" / "passwd").write_text("mine\n")

    async def go() -> str:
        async with await Sandbox.create(src) as box:
            r = await box.exec("rm -r etc && ln -s /etc etc && ln -s /etc/hostname host")
            assert r.exit_code == 0, r.output
            return await box.diff()
    patch = run(go())
    assert "root:" not in patch and patch.startswith("--- a/etc/passwd\n+++ /dev/null"), patch


def test_apply_patch_refuses_escapes_and_bad_hunks(repo: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside.txt"
    outside.write_text("x\n")
    for header in ("a/../outside.txt", str(outside), "b/pkg/../../outside.txt"):
        evil = f"--- {header}\n+++ {header}\n@@ -1 +1 @@\n-x\n+y\n"
        with pytest.raises(ValueError, match="patch path"):
            apply_patch(repo, evil)
    (repo / "link").symlink_to(tmp_path)
    with pytest.raises(ValueError, match="outside the work folder"):
        apply_patch(repo, "--- a/link/outside.txt\n+++ b/link/outside.txt\n@@ -1 +1 @@\n-x\n+y\n")
    assert outside.read_text() == "x\n"
    before = (repo / "pkg/calc.py").read_text()
    bad = ("--- a/pkg/calc.py\n+++ b/pkg/calc.py\n@@ -1,2 +1,2 @@\n def add(a, b):\n-    return a - b\n"
           "+    return a + b\n"
           "--- a/notes.txt\n+++ b/notes.txt\n@@ -1 +1 @@\n-not what is there\n+y\n")
    with pytest.raises(ValueError, match=r"notes.txt: hunk 1 .*does not apply"):
        apply_patch(repo, bad)
    assert (repo / "pkg/calc.py").read_text() == before        # all or nothing


def test_cleanup_after_the_driver_is_killed(repo: Path) -> None:
    rt = Path(tempfile.mkdtemp(prefix="mixfleet-sandboxes-test-", dir="/tmp"))
    os.chmod(rt, 0o755)
    env = {**os.environ, "MIXFLEET_SANDBOX_DIR": str(rt)}
    driver = ("import asyncio, sys\nfrom pathlib import Path\nfrom mixfleet.runner.rollout.sandbox import Sandbox\n"
              "async def main():\n    box = await Sandbox.create(Path(sys.argv[1]))\n"
              "    t = asyncio.ensure_future(box.exec('sleep 987657', timeout_s=300))\n"
              "    await asyncio.sleep(0.5)\n    print(box.workdir, flush=True)\n    await t\nasyncio.run(main())\n")
    try:
        proc = subprocess.Popen([sys.executable, "-c", driver, str(repo)], env=env, stdout=subprocess.PIPE, text=True)
        workdir = Path(proc.stdout.readline().strip())
        assert workdir.is_dir() and _live_with("sleep 987657")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        assert workdir.is_dir()                      # left behind by the killed driver
        out = subprocess.run([sys.executable, "-m", "mixfleet.ui.cli", "cleanup", "--json"], env=env,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        report = json.loads(out.stdout)
        assert [r["path"] for r in report["removed"]] == [str(workdir.parent)] and report["removed"][0]["removed"]
        assert not workdir.parent.exists() and not os.path.ismount(workdir)
        assert not _wait_gone("sleep 987657") and not _wait_gone(str(workdir))
        again = subprocess.run([sys.executable, "-m", "mixfleet.ui.cli", "cleanup"], env=env, capture_output=True,
                               text=True, timeout=60)
        assert "0 sandbox(es) removed" in again.stdout
    finally:
        runtime_env = os.environ.get("MIXFLEET_SANDBOX_DIR")
        os.environ["MIXFLEET_SANDBOX_DIR"] = str(rt)
        try:
            runtime.cleanup(all_owners=True)
        finally:
            if runtime_env is None:
                os.environ.pop("MIXFLEET_SANDBOX_DIR", None)
            else:
                os.environ["MIXFLEET_SANDBOX_DIR"] = runtime_env
        shutil.rmtree(rt, ignore_errors=True)


def test_cleanup_kills_what_still_runs_on_a_dead_drivers_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rt = Path(tempfile.mkdtemp(prefix="mixfleet-sandboxes-test-", dir="/tmp"))
    monkeypatch.setenv("MIXFLEET_SANDBOX_DIR", str(rt))
    try:
        home = runtime.new_dir("box")
        (home / "repo").mkdir()
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()
        marker = json.loads((home / "owner.json").read_text())
        (home / "owner.json").write_text(json.dumps({**marker, "owner_pid": dead.pid}))
        live = runtime.new_dir("box")                     # owned by this (live) process: kept
        straggler = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", str(home / "repo")],
                                     start_new_session=True)
        runtime.add_pid(home, straggler.pid)
        removed = runtime.cleanup()
        assert [r["path"] for r in removed] == [str(home)] and removed[0]["killed_pids"] == [straggler.pid]
        straggler.wait(timeout=10)                        # (cleanup's psutil wait may have reaped it already)
        assert not _live_with(str(home / "repo"))
        assert not home.exists() and live.exists()
    finally:
        shutil.rmtree(rt, ignore_errors=True)
