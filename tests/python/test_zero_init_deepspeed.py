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


@pytest.mark.parametrize("world", [1, 2])
def test_rank_zeros_values_and_fill_on_rank_zero_before_initialize(tmp_path, world):
    """DeepSpeed's rules under torch.distributed: a parameter a constructor sets differently
    per rank ends as rank 0's (before: each rank kept its own part, so a gathered weight
    held [1, 1, 1, 1, 2, 2, 2]); GatheredParameters(modifier_rank=0) on parts before
    initialize (before: refused) gathers them whole and writes rank 0's changes to every
    rank's part, and without a modifier drops the changes."""
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zero_init_ds_worker.py")
    port = ranks.free_port()
    results = ranks.run(tmp_path, worker, world, env_of=lambda r: ranks.torchrun_env(r, world, port))
    for r in results:
        v = r["values"]
        assert r["seen_whole"] == [3, 4]
        assert v["w"] == [1.0] * 7, v["w"]
        assert v["linear.bias"] == [10.0, 20.0, 30.0]
        assert v["linear.weight"] == torch.arange(12.0).reshape(3, 4).tolist()


def test_gathering_parts_of_several_ranks_without_torch_distributed_says_what_to_call(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with strata.zero.Init():
        layer = torch.nn.Linear(4, 4)
    with pytest.raises(RuntimeError, match=r"needs torch.distributed initialized \(strata.comm.init_distributed"):
        with strata.zero.GatheredParameters(layer.weight, modifier_rank=0):
            pass


def test_from_pretrained_of_a_model_with_a_new_head_trains_as_loaded_plainly(tmp_path):
    """transformers' ...ForSequenceClassification.from_pretrained(base) under zero.Init: the
    base's weights from the checkpoint, the new head (``score``) by the model's own
    _init_weights, with transformers' warning (before: refused at initialize, "missing
    from the file"); then it trains as the model loaded plainly given the same head."""
    transformers = pytest.importorskip("transformers")
    import hf_model

    hf_model.make_model(seed=3).save_pretrained(tmp_path / "base")
    cls = transformers.LlamaForSequenceClassification
    with strata.zero.Init():
        model = cls.from_pretrained(tmp_path / "base", num_labels=3)
    assert model._strata_missing == ["score.weight"]
    cfg = {"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}},
           "zero_optimization": {"stage": 3}}
    engine, *_ = strata.initialize(model=model, config=cfg)
    got = engine.gather_parameters()
    plain = cls.from_pretrained(tmp_path / "base", num_labels=3)
    for name, p in plain.named_parameters():
        if name != "score.weight":
            assert torch.equal(got[name], p.detach()), name
    head = got["score.weight"]
    std = plain.config.initializer_range
    assert head.shape == (3, hf_model.HIDDEN) and 0.3 * std < head.std().item() < 3 * std
    with torch.no_grad():
        plain.score.weight.copy_(head)
    plain.config.pad_token_id = model.config.pad_token_id = 0
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-3, weight_decay=0.0)
    g = torch.Generator().manual_seed(4)
    for _ in range(3):
        ids = torch.randint(1, hf_model.VOCAB, (4, 8), generator=g)
        labels = torch.randint(0, 3, (4,), generator=g)
        loss = engine(input_ids=ids, labels=labels).loss
        engine.backward(loss)
        engine.step()
        want = plain(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        want.backward()
        opt.step()
        assert abs(loss.item() - want.item()) <= 1e-5 * abs(want.item()), (loss.item(), want.item())
    engine.close()


def test_from_pretrained_of_a_checkpoint_whose_keys_transformers_converts_is_refused_at_once(tmp_path):
    """transformers 5 saves a Mixtral with its experts as separate w1/w2/w3 tensors and fuses
    them when it loads (its conversion mapping); Strata's loader reads the model's own names,
    so the load is refused when the model is built, naming the tensors and what to do
    (before: a model was built and initialize failed with "missing from the file")."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1, num_local_experts=2,
                                     num_experts_per_tok=1, max_position_embeddings=32)
    transformers.MixtralForCausalLM(cfg).save_pretrained(tmp_path / "mixtral")
    with pytest.raises(ValueError, match=r"block_sparse_moe\.experts\.0\.w1\.weight.*conversion mapping"):
        with strata.zero.Init():
            transformers.MixtralForCausalLM.from_pretrained(tmp_path / "mixtral")
