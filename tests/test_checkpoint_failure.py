"""A checkpoint that cannot be written (issue 44, third probe: `--out` on a full 60 MB tmpfs ended in a ~150-line
Ray traceback with "no space" nowhere). What the run's one line is made of, tested without a mount: the trainer's
`save_state` writing a real trainer state (39 MB for `tiny`) past a file-size limit (RLIMIT_FSIZE, so torch's
own writer fails the way it does on a full disk: "file write failed" / "unexpected pos"), in a child process.

- with the filesystem reading full, the failure is an OSError ENOSPC naming the file, and `write_failure` (what
  the orchestrator's one line says) reads "no space left on device";
- otherwise the writer's own error is kept (no false "no space");
- either way no cut temp folder is left and the previous checkpoint is untouched, and once the cause is gone the
  same trainer saves and the state loads back (resumable). The run-level roll-back after a checkpoint that never
  completed is the crash-point chain's (tests/test_run_crash_points.py).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

CHILD = r"""
import errno, json, resource, shutil, signal, sys, warnings
from pathlib import Path
warnings.filterwarnings("ignore")
from mixfleet.costmodel.specs.model import load_model_spec
from mixfleet.runner.orchestration.failures import write_failure
from mixfleet.runner.trainer import trainer as tr
from mixfleet.runner.trainer.megatron_model import BuildOptions

root = Path(sys.argv[1])
t = tr.Trainer(load_model_spec("tiny"), tr.TrainerConfig(build=BuildOptions(device="cpu", seed=1)))
state = root / "trainer_state"
t.save_state(state)                                   # the previous checkpoint, whole
before = (state / tr.STATE_FILE).read_bytes()
t.version = 1
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)         # a write past the limit fails (EFBIG) instead of killing
resource.setrlimit(resource.RLIMIT_FSIZE, (8 << 20, hard))
out = {}
try:
    t.save_state(state)
except Exception as e:
    out["plain"] = [type(e).__name__, str(e), write_failure(e, state)]
real = shutil.disk_usage
tr.shutil.disk_usage = lambda p: real(p)._replace(free=0)      # the filesystem reads full, as on the tmpfs
try:
    t.save_state(state)
except Exception as e:
    out["full"] = [type(e).__name__, getattr(e, "errno", None) == errno.ENOSPC, str(e), write_failure(e, state)]
tr.shutil.disk_usage = real
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))         # the cause gone
out["left"] = sorted(p.name for p in root.iterdir())
out["previous_kept"] = (state / tr.STATE_FILE).read_bytes() == before
t.save_state(state)
out["resumed_version"] = tr.Trainer.resume(state).version
print("RESULT " + json.dumps(out))
"""


def test_a_checkpoint_that_cannot_be_written_is_named_and_leaves_the_last_one(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], capture_output=True, text=True, timeout=600)
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and line, (r.stdout[-2000:], r.stderr[-3000:])
    import json

    out = json.loads(line[0][len("RESULT "):])
    kind, text, cause = out["plain"]
    assert kind != "OSError" or "No space" not in text, out["plain"]            # not full: the writer's own error
    assert cause != "no space left on device" and cause.startswith(kind), out["plain"]
    kind, enospc, text, cause = out["full"]
    assert kind == "OSError" and enospc, out["full"]
    assert text.startswith("[Errno 28] No space left on device writing ") and "trainer_state.pt (RuntimeError: " in text
    assert cause == "no space left on device", out["full"]
    assert out["left"] == ["trainer_state"], out["left"]                        # no cut temp folder left
    assert out["previous_kept"]
    assert out["resumed_version"] == 1
