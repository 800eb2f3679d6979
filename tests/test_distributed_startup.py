"""Start-up settings and hybrid-mesh placement (pure functions: no processes started)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from meshtrain import distributed as dist
from meshtrain import peer_errors
from meshtrain import get_recipe
from meshtrain.errors import MeshError
from meshtrain.mesh import MeshSpec

EXPLICIT = {dist.ENV_COORDINATOR: "10.1.2.3:5000", dist.ENV_NUM_PROCESSES: "4", dist.ENV_PROCESS_ID: "3"}


def test_nothing_set_means_single_process():
    assert dist.resolve(environ={}) is None


def test_explicit_environment():
    c = dist.resolve(environ=EXPLICIT)
    assert (c.coordinator, c.num_processes, c.process_id, c.source) == ("10.1.2.3:5000", 4, 3, dist.Source.EXPLICIT)
    assert c.bind is None  # initialize() binds the coordinator address itself, not every interface


def test_flags_override_environment():
    cfg = dist.DistributedConfig.from_env(EXPLICIT, process_id=0, coordinator="127.0.0.1:7000", bind="0.0.0.0:7000")
    c = dist.resolve(cfg, environ=EXPLICIT)
    assert (c.coordinator, c.process_id, c.bind) == ("127.0.0.1:7000", 0, "0.0.0.0:7000")


def test_jax_coordinator_variable_is_accepted():
    env = {"JAX_COORDINATOR_ADDRESS": "h:1", dist.ENV_NUM_PROCESSES: "2", dist.ENV_PROCESS_ID: "1"}
    assert dist.resolve(environ=env).coordinator == "h:1"


def test_off_wins():
    assert dist.resolve(environ=dict(EXPLICIT, **{dist.ENV_MODE: "off"})) is None


def test_one_process_is_not_distributed_unless_forced():
    env = dict(EXPLICIT, **{dist.ENV_NUM_PROCESSES: "1", dist.ENV_PROCESS_ID: "0"})
    assert dist.resolve(environ=env) is None
    assert dist.resolve(environ=dict(env, **{dist.ENV_MODE: "on"})).num_processes == 1


@pytest.mark.parametrize("drop, named", [(dist.ENV_NUM_PROCESSES, dist.ENV_NUM_PROCESSES),
                                         (dist.ENV_PROCESS_ID, dist.ENV_PROCESS_ID),
                                         (dist.ENV_COORDINATOR, dist.ENV_COORDINATOR)])
def test_missing_setting_is_named(drop, named):
    env = {k: v for k, v in EXPLICIT.items() if k != drop}
    with pytest.raises(dist.DistributedError, match=named):
        dist.resolve(environ=env)


@pytest.mark.parametrize("env, match", [
    (dict(EXPLICIT, **{dist.ENV_PROCESS_ID: "4"}), "outside 0..3"),
    (dict(EXPLICIT, **{dist.ENV_COORDINATOR: "10.1.2.3"}), "HOST:PORT"),
    (dict(EXPLICIT, **{dist.ENV_NUM_PROCESSES: "two"}), "not an integer"),
    (dict(EXPLICIT, **{dist.ENV_TIMEOUT: "soon"}), "seconds"),
    (dict(EXPLICIT, **{dist.ENV_MODE: "yes"}), "auto"),
    ({dist.ENV_MODE: "on"}, dist.ENV_COORDINATOR),
])
def test_bad_settings_say_what_to_change(env, match):
    with pytest.raises(dist.DistributedError, match=match):
        dist.resolve(environ=env)


SRUN = {"SLURM_JOB_ID": "4242", "SLURM_STEP_NUM_TASKS": "8", "SLURM_PROCID": "5", "SLURM_LOCALID": "1",
        "SLURM_STEP_NODELIST": "gpu[017-018,020],login1", "SLURM_STEP_TASKS_PER_NODE": "4(x2)"}


def test_slurm_inside_srun():
    c = dist.resolve(environ=SRUN)
    assert c.source is dist.Source.SLURM
    assert c.coordinator.startswith("gpu017:") and (c.num_processes, c.process_id) == (8, 5)
    assert c.local_device_ids == (1,)  # 4 tasks per node: one accelerator per task
    one_per_node = dist.resolve(environ=dict(SRUN, SLURM_STEP_TASKS_PER_NODE="1(x8)"))
    assert one_per_node.local_device_ids is None  # one task per node: all its accelerators
    # Every task derives the same port; MESHTRAIN_COORDINATOR_PORT overrides it.
    assert dist.resolve(environ=dict(SRUN, SLURM_PROCID="0")).coordinator == c.coordinator
    assert dist.resolve(environ=dict(SRUN, **{dist.ENV_PORT: "6000"})).coordinator == "gpu017:6000"


def test_slurm_batch_script_itself_is_not_a_job_step():
    env = {k: v for k, v in SRUN.items() if not k.startswith("SLURM_STEP")}
    assert dist.resolve(environ=env) is None


@pytest.mark.parametrize("nodes, first", [("node7", "node7"), ("a1,b2", "a1"), ("gpu[003-008,011],cpu1", "gpu003"),
                                          ("n[12,4]", "n12"), ("rack[2-3]-ib,x", "rack2-ib")])
def test_slurm_first_host(nodes, first):
    assert dist._slurm_first_host(nodes) == first


def _devices(processes, per_process, platform="cpu", slices=None):
    out = []
    for p in range(processes):
        for k in range(per_process):
            slice_index = 0 if slices is None else p * slices // processes
            out.append(SimpleNamespace(id=p * 1000 + k, process_index=p, platform=platform, slice_index=slice_index))
    return out


def test_auto_dcn_puts_replicas_across_processes():
    hsdp = get_recipe("hsdp").mesh
    spec = dist.auto_dcn(hsdp, _devices(2, 4))
    assert (dict(spec.dcn), dict(spec.ici)) == ({"data": 2}, {"data": 1, "fsdp": 4})
    assert spec.resolve(8) == hsdp.resolve(8)  # total sizes unchanged
    fsdp = dist.auto_dcn(get_recipe("fsdp").mesh, _devices(2, 4))
    assert (dict(fsdp.dcn), dict(fsdp.ici)) == ({"fsdp": 2}, {"fsdp": 4})
    # 4 processes, 2 replicas: each replica's FSDP group spans 2 processes.
    four = dist.auto_dcn(hsdp, _devices(4, 4))
    assert (dict(four.dcn), dict(four.ici)) == ({"data": 2, "fsdp": 2}, {"data": 1, "fsdp": 4})


def test_auto_dcn_leaves_single_granules_and_explicit_dcn_alone():
    hsdp = get_recipe("hsdp").mesh
    assert dist.auto_dcn(hsdp, _devices(1, 8)) is hsdp
    assert dist.auto_dcn(hsdp, _devices(4, 2, platform="tpu")) is hsdp  # one TPU slice: ICI throughout
    given = MeshSpec(ici={"fsdp": -1}, dcn={"data": 2})
    assert dist.auto_dcn(given, _devices(2, 4)) is given


def test_tpu_slices_are_the_granules():
    assert dist.granules(_devices(4, 4, platform="tpu", slices=2)) == 2
    assert dist.granules(_devices(4, 4, platform="cpu")) == 4


def test_dcn_that_does_not_fit_is_explained():
    uneven = _devices(3, 2)[:5]  # 5 devices from 3 processes
    with pytest.raises(MeshError, match="spread over 3"):
        dist.auto_dcn(MeshSpec(ici={"fsdp": -1}), uneven)
    with pytest.raises(MeshError, match="does not divide"):
        dist.split_dcn(get_recipe("hsdp").mesh, 8, {"data": 3})
    with pytest.raises(MeshError, match="not part of this mesh"):
        dist.split_dcn(get_recipe("fsdp").mesh, 8, {"data": 2})


def test_cli_flags_reach_the_start_up():
    from meshtrain.cli import build_parser

    args = build_parser().parse_args(["train", "--coordinator", "h:1", "--num-processes", "2", "--process-id", "1",
                                      "--init-timeout", "5", "--coordinator-bind", "0.0.0.0:1"])
    cfg = dist.config_from_args(args)
    assert (cfg.init_timeout_s, cfg.bind) == (5.0, "0.0.0.0:1")
    c = dist.resolve(cfg, environ={})
    assert (c.coordinator, c.num_processes, c.process_id) == ("h:1", 2, 1)
    off = dist.config_from_args(build_parser().parse_args(["train", "--distributed", "off"]))
    assert dist.resolve(off, environ=EXPLICIT) is None


GLOO = ("UNKNOWN: Gloo AllGather failed: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error "
        "[127.0.0.1]:45267: Connection reset by peer")


@pytest.mark.parametrize("n, env, who, then", [
    (2, {}, "process 1 stopped answering", "the run stops; continue it with --resume"),
    (2, {"MESHTRAIN_ATTEMPT": "1"}, "process 1 stopped answering", "the launcher restarts the job"),
    (3, {}, "another process (of 1, 2) stopped answering", "the run stops"),
])
def test_a_dead_peer_is_one_line_naming_it(n, env, who, then, monkeypatch, tmp_path):
    monkeypatch.setattr(dist, "_current", dist.Cluster("h:1", n, 0, dist.Source.EXPLICIT))
    try:
        raise RuntimeError(GLOO)
    except RuntimeError as exc:
        line = peer_errors.peer_failure(exc, environ=env)
        path = peer_errors.keep_traceback(exc, str(tmp_path))
    assert line.startswith(f"[process 0] {who} (UNKNOWN: Gloo AllGather failed: Read error [127.0.0.1]:45267: "
                           f"Connection reset by peer); {then}"), line
    assert "\n" not in line and "pair.cc" not in line
    assert path == str(tmp_path / "error-0.txt") and "Traceback" in open(path).read() and GLOO in open(path).read()
    assert peer_errors.peer_failure(ValueError("a bug of ours"), environ=env) is None   # anything else keeps its traceback


def test_a_single_process_error_is_never_a_dead_peer():
    assert peer_errors.peer_failure(RuntimeError(GLOO)) is None


def test_the_heartbeat_timeout_stays_above_twice_the_hang_bound():
    """A frozen process must be found by the hang watchdog (exit 75, naming it), not by the coordination
    service's heartbeat check (SIGABRT of every peer, no diagnosis)."""
    assert dist.heartbeat_timeout_s(None) == dist.heartbeat_timeout_s(6) == 100
    assert dist.heartbeat_timeout_s(88) == 206 and dist.heartbeat_timeout_s(88) > 2 * 88
    assert [dist.heartbeat_timeout_s(x) for x in (float("nan"), float("inf"), -1, 0)] == [100] * 4
    from meshtrain.cli import build_parser

    args = build_parser().parse_args(["train", "--hang-timeout", "88"])
    assert dist.config_from_args(args).hang_timeout_s == 88
