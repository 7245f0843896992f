"""torch.utils.checkpoint with Strata blocks: the recompute inside the backward
re-gathers the block's parameters (the engine's hooks treat a forward that runs inside a
backward pass as that block's backward use), losses equal the run without checkpointing,
and the saved activations shrink to the checkpointed blocks' inputs."""

import pathlib
import sys

import pytest

torch = pytest.importorskip("torch")
strata = pytest.importorskip("strata", reason="the _strata module is not built (STRATA_PYTHON=OFF)")
from torch.utils.checkpoint import checkpoint  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import toy_model  # noqa: E402

BLOCKS, DIM, WIDE, BATCH, STEPS = 4, 32, 128, 16, 5


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(DIM, WIDE)
        self.down = torch.nn.Linear(WIDE, DIM)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class Net(torch.nn.Module):
    """mode: None (no checkpointing), "reentrant" or "non_reentrant" (torch.utils.checkpoint),
    "strata" or "strata_cpu" (strata.checkpointing.checkpoint; the config's
    cpu_checkpointing off or on)."""

    def __init__(self, mode=None):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block() for _ in range(BLOCKS)])
        self.head = torch.nn.Linear(DIM, 1)
        self.mode = mode

    def forward(self, x):
        if self.mode == "reentrant" and not x.requires_grad:
            # The reentrant checkpoint passes gradients only to inputs that require them
            # (PyTorch's documented limitation): the data batch must, or the first block's
            # parameters would get none.
            x = x.detach().requires_grad_()
        for b in self.blocks:
            if self.mode is None:
                x = b(x)
            elif self.mode.startswith("strata"):
                x = strata.checkpointing.checkpoint(b, x)
            else:
                x = checkpoint(b, x, use_reentrant=self.mode == "reentrant")
        return self.head(x)


def batches():
    g = torch.Generator().manual_seed(11)
    for _ in range(STEPS):
        yield torch.randn(BATCH, DIM, generator=g), torch.randn(BATCH, 1, generator=g)


def config(cpu_checkpointing=False):
    cfg = toy_model.config(BATCH, 1)
    # Every block is gathered and released around each use (none stays gathered).
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    if cpu_checkpointing:
        cfg["activation_checkpointing"] = {"cpu_checkpointing": True}
    return cfg


class SavedBytes:
    """The bytes autograd saves for backward during a forward, parameters left out (they
    are the gathered weights, not activations): saved-tensor hooks."""

    def __init__(self, params):
        self.params = {p.data_ptr() for p in params}
        self.bytes = 0

    def pack(self, t):
        if t.data_ptr() not in self.params:
            self.bytes += t.numel() * t.element_size()
        return t

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)


def train(mode):
    torch.manual_seed(0)
    model = Net(mode)
    engine, *_ = strata.initialize(model=model, config=config(mode == "strata_cpu"), blocks=list(model.blocks))
    assert strata.checkpointing.cpu_checkpointing() == (mode == "strata_cpu")
    recomputes = []
    for b in model.blocks:
        b.register_forward_pre_hook(
            lambda m, i: recomputes.append(1) if torch._C._current_graph_task_id() != -1 else None
        )
    losses, saved = [], []
    for x, y in batches():
        counter = SavedBytes(model.parameters())
        with counter.hooks():
            loss = torch.nn.functional.mse_loss(engine(x), y)
        saved.append(counter.bytes)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    stats = engine.statistics()
    params = {k: v.clone() for k, v in engine.gather_parameters().items()}
    engine.close()
    return losses, saved, len(recomputes), stats, params


def reference():
    torch.manual_seed(0)
    model = Net(None)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for x, y in batches():
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("mode", ["non_reentrant", "reentrant", "strata", "strata_cpu"])
def test_checkpointed_blocks_train_as_without_and_save_only_their_inputs(mode):
    plain_losses, plain_saved, plain_recomputes, plain_stats, plain_params = train(None)
    losses, saved, recomputes, stats, params = train(mode)
    ref = reference()
    # The same numbers with and without checkpointing (bit for bit: the same kernels run
    # on the same values), and as plain PyTorch's Adam.
    assert losses == plain_losses
    for name, p in plain_params.items():
        assert torch.equal(params[name], p), name
    for a, b in zip(losses, ref):
        assert abs(a - b) <= 1e-5 * abs(b), (losses, ref)
    # Every block ran again inside each backward, its parameters gathered for it.
    assert plain_recomputes == 0
    assert recomputes == BLOCKS * STEPS
    co = stats["coordinator"]
    assert co["fetches_on_demand"] + co["fetches_prefetched"] + co["fetches_reused"] > 0
    # Saved activations: without checkpointing every block's; with it at most the blocks'
    # inputs plus one block's activations (the head's too, outside the blocks).
    input_bytes = BATCH * DIM * 4
    per_block = (plain_saved[0] - BATCH * DIM * 4) / BLOCKS  # the head saves its input
    bound = BLOCKS * input_bytes + per_block + BATCH * DIM * 4
    assert all(s == saved[0] for s in saved)
    assert saved[0] <= bound, (saved[0], bound, plain_saved[0])
    assert saved[0] < plain_saved[0] / 2, (saved[0], plain_saved[0])
    if mode == "strata_cpu":
        # cpu_checkpointing: the checkpoints' inputs went through save_on_cpu's hooks (the
        # innermost), not the counter's: what the counter sees is the head's input and the
        # loss's tensors.
        assert saved[0] <= BATCH * DIM * 4 + 4 * BATCH * 4, (saved[0], plain_saved[0])


needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no usable CUDA device (torch.cuda.is_available() is False)"
)


@needs_cuda
def test_cpu_checkpointing_keeps_the_saved_inputs_off_the_gpu():
    kept = {}
    for on in (False, True):
        torch.manual_seed(0)
        model = Net("strata_cpu" if on else "strata").cuda()
        engine, *_ = strata.initialize(model=model, config=config(on), blocks=list(model.blocks))
        x, y = next(batches())
        x, y = x.cuda(), y.cuda()
        for _ in range(2):  # the second step is measured
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            loss = torch.nn.functional.mse_loss(engine(x), y)
            torch.cuda.synchronize()
            kept[on] = torch.cuda.memory_allocated() - before
            engine.backward(loss)
            engine.step()
        engine.close()
    # The blocks' inputs (all but the first, which is the batch itself) left the GPU.
    assert kept[True] <= kept[False] - (BLOCKS - 1) * BATCH * DIM * 4, kept


def test_configure_honours_checkpoint_in_cpu_and_refuses_the_rest():
    try:
        strata.checkpointing.configure(None, checkpoint_in_cpu=True)
        assert strata.checkpointing.cpu_checkpointing()
        strata.checkpointing.configure(None, deepspeed_config={"activation_checkpointing": {"cpu_checkpointing": False}})
        assert not strata.checkpointing.cpu_checkpointing()
        strata.checkpointing.configure(None, deepspeed_config='{"activation_checkpointing": {"cpu_checkpointing": true}}')
        assert strata.checkpointing.cpu_checkpointing()
        with pytest.raises(NotImplementedError, match="partition_activations"):
            strata.checkpointing.configure(None, partition_activations=True)
        with pytest.raises(NotImplementedError, match="profile"):
            strata.checkpointing.configure(None, deepspeed_config={"activation_checkpointing": {"profile": True}})
        # No grad: the function simply runs.
        calls = []
        with torch.no_grad():
            out = strata.checkpointing.checkpoint(lambda t: calls.append(1) or t * 2, torch.ones(3))
        assert calls == [1] and torch.equal(out, torch.full((3,), 2.0))
    finally:
        strata.checkpointing.configure(None, checkpoint_in_cpu=False)
