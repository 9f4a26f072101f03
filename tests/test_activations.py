"""Activation offloading against plain PyTorch: gradients bitwise identical for every
policy on several model families, plus dedup, in-place safety, retain_graph,
micro-batches, checkpointed models, autocast and fallbacks (NOTE [ Activation offload rules ])."""

from __future__ import annotations

import contextlib
import logging
import time

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import tiermem
from tiermem.activations import BlockPolicy, BlockProfile, adaptive_keep, find_blocks, resolve_policies

D = 64


class Block(nn.Module):
    """A pre-LN decoder block; ``x @ x.t()``-style sharing comes from attention's views."""

    def __init__(self, d: int = D) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        scores = (q @ k.transpose(-2, -1)) / D**0.5
        mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).triu(1)
        attention = scores.masked_fill(mask, float("-inf")).softmax(-1)
        x = x + self.proj(attention @ v)
        return x + self.mlp(self.ln2(x))


class Decoder(nn.Module):
    def __init__(self, layers: int = 4, checkpointing: str | None = None) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, D)
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.head = nn.Linear(D, 50)
        self.checkpointing = checkpointing

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            if self.checkpointing is None:
                h = block(h)
            else:
                h = checkpoint(block, h, use_reentrant=self.checkpointing == "reentrant")
        return self.head(h)


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, D)
        layer = nn.TransformerEncoderLayer(D, 4, 4 * D, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 3, enable_nested_tensor=False)
        self.head = nn.Linear(D, 50)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)))


class EncoderDecoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, D)
        self.transformer = nn.Transformer(D, 4, 2, 2, 4 * D, dropout=0.0, batch_first=True)
        self.head = nn.Linear(D, 50)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        return self.head(self.transformer(x, x))


FAMILIES = {"decoder": Decoder, "encoder": Encoder, "encoder-decoder": EncoderDecoder}
POLICIES = ["keep", "recompute", "host", "nvme", "auto", {0: "nvme", 1: "recompute", 2: "host"}]


@pytest.fixture
def runtime(tmp_path):
    config = {
        "device": {"capacity": "512MiB", "device": "cpu"},
        "host": {"capacity": "512MiB"},
        "nvme": {"paths": [str(tmp_path)], "capacity": "2GiB", "block_size": "256KiB"},
        "activations": {"min_bytes": "4KiB"},
        "scheduler": {"loop": "asyncio"},
    }
    with tiermem.Runtime(config) as rt:
        yield rt
    assert list(tmp_path.iterdir()) == []


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50, (4, 48), generator=generator), torch.randint(0, 50, (4, 48), generator=generator)


def _step(model: nn.Module, context, seed: int = 0, **backward) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    tokens, targets = _batch(seed)
    with context:
        loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        loss.backward(**backward)
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def _settled_activations(rt: tiermem.Runtime) -> dict:
    """``activations`` stats once no move is queued or in flight. A write cancelled when
    the graph freed its object ends on the scheduler's thread, possibly after backward
    returned, and only then leaves the resident count."""
    deadline = time.monotonic() + 30  # a bound on a hang, not a timing assert
    while time.monotonic() < deadline:
        scheduler = rt.scheduler.statistics()
        if not any(scheduler.inflight_bytes.values()) and not any(scheduler.queued.values()):
            break
        time.sleep(0.001)
    return rt.stats().as_dict()["activations"]


def offloaded(activations: dict, tier: str) -> bool:
    """Bytes went to ``tier``: written there, or on their way until backward wanted them
    back first (bytes_written counts only writes that landed; on a loaded machine every
    write of a small model may still be queued when backward starts)."""
    return activations["bytes_written"][tier] > 0 or activations["cancelled"] > 0


def _assert_identical(got, want) -> None:
    assert torch.equal(got[0], want[0])
    for a, b in zip(got[1], want[1], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("policy", POLICIES, ids=str)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_gradients_bitwise_identical_to_plain_pytorch(runtime, family, policy):
    torch.manual_seed(0)
    model = FAMILIES[family]()
    want = _step(model, contextlib.nullcontext())
    for _ in range(2):  # the second step runs auto's adapted policy
        _assert_identical(_step(model, runtime.offload_activations(model, policy=policy)), want)
    stats = _settled_activations(runtime)
    assert stats["resident_bytes"] == 0  # everything freed with the graph
    if policy in ("nvme", "auto"):
        assert offloaded(stats, "nvme")
    if policy == "host":
        assert offloaded(stats, "host")


def test_offloaded_blocks_leave_the_device_once_written(runtime):
    torch.manual_seed(0)
    model = Decoder(layers=6)
    tokens, targets = _batch()
    with runtime.offload_activations(model, policy="keep"):
        loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        kept = runtime.registry.resident_bytes("activation", "device")
        loss.backward()
    with runtime.offload_activations(model, policy="nvme"):
        loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        for obj in runtime.registry.objects():  # let the write-backs land
            runtime.registry.wait(obj)
        offloaded = runtime.registry.resident_bytes("activation", "device")
        loss.backward()
    # Only the last block and what lies outside the blocks stay: well under half.
    assert 0 < offloaded < 0.5 * kept
    assert runtime.stats().as_dict()["activations"]["bytes_read"]["nvme"] > 0


def test_an_offloading_forward_trims_the_heap_once_at_its_end(runtime, monkeypatch):
    """NOTE [ Returning freed memory ] rule 5: the heap holes offloaded blocks leave are handed
    back once a forward, at its end (not at every block), and only when it offloaded."""
    trims = []
    monkeypatch.setattr(tiermem.malloc, "trim", lambda: trims.append(1) or True)
    torch.manual_seed(0)
    model = Decoder(layers=6)
    tokens, targets = _batch()
    for policy, want in (("keep", 0), ("nvme", 2)):
        with runtime.offload_activations(model, policy=policy) as offloader:
            offloader.trimming.every = 1  # any offloaded byte fills the interval
            for _ in range(2):
                nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()).backward()
        assert len(trims) == want, policy
        trims.clear()


def test_a_tensor_and_its_transpose_share_bytes_but_keep_their_views(runtime):
    class Gram(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(D, D)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.linear(x)
            return (h @ h.transpose(-2, -1)) @ h  # saves h and h.T: one storage, two views

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Gram() for _ in range(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x).tanh()
            return x

    torch.manual_seed(0)
    model = Model()
    x = torch.randn(2, 40, D) / 10

    def run(context):
        model.zero_grad(set_to_none=True)
        with context:
            out = model(x).square().mean()
            out.backward()
        return out.detach(), [p.grad.clone() for p in model.parameters()]

    want = run(contextlib.nullcontext())
    _assert_identical(run(runtime.offload_activations(model, policy="nvme")), want)
    assert runtime.stats().as_dict()["activations"]["dedup_hits"] > 0


def test_in_place_change_of_a_saved_tensor_raises_pytorchs_error(runtime):
    class Sloppy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(D, D)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.linear(x).sigmoid()  # sigmoid saves its output
            out = y * 3
            y.mul_(2)  # ...which is then modified in place
            return out

    model = nn.Sequential()
    model.blocks = nn.ModuleList(Sloppy() for _ in range(2))
    model.forward = lambda x: model.blocks[1](model.blocks[0](x))  # type: ignore[method-assign]
    x = torch.randn(8, 128, D)
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as plain:
        model(x).sum().backward()
    for policy in ("keep", "nvme"):
        with (
            pytest.raises(RuntimeError, match="modified by an inplace operation") as ours,
            runtime.offload_activations(model, policy=policy),
        ):
            model(x).sum().backward()
        assert "is at version 1; expected version 0" in str(ours.value)
    assert "expected version 0" in str(plain.value)


@pytest.mark.parametrize("edited", ["small saved tensor", "parameter"])
def test_in_place_change_of_a_tensor_kept_as_it_is_raises_pytorchs_error(runtime, edited):
    """Rules 3 and 5: a saved tensor below ``min_bytes`` and a parameter are kept as they are, and
    their in-place change is still PyTorch's error, not a gradient of the changed values (TRAPS 1:
    the hooks switch autograd's own check off for them too)."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.linear(x).sigmoid()  # saves its output: 512 bytes, kept as it is
            if edited == "small saved tensor":
                y.mul_(2)
            return y

    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block())
    x = torch.randn(8, 16)

    def run() -> None:
        out = model(x).sum()
        if edited == "parameter":
            with torch.no_grad():
                model[1].linear.weight.mul_(0.5)  # between forward and backward
        out.backward()

    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        run()
    for policy in ("keep", "host", "nvme"):
        with (
            pytest.raises(RuntimeError, match="modified by an inplace operation") as ours,
            runtime.offload_activations(model, blocks=[Block], policy=policy),
        ):
            run()
        assert "expected version" in str(ours.value)


def test_retain_graph_allows_a_second_backward(runtime):
    torch.manual_seed(0)
    model = Decoder()
    want_first = _step(model, contextlib.nullcontext(), retain_graph=True)
    model.zero_grad(set_to_none=True)
    tokens, targets = _batch()
    with runtime.offload_activations(model, policy="nvme"):
        loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        loss.backward(retain_graph=True)
        first = [p.grad.clone() for p in model.parameters()]
        loss.backward()  # accumulates a second, identical gradient
    for a, b, want in zip(first, (p.grad for p in model.parameters()), want_first[1], strict=True):
        assert torch.equal(a, want)
        assert torch.equal(b, want + want)


def test_micro_batches_and_gradient_accumulation(runtime):
    torch.manual_seed(0)
    model = Decoder()

    def run(context_factory):
        model.zero_grad(set_to_none=True)
        with context_factory():
            losses = []
            for seed in (1, 2):  # two forwards, one backward
                tokens, targets = _batch(seed)
                losses.append(nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()))
            sum(losses).backward()
        for seed in (3, 4):  # then accumulation: forward+backward twice
            with context_factory():
                tokens, targets = _batch(seed)
                nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()).backward()
        return [p.grad.clone() for p in model.parameters()]

    want = run(contextlib.nullcontext)
    got = run(lambda: runtime.offload_activations(model, policy="nvme"))
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_no_grad_regions_capture_nothing(runtime):
    model = Decoder()
    tokens, _ = _batch()
    with runtime.offload_activations(model, policy="nvme"), torch.no_grad():
        model(tokens)
    assert runtime.stats().as_dict()["activations"]["captured_bytes"] == 0


@pytest.mark.parametrize("mode", ["reentrant", "non-reentrant"])
@pytest.mark.parametrize("policy", ["nvme", "recompute", "keep"])
def test_models_that_already_checkpoint(runtime, mode, policy):
    torch.manual_seed(0)
    model = Decoder(checkpointing=mode)
    want = _step(model, contextlib.nullcontext())
    _assert_identical(_step(model, runtime.offload_activations(model, policy=policy)), want)


def test_autocast_bf16_matches_plain_autocast(runtime):
    torch.manual_seed(0)
    model = Decoder()

    def run(context):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return _step(model, context)

    want = run(contextlib.nullcontext())
    _assert_identical(run(runtime.offload_activations(model, policy="nvme")), want)


def test_disk_full_falls_back_to_keep_with_a_warning(tmp_path, caplog):
    config = {
        "device": {"capacity": "512MiB", "device": "cpu"},
        "host": {"capacity": "64MiB"},
        "nvme": {"paths": [str(tmp_path)], "capacity": "64KiB", "block_size": "64KiB"},
        "activations": {"min_bytes": "4KiB"},
        "scheduler": {"loop": "asyncio"},
    }
    torch.manual_seed(0)
    model = Decoder()
    want = _step(model, contextlib.nullcontext())
    with tiermem.Runtime(config) as rt, caplog.at_level(logging.WARNING, logger="tiermem.activations"):
        _assert_identical(_step(model, rt.offload_activations(model, policy="nvme")), want)
        assert rt.stats().as_dict()["activations"]["fallbacks"] > 0
    assert "falls back to keep" in caplog.text


def test_device_budget_too_small_is_a_clear_error(tmp_path):
    config = {
        "device": {"capacity": "64KiB", "device": "cpu"},
        "host": {"capacity": "64MiB"},
        "nvme": {"paths": [str(tmp_path)], "capacity": "256MiB"},
        "activations": {"min_bytes": "4KiB"},
        "scheduler": {"loop": "asyncio"},
    }
    model = Decoder()
    tokens, _ = _batch()
    with tiermem.Runtime(config) as rt:
        with (
            pytest.raises(MemoryError, match=r"device budget.*\[device\] capacity"),
            rt.offload_activations(model, policy="keep"),
        ):
            model(tokens)
        assert rt.stats().as_dict()["tiers"]["device"]["current_bytes"] == 0


def test_policy_mapping_by_name_and_errors():
    model = Decoder()
    names = [name for name, _ in find_blocks(model)]
    assert names == ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    policies, adaptive = resolve_policies({"blocks.1": "nvme", 3: "recompute"}, names, "keep")
    assert policies == [BlockPolicy.KEEP, BlockPolicy.NVME, BlockPolicy.KEEP, BlockPolicy.RECOMPUTE]
    assert not adaptive
    assert resolve_policies("nvme", names, "keep")[0][-1] is BlockPolicy.KEEP  # the last block stays
    with pytest.raises(ValueError, match="'fast' is not one of"):
        resolve_policies("fast", names, "keep")
    with pytest.raises(ValueError, match=r"block 'blocks\.9'.*block 2: 'disk'"):
        resolve_policies({"blocks.9": "nvme", 2: "disk"}, names, "keep")


def test_find_blocks_on_every_family_and_overrides():
    assert len(find_blocks(Encoder())) == 3
    assert [n for n, _ in find_blocks(EncoderDecoder())] == [
        "transformer.encoder.layers.0",
        "transformer.encoder.layers.1",
        "transformer.decoder.layers.0",
        "transformer.decoder.layers.1",
    ]
    assert [n for n, _ in find_blocks(Decoder(), blocks=["blocks.2", "head"])] == ["blocks.2", "head"]
    assert len(find_blocks(Decoder(), blocks=[Block])) == 4
    with pytest.raises(ValueError, match=r"no nn\.ModuleList"):
        find_blocks(nn.Linear(3, 3))
    with pytest.raises(ValueError, match="names not found: \\['nope'\\]"):
        find_blocks(Decoder(), blocks=["nope"])
    model = Decoder()
    assert [n for n, _ in find_blocks(model, blocks=Block)] == [f"blocks.{i}" for i in range(4)]  # one type alone
    assert [n for n, _ in find_blocks(model, blocks="blocks.2")] == ["blocks.2"]  # one name, not its letters
    assert [n for n, _ in find_blocks(model, blocks=model.blocks)] == [f"blocks.{i}" for i in range(4)]
    assert [n for n, _ in find_blocks(model, blocks=[model.blocks[1], "head"])] == ["blocks.1", "head"]
    with pytest.raises(ValueError, match=r"names not found: none; 1 of the modules given are not in this model"):
        find_blocks(model, blocks=[Block()])
    with pytest.raises(TypeError, match=r"blocks= takes module types.*got 3 of type int"):
        find_blocks(model, blocks=[Block, 3])
    with pytest.raises(TypeError, match=r"blocks= takes module types.*got 3 of type int"):
        find_blocks(model, blocks=3)


@pytest.mark.parametrize(
    ("policy", "said"),
    [(3, r"got 3 of type int$"), (["nvme"] * 4, r"of type list \(a list: give dict\(enumerate\(policies\)\)\)")],
)
def test_a_policy_of_another_type_is_refused_saying_what_it_takes(runtime, policy, said):
    model = Decoder()
    refused = r"policy= takes a policy name .* or a mapping .*" + said
    with pytest.raises(TypeError, match=refused), runtime.offload_activations(model, policy=policy):
        pass


def test_adaptive_keep_rule():
    blocks = [BlockProfile(forward_s=0.01, saved_bytes=10 << 20)] * 8
    assert adaptive_keep(blocks, write_bw=100e9, read_bw=100e9) == 1  # a fast disk hides everything
    assert adaptive_keep(blocks, write_bw=1e6, read_bw=1e6) == 8  # a slow one hides nothing
    kept = [adaptive_keep(blocks, write_bw=bw, read_bw=bw) for bw in (1e9, 5e8, 3e8, 1e8)]
    assert kept == sorted(kept) and 1 < kept[1] < kept[-1] < 8  # the slower the disk, the more kept
    assert adaptive_keep([], 1e9, 1e9) == 0


def test_instance_forwards_are_used_and_restored(runtime):
    """A forward patched onto a block (accelerate/peft style) runs under recompute and is
    still there after the context; blocks keep their own forward otherwise (found in review)."""
    torch.manual_seed(0)
    model = Decoder(layers=3)
    calls = []
    for block in model.blocks:
        original = block.forward

        def patched(x, original=original):
            calls.append(1)
            return original(x)

        block.forward = patched
    _step(model, runtime.offload_activations(model, policy="recompute"))
    assert calls  # the patched forward ran
    assert all("forward" in block.__dict__ for block in model.blocks)
    with runtime.offload_activations(model, policy="keep"):
        pass
    assert all(block.__dict__["forward"].__name__ == "patched" for block in model.blocks)


def test_block_groups_do_not_accumulate_over_steps(runtime):
    model = Decoder(layers=3)
    offloader = runtime.offload_activations(model, policy="recompute")
    for seed in range(20):
        _step(model, offloader, seed=seed)
    assert len(offloader.forwards.groups) <= 3


def test_a_one_layer_stack_is_still_a_block(runtime):
    torch.manual_seed(0)
    model = Decoder(layers=1)
    assert [n for n, _ in find_blocks(model)] == ["blocks.0"]
    want = _step(model, contextlib.nullcontext())
    _assert_identical(_step(model, runtime.offload_activations(model, policy="recompute")), want)


def _hooks_and_patches(model: nn.Module) -> list[str]:
    return [
        f"{name or 'model'}: {kind}"
        for name, module in model.named_modules()
        for kind, there in (
            ("forward pre-hooks", module._forward_pre_hooks),
            ("forward hooks", module._forward_hooks),
            ("patched forward", "forward" in module.__dict__),
        )
        if there
    ]


@pytest.mark.parametrize("failing", ["wrap-recompute", "saved-tensors-hooks"])
def test_a_context_whose_entry_fails_leaves_the_model_as_it_was(runtime, monkeypatch, failing):
    """Found in review: ``__exit__`` never runs when ``__enter__`` raises, so an entry that fails
    after the rule-3 pre-hooks are registered (a forward wrapped for recompute, the saved-tensor
    hooks pushed) removes what it did and re-raises: no hook or patched forward stays."""
    torch.manual_seed(0)
    model = Decoder(layers=3)
    want = _step(model, contextlib.nullcontext())
    offloader = runtime.offload_activations(model, policy="recompute")
    if failing == "wrap-recompute":  # the first block's forward is wrapped, the second's fails
        wrap = offloader._wrap_recompute

        def wrap_then_fail(block, index, always):
            if index == 1:
                raise RuntimeError("injected")
            wrap(block, index, always)

        monkeypatch.setattr(offloader, "_wrap_recompute", wrap_then_fail)
    else:

        def fail(_self):
            raise RuntimeError("injected")

        monkeypatch.setattr(torch.autograd.graph.saved_tensors_hooks, "__enter__", fail)
    with pytest.raises(RuntimeError, match="injected"), offloader:
        pytest.fail("the body never runs")
    assert _hooks_and_patches(model) == []
    monkeypatch.undo()
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None  # nothing left pushed
    _assert_identical(_step(model, contextlib.nullcontext()), want)
    _assert_identical(_step(model, offloader), want)  # the same offloader still works
    assert _hooks_and_patches(model) == []
