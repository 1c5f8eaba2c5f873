"""The device decision, for GPU machines too, checked through device strings."""
import dataclasses

import pytest

from tower_train.devices import DevicePlan, canonical_device, plan_devices
from tower_train.errors import UsageError


def test_enough_gpus_uses_them_as_they_are():
    plan = plan_devices(4, "cpu", num_physical_gpus=8, gpu0_memory_mb=16000)
    assert plan.tower_devices == ("/gpu:0", "/gpu:1", "/gpu:2", "/gpu:3")
    assert plan.param_device == "/cpu:0"
    assert (plan.split, plan.num_logical, plan.gpu_memory_limit_mb) == ("none", 0, None)


def test_enough_gpus_with_gpu_parameter_device():
    assert plan_devices(2, "gpu", num_physical_gpus=2).param_device == "/gpu:0"


def test_one_gpu_is_split_by_its_memory():
    plan = plan_devices(4, "cpu", num_physical_gpus=1, gpu0_memory_mb=16000)
    assert plan.split == "gpu" and plan.num_logical == 4
    assert plan.gpu_memory_limit_mb == 4000
    assert plan.tower_devices == ("/gpu:0", "/gpu:1", "/gpu:2", "/gpu:3")
    assert "split GPU 0 into 4 logical GPUs of 4000 MB" in plan.message


def test_gpu_memory_flag_overrides_the_even_split():
    plan = plan_devices(3, "gpu", num_physical_gpus=2, gpu0_memory_mb=16000, gpu_memory_mb=2500)
    assert plan.split == "gpu" and plan.num_logical == 3
    assert plan.gpu_memory_limit_mb == 2500
    assert plan.param_device == "/gpu:0"


def test_splitting_a_gpu_of_unknown_memory_asks_for_the_flag():
    with pytest.raises(UsageError, match="--gpu_memory_mb"):
        plan_devices(2, "cpu", num_physical_gpus=1, gpu0_memory_mb=None)


@pytest.mark.parametrize("num_gpus,gpu0_mb,flag_mb,expected", [
    (4, 16000, 5000, "--gpu_memory_mb=5000: 4 logical GPUs of 5000 MB need 20000 MB but GPU 0 has 16000 MB"),
    (4, 16000, 100, "--gpu_memory_mb=100: 4 logical GPUs of 100 MB each; each needs at least 256 MB"),
    (64, 8000, None, "--num_gpus=64: 64 logical GPUs of 125 MB each; each needs at least 256 MB"),
    (2, None, 200, "--gpu_memory_mb=200: 2 logical GPUs of 200 MB each; each needs at least 256 MB"),
])
def test_a_gpu_split_that_cannot_fit_is_refused_naming_the_culprit(num_gpus, gpu0_mb, flag_mb, expected):
    with pytest.raises(UsageError, match=expected):
        plan_devices(num_gpus, "cpu", num_physical_gpus=1, gpu0_memory_mb=gpu0_mb, gpu_memory_mb=flag_mb)


def test_a_gpu_split_that_just_fits_is_accepted():
    plan = plan_devices(4, "cpu", num_physical_gpus=1, gpu0_memory_mb=16000, gpu_memory_mb=4000)
    assert plan.gpu_memory_limit_mb == 4000 and plan.tower_devices[-1] == "/gpu:3"


def test_no_gpu_splits_the_cpu_and_keeps_the_host_apart():
    plan = plan_devices(4, "cpu", num_physical_gpus=0)
    assert plan.split == "cpu" and plan.num_logical == 5
    assert plan.tower_devices == ("/cpu:1", "/cpu:2", "/cpu:3", "/cpu:4")
    assert plan.param_device == "/cpu:0"
    assert plan.param_device not in plan.tower_devices


def test_no_gpu_gpu_parameter_device_is_the_first_tower():
    assert plan_devices(3, "gpu", num_physical_gpus=0).param_device == "/cpu:1"


def test_zero_gpus_is_one_cpu_tower_without_split():
    plan = plan_devices(0, "gpu", num_physical_gpus=4)
    assert plan == DevicePlan(("/cpu:0",), "/cpu:0", "none", 0, None, "--num_gpus=0: one tower on /cpu:0",
                              "parameter_device", "gpu")
    assert plan.message == "--num_gpus=0: one tower on /cpu:0; parameters on /cpu:0"


def test_message_is_made_of_the_fields_so_a_mode_sets_where_the_variables_live():
    plan = plan_devices(4, "spread", num_physical_gpus=0)
    assert plan.message == ("no GPU found for --num_gpus=4: split the CPU into 5 logical devices, host /cpu:0, "
                            "towers on /cpu:1../cpu:4; parameters spread over /cpu:1../cpu:4, counters on /cpu:0")
    mirrored = dataclasses.replace(plan_devices(2, "cpu", num_physical_gpus=2), variables="mirrored")
    assert mirrored.message == "2 GPU(s) found: 2 tower(s) on /gpu:0../gpu:1; variables mirrored on every tower"
    assert dataclasses.replace(plan, setup="one replica", variables=None).message == "one replica"


@pytest.mark.parametrize("num_gpus,physical", [(1, 0), (2, 0), (4, 1), (4, 4), (0, 0)])
def test_message_is_one_line_naming_the_parameter_device(num_gpus, physical):
    plan = plan_devices(num_gpus, "cpu", num_physical_gpus=physical, gpu0_memory_mb=8000)
    assert "\n" not in plan.message
    assert plan.message.endswith(f"parameters on {plan.param_device}")
    assert len(plan.tower_devices) == max(num_gpus, 1)


def test_canonical_device_folds_spellings():
    assert canonical_device("/gpu:1") == canonical_device("/job:localhost/replica:0/task:0/device:GPU:1")
    assert canonical_device("/cpu:0") != canonical_device("/cpu:1")


@pytest.mark.parametrize("num_gpus,physical,param_device,why", [
    (2, 0, "/cpu:0", "no GPU, the host"),
    (1, 0, "/cpu:0", "no GPU, the host"),
    (1, 1, "/gpu:0", "one tower, on the GPU it computes on"),
    (1, 4, "/gpu:0", "one tower, on the GPU it computes on"),
    (4, 1, "/cpu:0", "4 towers, the host (fastest for 4 towers on one GPU, docs/gpu.md)"),
    (4, 4, "/cpu:0", "4 towers, the host (fastest for 4 towers on one GPU, docs/gpu.md)"),
])
def test_auto_ps_device_places_one_gpu_tower_on_its_gpu_and_else_the_host_and_says_why(
        num_gpus, physical, param_device, why):
    plan = plan_devices(num_gpus, "auto", num_physical_gpus=physical, gpu0_memory_mb=8000)
    assert plan.param_device == param_device
    assert plan.ps_device == param_device[1:4]
    assert plan.message.endswith(f"parameters on {param_device}; --ps_device=auto chose {plan.ps_device}: {why}")


def test_a_ps_device_given_keeps_its_meaning_and_adds_no_reason():
    for ps_device in ("cpu", "gpu", "spread"):
        given = plan_devices(1, ps_device, num_physical_gpus=1)
        assert (given.ps_device, given.choices) == (ps_device, ())
    assert plan_devices(1, "cpu", num_physical_gpus=1).param_device == "/cpu:0"
