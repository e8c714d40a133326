"""What an audit of the simulated cluster and its demo found, each kept from coming back.

A refused fault plan that broke the cluster's group for good, end-state arguments
refused only after the destructive reset, transport errors naming world ranks, a
stale checkpoint that called a healthy loader corrupted, faults on parameters that
do not exist, and ``wcviz demo``'s tracebacks on bad flags and Ctrl-C. Two small
clusters serve the tests that need ranks: TP 2 with ``verify="log"`` and TP 1 with
``verify="enforce"``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from wcviz.refit import FaultPlan
from wcviz.refit.faults import Fault
from wcviz.sim import TINY, Cluster, ClusterError, EngineLayout, LoaderFaults

ROOT = Path(__file__).resolve().parents[1]
NORM = "model.norm.weight"


@pytest.fixture(scope="module")
def cluster():
    """TP 2 (engine ranks 0 and 1; world ranks 1 and 2), transport check ``log``, mutations allowed."""
    with Cluster(TINY, EngineLayout(tp=2, pp=1), verify="log", allow_mutations=True, timeout_s=60) as c:
        yield c


@pytest.fixture
def healthy(cluster: Cluster) -> Cluster:
    cluster.set_faults(None)
    cluster.refit()
    return cluster


@pytest.fixture(scope="module")
def enforcing():
    """One engine rank (world rank 1), transport check ``enforce``."""
    with Cluster(TINY, EngineLayout(tp=1, pp=1), verify="enforce", timeout_s=60) as c:
        yield c


# --------------------------------------------------------------------------- a fault plan the trainer refuses


def test_a_plan_the_broadcast_cannot_apply_is_refused_before_any_rank_is_told(healthy: Cluster) -> None:
    """It hung for timeout_s and left the group broken: every later refit failed."""
    bad = FaultPlan((Fault("flip_bit", "sender_after_digest", params=(NORM,), ranks=(1,)),))
    with pytest.raises(ValueError, match=r"fault flip_bit at sender_after_digest cannot be limited to ranks \[1\]"):
        healthy.refit(wire=bad)
    with pytest.raises(TypeError, match="faults must be a wcviz.refit.FaultPlan, got list"):
        healthy.refit(wire=list(bad.faults))  # type: ignore[arg-type]
    assert healthy.refit().ok


def test_a_trainer_that_cannot_build_its_sender_tells_the_engines_and_the_next_refit_works(healthy: Cluster) -> None:
    """Past the driver's check (a plan straight to the ranks), the trainer's own refusal still reaches every engine
    in prepare's barrier: each says why, none reports a dead peer, and the group stays usable."""
    world_plan = FaultPlan((Fault("flip_bit", "sender_after_digest", params=(NORM,), ranks=(2,)),))
    keys = [healthy._trainer, *healthy._engine_keys()]
    with pytest.raises(ClusterError) as info:
        healthy._call(keys, "refit", wire=world_plan)
    message = str(info.value)
    assert "refit failed on 3 ranks: trainer rank 0: ValueError: fault flip_bit at sender_after_digest" in message
    assert message.count("RefitProtocolError: refit broadcast: the sender aborted the refit at prepare") == 2
    assert "peer is dead" not in message
    assert healthy.refit().ok and healthy.endstate().ok


# --------------------------------------------------------------------------- end-state arguments


@pytest.mark.parametrize(
    ("faults", "error", "match"),
    [
        ({7: LoaderFaults()}, ValueError, r"engine rank\(s\) \[7\] outside 0..1"),
        ({0: LoaderFaults(tp_as=2)}, ValueError, r"engine rank 0: LoaderFaults.tp_as=2 is outside tp 0..1"),
        ("stale", TypeError, "faults must be LoaderFaults"),
    ],
)
def test_bad_endstate_faults_are_refused_before_the_reset(
    healthy: Cluster, monkeypatch: pytest.MonkeyPatch, faults: object, error: type, match: str
) -> None:
    """They were set only before the reload: the reset had already poisoned every engine."""
    import wcviz.endstate

    def ran(*args: object, **kwargs: object) -> None:
        pytest.fail("the end-state check (and its reset) ran with faults it then refused")

    monkeypatch.setattr(wcviz.endstate, "run", ran)
    with pytest.raises(error, match=match):
        healthy.endstate(faults=faults)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- reload from a checkpoint


def test_a_stale_checkpoint_is_not_what_the_engines_reload(healthy: Cluster) -> None:
    """Saved at step k, then a step and a refit: the reload loaded step k and called a healthy loader corrupted."""
    healthy.step()
    healthy.refit()
    old = healthy.save_checkpoint()
    healthy.step()
    assert healthy.refit().ok
    report = healthy.endstate(reload="checkpoint")
    assert report.ok, report.summary
    assert healthy.checkpoint is not None and healthy.checkpoint.name == f"checkpoint-step{healthy.step_k}"
    assert report.notes == [
        f"the last checkpoint ({old.name}) was of step {healthy.step_k - 1}, the engines were last refit with step "
        f"{healthy.step_k}: the reload used a fresh one"
    ]


def test_a_checkpoint_of_what_the_engines_hold_stays_when_the_trainer_steps_on(healthy: Cluster) -> None:
    """The trainer stepped, the engines were not refit: they reload the step they hold, not the trainer's new one."""
    held = healthy.save_checkpoint()
    healthy.step()  # no refit: the engines still hold the checkpoint's step
    report = healthy.endstate(reload="checkpoint")
    assert report.ok and report.notes == [], report.summary
    assert healthy.checkpoint == held


def test_a_checkpoint_of_an_older_step_is_written_without_moving_the_trainer(healthy: Cluster) -> None:
    """No checkpoint of the engines' step yet, the trainer past it: the trainer writes that step's weights."""
    engines_at = healthy.step()
    healthy.refit()  # the last checkpoint, if any, is of an older step
    healthy.step()  # the trainer moves on, the engines do not
    report = healthy.endstate(reload="checkpoint")
    assert report.ok, report.summary
    assert healthy.checkpoint is not None and healthy.checkpoint.name == f"checkpoint-step{engines_at}"
    assert healthy.step() == engines_at + 2  # the trainer had stayed at its own step


# --------------------------------------------------------------------------- errors name engine ranks


def test_a_refit_error_names_the_engine_rank_not_the_world_rank(enforcing: Cluster) -> None:
    """Engine rank 0 is world rank 1 of the broadcast: the error said "rank 1"."""
    enforcing.step()
    flip = FaultPlan((Fault("flip_bit", "wire", params=(NORM,), ranks=(0,)),))
    with pytest.raises(ClusterError) as info:
        enforcing.refit(wire=flip)
    assert f"BroadcastDigestMismatch: engine rank 0: refit verification failed for 1 of 30 parameters; digest differs: {NORM}" in str(info.value)
    assert enforcing.refit().ok


# --------------------------------------------------------------------------- faults on parameters that do not exist


@pytest.mark.parametrize(
    ("kind", "params"),
    [("flip_bit", ("model.nrom.weight",)), ("drop_param", ("model.nrom.weight",)),
     ("swap_params", ("model.nrom.weight", "model.layers.0.self_attn.qkv_proj.weight"))],
)  # fmt: skip
def test_a_fault_on_a_parameter_never_sent_is_refused_naming_the_nearest(
    enforcing: Cluster, kind: str, params: tuple[str, ...]
) -> None:
    """Under enforce too, a misspelt fault was a silent no-op and the refit passed."""
    with pytest.raises(ClusterError) as info:
        enforcing.refit(wire=FaultPlan((Fault(kind, "wire", params=params),)))
    message = str(info.value)
    assert f"ValueError: fault {kind} at wire names 'model.nrom.weight', which is not among the 30 parameters sent (nearest: {NORM}" in message
    assert "the sender aborted the stream" in message  # the engine was told, not left waiting
    assert enforcing.refit().ok


# --------------------------------------------------------------------------- wcviz demo: bad flags and Ctrl-C


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--tp", "3"], "wcviz demo: error: --tp 3: the demo's model cannot be split so: tp_size 3 must divide ModelConfig.heads (4)"),
        (["--pp", "4"], "wcviz demo: error: --pp 4: the demo's model cannot be split so: pp_size 4 exceeds ModelConfig.layers (3)"),
        (["--tp", "0"], "wcviz demo: error: --tp 0: must be 1 or more"),
        (["--fault", "swap", "--tp", "1"], "wcviz demo: error: --fault swap needs --tp 2 or more"),
        (["--out", "{file}"], "wcviz demo: error: --out {file}: cannot create that directory"),
    ],
)
def test_demo_bad_flags_are_one_line_naming_the_flag_and_exit_2(tmp_path: Path, flags: list[str], said: str) -> None:
    """--tp 3, --pp 4 and an --out that is a file printed a traceback and exited 1 (the demo's "not as expected")."""
    afile = tmp_path / "afile"
    afile.write_text("")
    argv = [a.replace("{file}", str(afile)) for a in flags]
    run = subprocess.run(
        [sys.executable, "-m", "wcviz", "demo", *argv, "--no-progress"], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert run.returncode == 2, run.stdout + run.stderr
    assert run.stdout == "" and len(run.stderr.splitlines()) == 1, run.stderr
    assert run.stderr.startswith(said.replace("{file}", str(afile))), run.stderr


def test_demo_ctrl_c_is_one_line_and_exit_130(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The demo bypassed the CLI's handling: Ctrl-C was a traceback and exit 1."""
    import wcviz.demo
    from wcviz.cli import main

    def interrupted(*args: object, **kwargs: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(wcviz.demo, "run", interrupted)
    try:
        code = main(["demo", "--out", str(tmp_path / "out"), "--no-progress"])
    except KeyboardInterrupt:
        pytest.fail("wcviz demo let Ctrl-C out as a traceback")
    assert code == 130 and capsys.readouterr().err == "wcviz: interrupted\n"


def test_demo_sigint_while_the_cluster_runs_stops_every_rank_and_exits_130(tmp_path: Path) -> None:
    """A real Ctrl-C once the ranks are up: one line, exit 130, and no rank outlives the demo."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "wcviz", "demo", "--out", str(tmp_path / "out"), "--no-progress", "--tp", "1", "--pp", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:  # "[1] up", a line per rank with its pid, then "[2]" once the first refit is done
            lines.append(line)
            if line.startswith("[2]"):
                break
        pids = [int(line.split(" pid ")[1].split()[0]) for line in lines if " pid " in line]
        assert pids, "".join(lines)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130 and err.strip().splitlines()[-1] == "wcviz: interrupted", err
    assert "Traceback" not in err
    for pid in pids:
        stat = Path(f"/proc/{pid}/stat")
        assert not stat.exists() or stat.read_text().split()[2] == "Z", f"rank process {pid} outlived the demo"


def test_the_demo_exit_status_of_a_verdict_not_as_expected_stays_1(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Routing the demo through the CLI's error handling keeps its own exit statuses."""
    import wcviz.demo
    from wcviz.cli import main

    monkeypatch.setattr(wcviz.demo, "run", lambda *a, **k: 1)
    assert main(["demo", "--out", str(tmp_path / "out"), "--no-progress"]) == 1
    assert os.path.isdir(tmp_path / "out")  # --out is made (and checked) before anything starts
