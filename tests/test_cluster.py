"""Where a multi_worker worker learns its cluster (--cluster): Slurm's variables read as TensorFlow's
SlurmClusterResolver reads them, and the Kubernetes set-up of docs/k8s."""
import json
import os
import socket
import subprocess
import sys

import pytest
import yaml
from tensorflow.python.distribute.cluster_resolver import slurm_cluster_resolver

from tower_train.workers import cluster
from tower_train.workers.cluster import WorkerInfo, parse_slurm, parse_tf_config, this_worker
from tower_train.config import TrainConfig
from tower_train.errors import TrainingError, UsageError
from test_cli_errors import ROOT

K8S = os.path.join(ROOT, "docs", "k8s")


def slurm_env(procid, nodes="node[01-02]", per_node="2(x2)", tasks=4, **more):
    return {"SLURM_PROCID": str(procid), "SLURM_STEP_NUM_TASKS": str(tasks),
            "SLURM_STEP_NODELIST": nodes, "SLURM_STEP_TASKS_PER_NODE": per_node, **more}


@pytest.mark.parametrize("hostlist", ["n[1-2],m5,o[3-4,6,7-9]", "node[001-003]", "b,a", "gpu-[08-11]"])
def test_hostlists_expand_as_tensorflows_resolver_expands_them(hostlist):
    assert cluster.expand_hostlist(hostlist) == slurm_cluster_resolver.expand_hostlist(hostlist)


@pytest.mark.parametrize("per_node", ["3(x2),2,1", "1", "4(x3)"])
def test_tasks_per_node_expand_as_tensorflows_resolver_expands_them(per_node):
    assert cluster.expand_tasks_per_node(per_node) == slurm_cluster_resolver.expand_tasks_per_node(per_node)


def test_a_slurm_task_is_the_worker_its_procid_says_with_every_other_task_as_a_peer():
    # Nodes in sorted order, a node's tasks on consecutive ports from the base.
    env = slurm_env(2, nodes="b,a", per_node="1,2", tasks=3, TOWER_TRAIN_SLURM_PORT="5000")
    assert parse_slurm(env) == WorkerInfo(2, 3, False, ("a:5000", "a:5001"), slurm_port=5000,
                                        address="b:5000")
    assert parse_slurm(slurm_env(0)).is_chief and parse_slurm(slurm_env(0)).slurm_port == 8888


def test_auto_takes_slurm_when_slurm_procid_is_set_else_tf_config():
    tf_config = json.dumps({"cluster": {"worker": ["h:1", "h:2"]}, "task": {"type": "worker", "index": 1}})
    assert this_worker("auto", {"TF_CONFIG": tf_config}) == parse_tf_config(tf_config)
    assert this_worker("auto", {"TF_CONFIG": tf_config, **slurm_env(3)}) == parse_slurm(slurm_env(3))
    assert this_worker("tf_config", {"TF_CONFIG": tf_config, **slurm_env(3)}).index == 1


@pytest.mark.parametrize("env, expected", [
    ({}, "--cluster=slurm: SLURM_PROCID is not set; run each worker as a task of a Slurm step"),
    ({k: v for k, v in slurm_env(0).items() if k != "SLURM_STEP_NODELIST"}, "SLURM_STEP_NODELIST is not set"),
    (slurm_env("x"), "SLURM_PROCID=x: must be a whole number >= 0"),
    (slurm_env(4), "SLURM_PROCID=4: out of range for SLURM_STEP_NUM_TASKS=4 (0..3)"),
    (slurm_env(0, tasks=3), "Slurm's variables disagree: SLURM_STEP_NODELIST has 2 node(s) and "
                            "SLURM_STEP_TASKS_PER_NODE=2(x2) gives 2 node(s) 4 task(s), but SLURM_STEP_NUM_TASKS=3"),
    (slurm_env(0, per_node="2(x3)", tasks=6), "disagree: SLURM_STEP_NODELIST has 2 node(s)"),
    (slurm_env(0, nodes="node[02-01]"), "SLURM_STEP_NODELIST=node[02-01]: cannot read the range '02-01'"),
    (slurm_env(0, nodes="node[1-2"), "SLURM_STEP_NODELIST=node[1-2: cannot read"),
    (slurm_env(0, nodes="a,a", per_node="2,2"), "names a node twice"),
    (slurm_env(0, per_node="2x2"), "SLURM_STEP_TASKS_PER_NODE=2x2: cannot read '2x2'"),
    (slurm_env(0, TOWER_TRAIN_SLURM_PORT="65535"), "TOWER_TRAIN_SLURM_PORT=65535: must be a port in 1..65534"),
])
def test_a_bad_slurm_environment_is_one_line_naming_the_variable(env, expected):
    with pytest.raises(UsageError) as raised:
        this_worker("slurm", env)
    assert expected in str(raised.value) and "\n" not in str(raised.value)


def test_cluster_is_refused_outside_multi_worker():
    with pytest.raises(UsageError, match="--cluster=slurm: only with --mode=multi_worker, not --mode=tower"):
        TrainConfig(cluster="slurm")
    with pytest.raises(UsageError, match="--cluster=lsf: unknown; allowed: tf_config, slurm, auto"):
        TrainConfig(mode="multi_worker", cluster="lsf")


def test_the_strategy_gets_tensorflows_slurm_cluster_with_this_workers_devices(monkeypatch):
    env = slurm_env(3, TOWER_TRAIN_SLURM_PORT="7000")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    resolver = cluster.strategy_resolver(parse_slurm(env), gpus=0)
    assert resolver.cluster_spec().as_dict() == {
        "worker": ["node01:7000", "node01:7001", "node02:7000", "node02:7001"]}
    assert (resolver.task_type, resolver.task_id, resolver.num_accelerators()) == ("worker", 3, {"GPU": 0})
    assert "CUDA_VISIBLE_DEVICES" not in os.environ  # the device plan places the towers
    assert cluster.strategy_resolver(parse_tf_config(json.dumps(
        {"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 0}})), gpus=0) is None
    monkeypatch.setenv("SLURM_PROCID", "2")  # TensorFlow places this task elsewhere than tower-train
    with pytest.raises(TrainingError, match="refusing to train with the two at odds"):
        cluster.strategy_resolver(parse_slurm(env), gpus=0)


# --- Kubernetes (docs/k8s): the manifests cannot run here; their YAML and the start-up script can.

def k8s_documents(name):
    with open(os.path.join(K8S, name)) as f:
        return list(yaml.safe_load_all(f))


def test_the_start_up_script_writes_each_indexed_pods_tf_config():
    script = os.path.join(K8S, "tf-config-from-index.sh")
    seen = []
    for index in (0, 1):
        env = {"PATH": os.environ["PATH"], "JOB_COMPLETION_INDEX": str(index), "WORKERS": "2",
               "JOB_NAME": "tower-train", "SERVICE": "tower-train-workers", "PORT": "2222"}
        result = subprocess.run(["sh", script, sys.executable, "-c",
                                 "import os; print(os.environ['TF_CONFIG'])"],
                                env=env, capture_output=True, text=True, timeout=30)
        assert result.returncode == 0, result.stderr
        seen.append(json.loads(result.stdout))
    workers = ["tower-train-0.tower-train-workers:2222", "tower-train-1.tower-train-workers:2222"]
    assert seen == [{"cluster": {"worker": workers}, "task": {"type": "worker", "index": i}}
                    for i in (0, 1)]
    assert parse_tf_config(json.dumps(seen[1])) == WorkerInfo(1, 2, False, (workers[0],),
                                                              address=workers[1])


def test_the_tfjob_has_what_the_training_operator_requires():
    (job,) = k8s_documents("tfjob.yaml")
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "TFJob") and job["metadata"]["name"]
    (replica_type, spec), = job["spec"]["tfReplicaSpecs"].items()
    assert replica_type == "Worker" and spec["replicas"] >= 2
    assert spec["restartPolicy"] == "ExitCode"  # 143 after a preemption is retried; 1 and 2 are not
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    assert container["name"] == "tensorflow" and container["image"]  # the operator's container name
    assert "--mode=multi_worker" in container["command"] and not any(
        "--cluster" in arg for arg in container["command"])  # the operator writes TF_CONFIG
    check_shared_train_dir(pod, container)


def test_the_indexed_job_and_its_headless_service_agree():
    service, job = k8s_documents("indexed-job.yaml")
    assert (service["kind"], service["spec"]["clusterIP"]) == ("Service", "None")
    assert job["apiVersion"] == "batch/v1" and job["kind"] == "Job"
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] >= 2
    pod = spec["template"]["spec"]
    assert pod["subdomain"] == service["metadata"]["name"]
    labels = spec["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    (container,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["WORKERS"] == str(spec["completions"]) and env["JOB_NAME"] == job["metadata"]["name"]
    assert env["SERVICE"] == service["metadata"]["name"]
    assert container["ports"][0]["containerPort"] == int(env["PORT"])
    assert container["command"][:2] == ["sh", "/start/tf-config-from-index.sh"]
    assert "--mode=multi_worker" in container["command"]
    config_map = next(v for v in pod["volumes"] if "configMap" in v)
    mount = next(m for m in container["volumeMounts"] if m["name"] == config_map["name"])
    assert mount["mountPath"] == "/start"
    check_shared_train_dir(pod, container)


def check_shared_train_dir(pod, container):
    """Every worker's --train_dir is on the one ReadWriteMany claim of docs/k8s/train-dir.yaml, and
    a preempted pod has longer than --stop_grace_period to save."""
    (claim,) = k8s_documents("train-dir.yaml")
    assert claim["kind"] == "PersistentVolumeClaim" and claim["spec"]["accessModes"] == ["ReadWriteMany"]
    volume = next(v for v in pod["volumes"] if "persistentVolumeClaim" in v)
    assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    mount = next(m for m in container["volumeMounts"] if m["name"] == volume["name"])
    flags = dict(arg.split("=", 1) for arg in container["command"] if arg.startswith("--") and "=" in arg)
    assert flags["--train_dir"].startswith(mount["mountPath"] + "/")
    assert pod["terminationGracePeriodSeconds"] > float(flags["--stop_grace_period"])


def test_a_port_is_free_to_a_server_unless_another_process_holds_it():
    with socket.create_server(("127.0.0.1", 0)) as taken:  # any address, IPv4 or IPv6, counts
        assert cluster.why_not_listening(taken.getsockname()[1]) == "in use by another process"
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = server.accept()
        accepted.close()  # closed first: the server's side of the port waits in TIME_WAIT
        client.close()
    assert cluster.why_not_listening(port) is None  # as an earlier run on the same --port leaves it
