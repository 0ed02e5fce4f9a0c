"""The suite's seeds (tests/conftest.py): a failure names its seed, and ``--seed`` reruns the same inputs."""

import re
import shutil
from pathlib import Path

pytest_plugins = ("pytester",)

_FAILING = '''
import torch
from score_inputs import score_inputs


def test_draws(seed):
    q, _, _ = score_inputs(1, 1, 1, 1, 4, 2)
    print("DRAWN", seed, torch.rand(1).item(), q.sum().item())
    assert False
'''

# Inner runs without the plugins this check does not need (each in-process run would load them again).
_RUN = ("-s", "-p", "no:cacheprovider", "-p", "no:hypothesispytest", "-p", "no:benchmark", "--assert=plain")


def test_failure_names_the_seed_and_the_rerun_reproduces_it(pytester):
    tests = Path(__file__).resolve().parents[1]
    for path in (tests / "conftest.py", tests / "helpers" / "gating.py", tests / "helpers" / "score_inputs.py"):
        shutil.copy(path, pytester.path / path.name)
    pytester.makepyfile(test_draws=_FAILING)
    first = pytester.runpytest(*_RUN)
    first.assert_outcomes(failed=1)
    out = first.stdout.str()
    seed = int(re.search(r"seed (\d+): rerun with  pytest 'test_draws.py::test_draws' --seed \1", out).group(1))
    drawn = re.search(rf"DRAWN {seed} (\S+ \S+)", out).group(1)
    rerun = pytester.runpytest(*_RUN, "--seed", str(seed))
    assert f"DRAWN {seed} {drawn}" in rerun.stdout.str()
    other = pytester.runpytest(*_RUN, "--seed", str(seed + 1))
    assert f"DRAWN {seed + 1} {drawn}" not in other.stdout.str()
