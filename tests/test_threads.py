"""common/threads.py: torch's OpenMP threads wait passively unless told otherwise, set
by the scripts before torch loads (OpenMP reads the setting only then)."""
from pathlib import Path

import pytest

from common.threads import wait_passively

ROOT = Path(__file__).resolve().parent.parent


def test_the_wait_policy_is_passive_unless_the_user_chose_one():
    env = {}
    wait_passively(env)
    assert env == {"OMP_WAIT_POLICY": "PASSIVE"}
    env = {"OMP_WAIT_POLICY": "ACTIVE"}
    wait_passively(env)
    assert env == {"OMP_WAIT_POLICY": "ACTIVE"}


@pytest.mark.parametrize("script", ["train.py", "sample.py"])
def test_the_scripts_set_it_before_they_import_the_project(script):
    """The project's first import (engine/, which loads torch) comes after the setting."""
    lines = (ROOT / script).read_text().splitlines()
    first = min(i for i, line in enumerate(lines)
                if line.startswith(("from engine", "from model", "from data", "import torch")))
    assert any(line.startswith("wait_passively()") for line in lines[:first])
