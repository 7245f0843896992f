"""strata.zero.Init with DeepSpeed's keywords and rules, and strata.initialize in DeepSpeed's
serial environment (issue 77): before these, a nested Init raised, ``dtype=``, ``module=``
and ``data_parallel_group=`` were TypeErrors, and a process with RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR and MASTER_PORT but no LOCAL_WORLD_SIZE (DeepSpeed's tests, a
notebook) made initialize raise."""

import os
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ranks  # noqa: E402
import strata  # noqa: E402
import toy_model  # noqa: E402
from strata.zero import partitioned  # noqa: E402


def train(engine, steps=2):
    return toy_model.train_slice(engine, 0, 1, steps, 4)


def reference(steps=2):
    losses, _ = toy_model.reference_losses(steps, 4)
    return losses


def close_to(a, b):
    return all(abs(x - y) <= 1e-5 * abs(y) for x, y in zip(a, b))


def test_an_init_inside_another_does_nothing_and_the_outer_one_partitions():
    # DeepSpeed's test_zero_nesting_init.py: the inner context is a no-op.
    torch.manual_seed(0)
    with strata.zero.Init() as outer:
        with strata.zero.Init() as inner:
            model = toy_model.Net()
        assert inner._nested and not outer._nested
        late = torch.nn.Linear(3, 3)  # built after the inner one closed: still partitioned
    assert all(partitioned(p) is not None for p in model.parameters())
    assert partitioned(late.weight) is not None
    engine, *_ = strata.initialize(model=model, config=toy_model.config(4, 1))
    assert close_to(train(engine), reference())
    engine.close()


def test_module_keyword_partitions_a_built_model_and_dtype_keeps_the_parts_in_it():
    model = toy_model.make_model()
    strata.zero.Init(module=model, dtype=torch.bfloat16)
    assert all(p.numel() == 0 and p.dtype == torch.bfloat16 for p in model.parameters())
    parts = [partitioned(p) for p in model.parameters()]
    assert all(part is not None and part.part.dtype == torch.bfloat16 for part in parts)
    # The engine's master is the bf16 value (as DeepSpeed's, whose Init casts too).
    want = {n: p.detach().to(torch.bfloat16).float() for n, p in toy_model.make_model().named_parameters()}
    engine, *_ = strata.initialize(model=model, config=toy_model.config(4, 1))
    got = engine.gather_parameters()
    assert all(torch.equal(got[n], want[n]) for n in want)
    engine.close()
    # The first positional argument may be the module, as DeepSpeed's.
    model = toy_model.make_model()
    strata.zero.Init(model)
    assert all(partitioned(p) is not None for p in model.parameters())
    with pytest.raises(ValueError, match="floating-point torch.dtype"):
        strata.zero.Init(dtype=torch.int8)


def test_deepspeeds_other_keywords_are_accepted_at_their_defaults_and_refused_otherwise():
    with strata.zero.Init(zero_param_parallel_group=None, zero_quantized_weights=False,
                          sequence_data_parallel_group=None, param_swapper=None, config=None):
        torch.nn.Linear(2, 2)
    with pytest.raises(NotImplementedError, match="hpZ"):
        strata.zero.Init(zero_param_parallel_group=object())
    with pytest.raises(NotImplementedError, match="qwZ"):
        strata.zero.Init(zero_quantized_weights=True)
    with pytest.raises(TypeError, match="unexpected keyword argument 'no_such_keyword'"):
        strata.zero.Init(no_such_keyword=1)
    with strata.zero.Init(enabled=False):
        plain = torch.nn.Linear(2, 2)
    assert partitioned(plain.weight) is None


def test_data_parallel_group_says_the_ranks():
    if not torch.distributed.is_available():
        pytest.skip("this torch has no torch.distributed")
    store = torch.distributed.HashStore()
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        group = torch.distributed.new_group([0])
        with strata.zero.Init(data_parallel_group=group) as init:
            model = toy_model.make_model()
        assert (init.rank, init.world_size) == (0, 1)
        engine, *_ = strata.initialize(model=model, config=toy_model.config(4, 1))
        assert close_to(train(engine), reference())
        engine.close()
        with pytest.raises(ValueError, match="data_parallel_group or mpu, not both"):
            with strata.zero.Init(data_parallel_group=group, mpu=object()):
                pass
    finally:
        torch.distributed.destroy_process_group()


SERIAL = """
import sys
sys.path.insert(0, {here!r})
import strata, toy_model
engine, *_ = strata.initialize(model=toy_model.make_model(), config=toy_model.config(4, 1))
losses = toy_model.train_slice(engine, 0, 1, 2, 4)
print("LOSSES", losses, engine.rank, engine.world_size)
engine.close()
"""


def test_initialize_in_deepspeeds_serial_environment():
    here = os.path.dirname(os.path.abspath(__file__))
    env = {k: v for k, v in os.environ.items() if k not in ranks.TORCHRUN_VARS}
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(ranks.free_port()), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    done = subprocess.run([sys.executable, "-c", SERIAL.format(here=here)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    line = next(x for x in done.stdout.splitlines() if x.startswith("LOSSES"))
    losses = eval(line.split(" ", 1)[1].rsplit("]", 1)[0] + "]")  # noqa: S307: our own output
    assert line.endswith(" 0 1"), line
    assert close_to(losses, reference())
