"""The cluster paths without a cluster: reading SLURM's and Open MPI's environment (checked against JAX's
own detection), the job shape refused before JAX starts, the sbatch script of `launch slurm` (its
exit-75 requeue run with stand-ins for srun/scontrol), and the JobSet of `launch k8s` against the
JobSet CRD's published OpenAPI schema (tests/launch/jobset/) and the experiment's mesh."""

import json
import math
import os
import re
import shlex
import subprocess

import pytest
import yaml

from helpers import REPO
from helpers.cli import assert_one_paragraph, invoke
from helpers.multidevice import run_with_devices

# What srun gave each task of `srun -n 2` on the one-node test cluster (tests/helpers/slurm.py).
SLURM_TASK = {
    "SLURM_JOB_ID": "1234",
    "SLURM_STEP_NODELIST": "localhost",
    "SLURM_NTASKS": "2",
    "SLURM_PROCID": "1",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "0",
    "SLURM_STEP_TASKS_PER_NODE": "2",
    "SLURM_TASKS_PER_NODE": "2",
}
# What mpirun -np 2 gave rank 1 (Open MPI 4, Debian 12's openmpi-bin).
OMPI_RANK = {
    "OMPI_COMM_WORLD_SIZE": "2",
    "OMPI_COMM_WORLD_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    "OMPI_MCA_orte_hnp_uri": "1244594176.0;tcp://127.0.0.1:54237",
}
SCHEMA = json.loads((REPO / "tests/launch/jobset/jobset.x-k8s.io_v1alpha2.schema.json").read_text())


def mesh(ici, dcn=(1, 1, 1)):
    from equipax.core.mesh_config import MeshConfig

    return MeshConfig(ici_mesh_shape=ici, dcn_mesh_shape=dcn)


@pytest.mark.parametrize(
    "env",
    [
        SLURM_TASK,
        {
            **SLURM_TASK,
            "SLURM_STEP_NODELIST": "gpu[007-015,020],login1",
            "SLURM_JOB_ID": "987654",
            "SLURM_NTASKS": "40",
            "SLURM_PROCID": "17",
        },
        {**SLURM_TASK, "SLURM_STEP_NODELIST": "a100-node12,a100-node13", "JAX_COORDINATOR_PORT": "1234"},
        OMPI_RANK,
        {**OMPI_RANK, "OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://10.96.0.1,10.148.0.1:34911;tcp6://[fe80::2]:4337"},
    ],
)
def test_detection_agrees_with_jaxs_own(env, monkeypatch):
    """JAX's cluster detection is the reference: the same coordinator, process count and index."""
    from jax._src.clusters.ompi_cluster import OmpiCluster
    from jax._src.clusters.slurm_cluster import SlurmCluster

    from equipax.launch.cluster.detect import detect_job

    for k in [k for k in os.environ if k.startswith(("SLURM_", "OMPI_", "JAX_COORDINATOR"))]:
        monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    jax_env = SlurmCluster if "SLURM_JOB_ID" in env else OmpiCluster
    assert jax_env.is_env_present()
    job = detect_job(env)
    assert job is not None
    assert job.coordinator == jax_env.get_coordinator_address(None, env.get("JAX_COORDINATOR_PORT"))
    assert (job.num_processes, job.process_id) == (jax_env.get_process_count(), jax_env.get_process_id())
    assert job.local_process_id == jax_env.get_local_process_id()


def test_the_devices_each_process_sees():
    from equipax.launch.cluster.detect import detect_job

    one_per_node = detect_job(
        {
            **SLURM_TASK,
            "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
            "SLURM_LOCALID": "0",
            "SLURM_NODEID": "1",
            "SLURM_GPUS_ON_NODE": "8",
        }
    )
    assert one_per_node is not None and one_per_node.local_device_ids is None  # all 8 (JAX alone: GPU 0 only)
    assert one_per_node.devices_per_process == 8 and one_per_node.processes_on_node == 1
    halves = detect_job({**SLURM_TASK, "SLURM_GPUS_ON_NODE": "8"})
    assert halves is not None and halves.local_device_ids == (4, 5, 6, 7) and halves.devices_per_process == 4
    unknown = detect_job(OMPI_RANK)
    assert unknown is not None and unknown.local_device_ids == (1,) and unknown.devices_per_process is None


def test_joining_turns_jaxs_detection_off(tmp_path):
    """A SLURM task with all 8 GPUs of its node: jax.distributed gets the explicit values and
    cluster_detection_method="deactivate", which keeps JAX from pinning it to GPU 0."""
    out = run_with_devices(
        f"""
        import jax, json, os
        os.environ.update({json.dumps({**SLURM_TASK, "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_GPUS_ON_NODE": "8"})})
        from equipax.launch.cluster import detect, join
        calls = []
        jax.distributed.initialize = lambda **kw: calls.append(kw)
        job = detect.find_job(None, cpu_devices=None)
        join.initialize(join.DistributedArgs(auto=True).joining(job), log=lambda m: None)
        print(json.dumps({{k: calls[0][k] for k in ("coordinator_address", "num_processes", "process_id",
                                                   "local_device_ids", "cluster_detection_method")}}))
    """,
        devices=1,
    )
    assert json.loads(out.splitlines()[-1]) == {
        "coordinator_address": "localhost:62674",
        "num_processes": 2,
        "process_id": 1,
        "local_device_ids": None,
        "cluster_detection_method": "deactivate",
    }


def test_hostlists_and_tasks_per_node():
    from equipax.launch.cluster.detect import first_host, tasks_on_node

    assert first_host("node[007-015,20],login1") == "node007" and first_host("n1,n2") == "n1"
    assert first_host("localhost") == "localhost" and first_host("[3-4]") == "3"
    assert [tasks_on_node("2(x3),1", i) for i in range(4)] == [2, 2, 2, 1]


def test_the_batch_script_itself_is_told_to_use_srun():
    from equipax.core.knobs import ConfigError
    from equipax.launch.cluster.detect import detect_job

    batch = {k: v for k, v in SLURM_TASK.items() if k not in ("SLURM_STEP_NODELIST", "SLURM_STEP_TASKS_PER_NODE")}
    with pytest.raises(ConfigError, match=r"allocation of 2 task\(s\) \(job 1234\).*Start the command with srun"):
        detect_job(batch)
    assert detect_job({"HOME": "/root"}) is None


@pytest.mark.parametrize(
    "env, cpu_devices, needles",
    [
        (
            {**SLURM_TASK, "SLURM_NTASKS": "3"},
            2,
            ["3 tasks (SLURM_NTASKS=3) x 2 devices each = 6 devices", "needs 4", "submit 2 tasks (sbatch --ntasks=2"],
        ),
        (
            {**SLURM_TASK, "SLURM_NTASKS": "8", "SLURM_GPUS_ON_NODE": "8", "SLURM_STEP_TASKS_PER_NODE": "8"},
            None,
            ["8 tasks (SLURM_NTASKS=8) x 1 device each = 8 devices", "needs 4", "submit 4 tasks"],
        ),
        (
            {**OMPI_RANK, "OMPI_COMM_WORLD_SIZE": "3"},
            None,
            ["3 ranks (OMPI_COMM_WORLD_SIZE=3)", "2 DCN blocks", "use a multiple of 2 ranks"],
        ),
    ],
)
def test_a_job_that_cannot_hold_the_mesh_is_refused_before_jax_starts(env, cpu_devices, needles):
    from equipax.core.knobs import ConfigError
    from equipax.launch.cluster.detect import check_job, detect_job

    job = detect_job(env)
    assert job is not None
    with pytest.raises(ConfigError) as e:
        check_job(job, mesh((1, 2, 1), (2, 1, 1)), devices_per_process=cpu_devices or job.devices_per_process)
    for n in needles:
        assert n in str(e.value), str(e.value)


def test_a_job_that_holds_the_mesh_passes():
    from equipax.launch.cluster.detect import check_job, detect_job

    for env in (SLURM_TASK, OMPI_RANK):
        job = detect_job(env)
        assert job is not None
        check_job(job, mesh((1, 2, 1), (2, 1, 1)), devices_per_process=2)
        check_job(job, mesh((1, 4, 1), (1, 1, 1)), devices_per_process=2)  # one DCN block over both
        check_job(job, mesh((1, -1, 1), (2, 1, 1)), devices_per_process=8)  # a -1 axis takes any multiple


def test_after_discovery_every_process_checks_the_devices():
    from equipax.core.knobs import ConfigError
    from equipax.launch.cluster.shape import check_shape

    check_shape(mesh((1, 64, 1), (2, 1, 1)), num_processes=32, local_devices=4)  # 2 x v5p-128
    with pytest.raises(ConfigError, match=r"16 processes x 4 devices each = 64 devices.*needs 128: run 32 processes"):
        check_shape(mesh((1, 64, 1), (2, 1, 1)), num_processes=16, local_devices=4)


# --- launch slurm ---------------------------------------------------------------------------------


def sbatch(*args):
    code, out = invoke("slurm", *args)
    assert code == 0, out
    return out


def sbatch_options(script: str) -> dict[str, str]:
    return dict(re.findall(r"^#SBATCH --([\w-]+)=?(.*)$", script, re.M))


def srun_words(script: str) -> list[str]:
    (line,) = [ln for ln in script.splitlines() if ln.startswith("srun ")]
    return shlex.split(line)


@pytest.mark.parametrize(
    "exp, args",
    [
        ("c4_22b_2x", ["--nodes", "16", "--gpus-per-node", "8"]),
        ("c4_22b_2x", ["--nodes", "16", "--gpus-per-node", "8", "--tasks-per-node", "8"]),
        ("c4_1b", ["--nodes", "1", "--gpus-per-node", "4", "--set", "train.num_steps=7", "--time", "1:00:00"]),
    ],
)
def test_the_sbatch_script_asks_for_the_mesh(exp, args):
    from equipax.launch.experiments import registry

    script = sbatch("--exp", exp, *args)
    opts = sbatch_options(script)
    cfg = registry.get_experiment(exp)
    devices = (
        int(opts["nodes"]) * int(opts["ntasks-per-node"]) * (int(opts["gpus-per-node"]) // int(opts["ntasks-per-node"]))
    )
    assert devices == cfg.mesh.num_devices
    assert int(opts["nodes"]) * int(opts["ntasks-per-node"]) % cfg.mesh.num_slices == 0
    assert {"requeue", "exclusive"} <= set(opts) and opts["signal"] == "TERM@120"
    words = srun_words(script)
    assert words[:4] == ["srun", "launch", "run", "--distributed-auto"]
    # The script's `launch run` resolves to the experiment the command was given, overrides included.
    exp_at = words.index("--exp") + 1
    sets = [words[i + 1] for i, w in enumerate(words) if w == "--set"]
    assert words[exp_at] == exp and sets == [args[i + 1] for i, a in enumerate(args) if a == "--set"]
    assert script.splitlines()[1].startswith(f"# Written by `launch slurm --exp {exp} ")
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)


@pytest.mark.parametrize(
    "args, needles",
    [
        (
            ["--exp", "c4_22b_2x", "--nodes", "2", "--gpus-per-node", "8"],
            ["--nodes 2 x 8 GPUs per node = 16 devices", "needs 128", "use --nodes 16"],
        ),
        (
            ["--exp", "c4_22b_2x", "--nodes", "16", "--gpus-per-node", "8", "--tasks-per-node", "3"],
            ["does not split evenly into --tasks-per-node 3"],
        ),
        (["--exp", "c4_22b_2x", "--nodes", "16"], ["--gpus-per-node G"]),
        (
            [
                "--exp",
                "c4_22b_2x_smoke",
                "--nodes",
                "3",
                "--cpu-devices",
                "1",
                "--set",
                "mesh.ici_mesh_shape=(1,1,1)",
                "--set",
                "mesh.dcn_mesh_shape=(3,1,1)",
                "--tasks-per-node",
                "1",
            ],
            [],
        ),
        (
            ["--exp", "c4_22b_2x_smoke", "--nodes", "3", "--cpu-devices", "2", "--set", "mesh.ici_mesh_shape=(1,3,1)"],
            ["3 tasks (--nodes 3 x --tasks-per-node 1), which do not split into the mesh's 2 DCN blocks"],
        ),
    ],
)
def test_a_job_shape_that_cannot_hold_the_mesh_is_refused(args, needles):
    code, out = invoke("slurm", *args)
    if not needles:
        assert code == 0, out
        return
    assert code == 2, out
    assert_one_paragraph(out, *needles)


@pytest.mark.parametrize("command", ["slurm", "k8s"])
def test_a_benchmark_has_no_job_file(command, tmp_path):
    shape = ["--nodes", "1", "--gpus-per-node", "1"] if command == "slurm" else ["--topology", "v5e-4", "--image", "i"]
    code, out = invoke(command, "--exp", "attention_bench", *shape, "-o", tmp_path / "job")
    assert code == 2, out
    assert_one_paragraph(out, "attention_bench is a benchmark, not a training experiment")
    assert not (tmp_path / "job").exists()


@pytest.mark.parametrize("srun_exit, requeued, script_exit", [(75, True, 0), (0, False, 0), (1, False, 1)])
def test_exit_75_becomes_a_requeue(tmp_path, srun_exit, requeued, script_exit):
    """The script's tail with stand-ins for srun and scontrol on PATH."""
    script = tmp_path / "job.sbatch"
    sbatch("--exp", "c4_22b_2x", "--nodes", "16", "--gpus-per-node", "8", "-o", str(script))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(f'#!/bin/sh\necho "srun $*" >> {tmp_path}/calls\nexit {srun_exit}\n')
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "scontrol $*" >> {tmp_path}/calls\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID="4242")
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True)
    calls = (tmp_path / "calls").read_text().splitlines()
    assert done.returncode == script_exit, done.stdout + done.stderr
    assert calls[0].startswith("srun launch run --distributed-auto --exp c4_22b_2x")
    assert calls[1:] == (["scontrol requeue 4242"] if requeued else [])


# --- launch k8s -----------------------------------------------------------------------------------


def manifest(*args, tmp_path):
    out = tmp_path / "jobset.yaml"
    code, text = invoke("k8s", *args, "--image", "registry.example/equipax:1", "-o", out)
    assert code == 0, text
    return yaml.safe_load(out.read_text()), out.read_text()


def schema_errors(obj) -> list[str]:
    import jsonschema

    validator = jsonschema.Draft7Validator(SCHEMA["openAPIV3Schema"])
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(obj)]


def unknown_fields(obj, schema, path="") -> list[str]:
    """Fields the schema does not declare: the API server would drop them (or refuse them under
    `kubectl apply --validate=strict`) instead of failing, so a misspelt field would pass unnoticed."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    found = []
    if isinstance(obj, dict):
        props, extra = schema.get("properties"), schema.get("additionalProperties")
        for k, v in obj.items():
            if props is not None and k in props:
                found += unknown_fields(v, props[k], f"{path}/{k}")
            elif isinstance(extra, dict):
                found += unknown_fields(v, extra, f"{path}/{k}")
            elif props is not None and not (path == "" and k in ("apiVersion", "kind", "metadata")):
                found.append(f"{path}/{k}")
    elif isinstance(obj, list) and "items" in schema:
        for i, v in enumerate(obj):
            found += unknown_fields(v, schema["items"], f"{path}/{i}")
    return found


def container(m):
    (job,) = m["spec"]["replicatedJobs"]
    (c,) = job["template"]["spec"]["template"]["spec"]["containers"]
    return c


def env_of(m):
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container(m)["env"]}


@pytest.mark.parametrize(
    "exp, topology, slices",
    [("c4_22b_2x", "v5p-128", 2), ("c4_1b", "v4-8", 1), ("c4_16b", "v4-64", 1), ("lm_cloud_2b", "v5e-4", 1)],
)
def test_the_jobset_is_valid_and_holds_the_mesh(exp, topology, slices, tmp_path):
    from equipax.launch.experiments import registry
    from equipax.launch.hardware.tpu import lookup_slice

    m, text = manifest("--exp", exp, "--topology", topology, "--slices", str(slices), tmp_path=tmp_path)
    assert schema_errors(m) == [] and unknown_fields(m, SCHEMA["openAPIV3Schema"]) == []
    assert m["apiVersion"] == f"{SCHEMA['source']['crd'].split('.', 1)[1]}/{SCHEMA['source']['version']}"
    cfg, tpu = registry.get_experiment(exp), lookup_slice(topology)
    (job,) = m["spec"]["replicatedJobs"]
    spec = job["template"]["spec"]
    pod = spec["template"]["spec"]
    chips_per_pod = int(container(m)["resources"]["limits"]["google.com/tpu"])
    assert job["replicas"] == cfg.mesh.num_slices == slices
    assert spec["parallelism"] == spec["completions"] and spec["completionMode"] == "Indexed"
    assert spec["parallelism"] * chips_per_pod == tpu.chips == math.prod(cfg.mesh.ici_mesh_shape)
    assert job["replicas"] * spec["parallelism"] * chips_per_pod == cfg.mesh.num_devices
    assert pod["nodeSelector"]["cloud.google.com/gke-tpu-topology"] == tpu.topology.split(":")[1]
    assert pod["nodeSelector"]["cloud.google.com/gke-tpu-accelerator"].startswith(f"tpu-{tpu.generation[:2]}")
    env = env_of(m)
    assert env.get("LIBTPU_INIT_ARGS", "") == cfg.train.compiler.libtpu_init_args
    if slices > 1:
        assert env["MEGASCALE_NUM_SLICES"] == str(slices)
        assert "jobset.sigs.k8s.io/job-index" in env["MEGASCALE_SLICE_ID"]["fieldRef"]["fieldPath"]
        assert m["spec"]["coordinator"] == {"replicatedJob": job["name"], "jobIndex": 0, "podIndex": 0}
    else:
        assert not any(k.startswith("MEGASCALE") for k in env)
    words = container(m)["command"]
    assert words[:3] == ["launch", "run", "--distributed-auto"] and words[words.index("--exp") + 1] == exp
    # The JobSet webhook's naming rule: every pod name is a DNS label of at most 63 characters.
    longest = f"{m['metadata']['name']}-{job['name']}-{slices - 1}-{spec['parallelism'] - 1}-abcde"
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", longest) and len(longest) <= 63
    assert text.startswith(f"# Written by `launch k8s --exp {exp} --topology {topology}")


def slice_job(m):
    (job,) = m["spec"]["replicatedJobs"]
    return job


def strict(m):
    return unknown_fields(m, SCHEMA["openAPIV3Schema"])


MUTATIONS = {
    "replicas as a string": (lambda m: slice_job(m).__setitem__("replicas", "2"), schema_errors),
    "coordinator without its job": (lambda m: m["spec"]["coordinator"].pop("replicatedJob"), schema_errors),
    "a boolean as a string": (lambda m: m["spec"]["network"].__setitem__("enableDNSHostnames", "yes"), schema_errors),
    "an unknown failure action": (
        lambda m: m["spec"]["failurePolicy"]["rules"][0].__setitem__("action", "Requeue"),
        schema_errors,
    ),
    "a replicated job without its template": (lambda m: slice_job(m).pop("template"), schema_errors),
    "a misspelt Job field": (lambda m: slice_job(m)["template"]["spec"].__setitem__("paralellism", 16), strict),
    "a misspelt container field": (lambda m: container(m).__setitem__("enviroment", []), strict),
}


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_the_schema_check_catches_what_kubernetes_would_refuse(mutation, tmp_path):
    """Mutations of a good manifest: each must be caught (so the check above can fail)."""
    m, _ = manifest("--exp", "c4_22b_2x", "--topology", "v5p-128", "--slices", "2", tmp_path=tmp_path)
    mutate, catch = MUTATIONS[mutation]
    assert not catch(m)
    mutate(m)
    assert catch(m)


@pytest.mark.parametrize(
    "args, needles",
    [
        (
            ["--exp", "c4_22b_2x", "--topology", "v5p-64", "--slices", "2"],
            ["--topology v5p-64 has 32 chips", "ici_mesh_shape=(1, 64, 1) needs 64", "use --topology v5p-128"],
        ),
        (["--exp", "c4_22b_2x", "--topology", "v5p-128"], ["--slices 1", "spans 2 slice(s): use --slices 2"]),
        (["--exp", "c4_22b_2x", "--topology", "v9-8", "--slices", "2"], ["Unknown --topology 'v9-8'", "v5p-128"]),
        (["--exp", "c4_22b_2x", "--topology", "v5p-128", "--slices", "2", "--name", "x" * 50], ["is not usable", "63"]),
    ],
)
def test_a_topology_the_experiment_does_not_fit_is_refused(args, needles, tmp_path):
    code, out = invoke("k8s", *args, "--image", "img", "-o", tmp_path / "x.yaml")
    assert code == 2, out
    assert_one_paragraph(out, *needles)
    assert not (tmp_path / "x.yaml").exists()


def test_the_schema_fixture_names_its_source():
    src = SCHEMA["source"]
    assert src["repository"] == "kubernetes-sigs/jobset" and re.fullmatch(r"[0-9a-f]{40}", src["commit"])
    assert src["path"].endswith("jobset.x-k8s.io_jobsets.yaml") and src["release"].startswith("v")
    assert "replicatedJobs" in SCHEMA["openAPIV3Schema"]["properties"]["spec"]["properties"]


def test_docs_show_the_files_the_commands_write(tmp_path, monkeypatch):
    """docs/multihost.md shows an sbatch script and a JobSet: each equals what the command in its first
    comment writes today."""
    text = (REPO / "docs" / "multihost.md").read_text()
    shown = re.findall(r"```(?:bash|yaml)[^\n]*\n(#(?:!/bin/bash\n#)? Written by `(launch [^`]+)`.*?)```", text, re.S)
    assert len(shown) == 2, "docs/multihost.md should show the sbatch script and the JobSet"
    monkeypatch.chdir(tmp_path)
    for body, command in shown:
        words = shlex.split(command)[1:]
        code, out = invoke(*words)
        assert code == 0, out
        written = (tmp_path / words[words.index("--output") + 1]).read_text() if "--output" in words else out
        assert body == written, f"docs/multihost.md's copy of `{command}` is out of date:\n{written}"
