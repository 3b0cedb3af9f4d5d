"""`mixfleet` commands: ui: the Streamlit app (plan a fleet mix, dry-run it, follow runs).

`mixfleet ui` starts `streamlit run ui/app.py` as a child process, headless, without usage
statistics, bound to 127.0.0.1 on a free port unless told otherwise, and prints the URL. The runs
folder the Runs page lists is passed to the app in MIXFLEET_RUNS_DIR, a calibration file (used by
the Runs page's twin fidelity check) in MIXFLEET_CALIBRATION. The child ends with the command: Ctrl-C,
SIGTERM and SIGHUP are passed on to it, and on Linux it is told to exit if the command dies (even by kill -9).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import typer

DEFAULT_HOST = "127.0.0.1"
RUNS_DIR_ENV = "MIXFLEET_RUNS_DIR"
CALIBRATION_ENV = "MIXFLEET_CALIBRATION"


def free_port(host: str = DEFAULT_HOST) -> int:
    """A TCP port nothing listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    """In the child, before exec (Linux): SIGTERM when the parent dies, whatever kills it (prctl PR_SET_PDEATHSIG)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGTERM, 0, 0, 0)      # 1 = PR_SET_PDEATHSIG


def app_path() -> Path:
    """The Streamlit entry script."""
    return Path(__file__).resolve().parents[1] / "app.py"


def streamlit_argv(port: int, host: str = DEFAULT_HOST) -> list[str]:
    """The command line that serves the app: headless, no telemetry, no file watcher."""
    return [sys.executable, "-m", "streamlit", "run", str(app_path()),
            "--server.port", str(port), "--server.address", host,
            "--server.headless", "true", "--browser.gatherUsageStats", "false",
            "--server.fileWatcherType", "none", "--server.runOnSave", "false",
            "--global.developmentMode", "false", "--client.toolbarMode", "viewer"]


def register(app: typer.Typer) -> None:
    """Add this module's commands to the `mixfleet` app."""

    @app.command("ui")
    def ui_cmd(
        port: int = typer.Option(0, "--port", help="TCP port (0 = a free one)."),
        host: str = typer.Option(DEFAULT_HOST, "--host", help="Address to bind (default loopback only)."),
        runs_dir: Path = typer.Option(Path("runs"), "--runs-dir", help="Folder the Runs page lists run logs from."),
        calibration: Path = typer.Option(None, "--calibration",
                                         help="Calibration TOML (mixfleet calibrate) offered first on the Runs page."),
    ) -> None:
        """Start the web app (Plan, Dry-run, Runs) and print its URL."""
        if not 0 <= port <= 65535:
            typer.echo(f"error: --port {port}: allowed: 0 (a free port) or 1..65535", err=True)
            raise typer.Exit(code=2)
        if runs_dir.exists() and not runs_dir.is_dir():
            typer.echo(f"error: --runs-dir {runs_dir}: allowed: a folder (this is a file)", err=True)
            raise typer.Exit(code=2)
        try:
            port = port or free_port(host)
        except OSError as e:
            typer.echo(f"error: --host {host}: cannot bind there ({e}); allowed: a local address such as 127.0.0.1",
                       err=True)
            raise typer.Exit(code=2) from None
        env = dict(os.environ)
        env[RUNS_DIR_ENV] = str(runs_dir.resolve())
        if calibration is not None:
            if not calibration.is_file():
                typer.echo(f"error: --calibration {calibration}: allowed: an existing TOML file written by "
                           "`mixfleet calibrate`", err=True)
                raise typer.Exit(code=2)
            env[CALIBRATION_ENV] = str(calibration.resolve())
        env.setdefault("STREAMLIT_BROWSER_GATHER_USAGE_STATS", "false")
        typer.echo(f"mixfleet ui: http://{host}:{port}  (runs dir: {runs_dir.resolve()}; Ctrl-C stops it)")
        proc = subprocess.Popen(streamlit_argv(port, host), env=env,
                                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)

        def stop_child(_signum: int, _frame: object) -> None:
            proc.terminate()                       # the wait below returns once Streamlit has shut down

        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, stop_child)
        try:
            rc = proc.wait()
        except KeyboardInterrupt:
            proc.terminate()
            try:
                rc = proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = proc.wait()
        raise typer.Exit(code=0 if rc in (0, -15) else rc)
