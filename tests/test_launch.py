import os
from pathlib import Path

import pytest

from jobs.launch import JobDirs, build_environment, command_for, refused_env_name


def test_the_job_environment_is_built_from_scratch(monkeypatch, tmp_path):
    monkeypatch.setenv("DATABASE_URL", "postgres://secret@db/prod")
    monkeypatch.setenv("SECRET_KEY", "s3cret")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws")
    dirs = JobDirs(tmp_path / "job")
    env = build_environment(job_id="j1", dirs=dirs, devices=[0, 1], device_type="cpu", declared={"MY_FLAG": "on"})
    assert "DATABASE_URL" not in env and "SECRET_KEY" not in env and "AWS_SECRET_ACCESS_KEY" not in env
    assert set(os.environ) - set(env) >= {"DATABASE_URL", "SECRET_KEY"}
    assert env["E31_JOB_ID"] == "j1"
    assert env["E31_DATA_DIR"] == str(dirs.data)
    assert env["E31_OUTPUT_DIR"] == str(dirs.output)
    assert env["E31_CHECKPOINT_DIR"] == str(dirs.checkpoints)
    assert env["E31_CONFIG"] == str(dirs.config)
    assert env["HOME"] == str(dirs.root)
    assert env["MY_FLAG"] == "on"
    assert env["OMP_NUM_THREADS"] == "2"


def test_gpu_nodes_show_the_job_only_its_devices(tmp_path):
    env = build_environment(job_id="j", dirs=JobDirs(tmp_path), devices=[2, 5], device_type="NVIDIA H100", declared={})
    assert env["CUDA_VISIBLE_DEVICES"] == "2,5"
    assert "OMP_NUM_THREADS" not in env


def test_a_gpu_job_finds_the_node_s_cuda_libraries_where_the_node_does_and_a_cpu_job_is_not_told(tmp_path, monkeypatch):
    """A GPU image may find libcuda through LD_LIBRARY_PATH alone (its loader cache not naming
    /usr/local/nvidia/lib64): a GPU job's environment, built afresh, carries the node's value, or
    CUDA would not start in it. A job cannot point it elsewhere."""
    monkeypatch.setenv("LD_LIBRARY_PATH", "/usr/local/nvidia/lib64")
    gpu = build_environment(job_id="j", dirs=JobDirs(tmp_path), devices=[0], device_type="NVIDIA H200", declared={"LD_LIBRARY_PATH": "/evil"})
    assert gpu["LD_LIBRARY_PATH"] == "/usr/local/nvidia/lib64"
    cpu = build_environment(job_id="j", dirs=JobDirs(tmp_path), devices=[0], device_type="cpu", declared={})
    assert "LD_LIBRARY_PATH" not in cpu
    monkeypatch.delenv("LD_LIBRARY_PATH")
    assert "LD_LIBRARY_PATH" not in build_environment(job_id="j", dirs=JobDirs(tmp_path), devices=[0], device_type="NVIDIA H200", declared={})


def test_declared_env_cannot_replace_the_network_s_variables(tmp_path):
    env = build_environment(job_id="j", dirs=JobDirs(tmp_path), devices=[0], device_type="cpu", declared={"E31_JOB_ID": "x", "PATH": "/evil"})
    assert env["E31_JOB_ID"] == "j" and "/evil" not in env["PATH"]


def test_the_job_s_precision_is_in_its_environment_and_the_job_cannot_set_it(tmp_path):
    env = build_environment(job_id="j", dirs=JobDirs(tmp_path), devices=[0], device_type="cpu", declared={}, precision="bf16")
    assert env["E31_PRECISION"] == "bf16"
    assert build_environment(job_id="j", dirs=JobDirs(tmp_path), devices=[0], device_type="cpu", declared={})["E31_PRECISION"] == ""
    declared = {"E31_PRECISION": "fp32", "MINE": "$E31_PRECISION"}
    env = build_environment(job_id="j", dirs=JobDirs(tmp_path), devices=[0], device_type="NVIDIA H100", declared=declared, precision="fp16")
    assert env["E31_PRECISION"] == "fp16" and env["MINE"] == "fp16"
    assert refused_env_name("E31_PRECISION") == (
        "E31_PRECISION is set by the network (to the job's precision: fp32, bf16, fp16, or empty for the default) and cannot be overridden"
    )


def test_commands():
    assert command_for("train.py", ["--lr", "1"], python="/py") == ["/py", "-u", "train.py", "--lr", "1"]
    assert command_for("run.sh", [], python="/py") == ["/bin/bash", "run.sh"]
    with pytest.raises(ValueError):
        command_for("weights.bin", [])


def test_job_folders_are_private(tmp_path):
    dirs = JobDirs(tmp_path / "job")
    dirs.create()
    assert (Path(dirs.root).stat().st_mode & 0o777) == 0o700
    assert (dirs.data / "train").is_dir() and (dirs.data / "heldout").is_dir() and dirs.output.is_dir()
