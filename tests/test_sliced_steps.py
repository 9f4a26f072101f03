"""A parameter larger than the host's staging room steps in slices (issue 34 items 2 and 3; NOTE
[ Sliced steps ] in ``tiermem/states/chunk_step.py``, NOTE [ Default placement rule ] rules 6 and 7).

An embedding whose NVMe home is several times the host steps slice by slice, each slice's home
ranges and gradients read through the registry's range copies and written back: bitwise the
whole-tensor step of every element-wise optimizer and flag. An optimizer whose state is not
element-wise stages the chunk whole, and the placement refuses up front when the host cannot
hold that, saying why. A GPT-2 with vocabulary 50,257 and a Llama with vocabulary 128,256 train
bitwise plain PyTorch at host 10% of their state bytes and at the device capacity the refusal
and the README name, and one byte less is refused up front with that number."""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

import pytest
import torch

import tiermem
from tiermem.app.models.data import MarkovChainData
from tiermem.app.models.gpt import GPT, GPTConfig
from tiermem.errors import StatesMemoryError
from tiermem.states.chunk_step import ChunkStep
from tiermem.states.homes import Homes
from tiermem.states.optimizer import SUPPORTED

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: one OpenMP thread (TRAPS 7)

KiB = 1 << 10
#: an embedding (256 KiB) 16 times the largest other parameter, as a vocabulary's is
CONFIG = GPTConfig(n_layer=1, d_model=32, n_head=2, vocab_size=2048, seq_len=16)
#: every chunk on NVMe, chunks of 16 KiB (the embedding's its own 256 KiB), slices of 32 KiB
PLAN = {"chunk_size": "16KiB", "persistent_chunks": 0, "state_home": "nvme", "slice_bytes": "32KiB"}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def bitwise(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(bits(x), bits(y)) for x, y in zip(a, b, strict=True))


def gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(CONFIG)


@functools.cache
def batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    data = MarkovChainData(CONFIG.vocab_size, CONFIG.seq_len, seed=0)  # its table takes a while: once
    return [data.batch(2, torch.device("cpu")) for _ in range(steps)]


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int = 3) -> list[torch.Tensor]:
    losses = []
    for x, y in batches(steps):
        loss = model(x, y)[1]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return losses


def settings(tmp_path: Path, device: int, host: int, nvme: int = 64 << 20) -> dict[str, Any]:
    return {
        "device": {"device": "cpu", "capacity": device},
        "host": {"capacity": host},
        "nvme": {"paths": [str(tmp_path)], "capacity": nvme, "block_size": "64KiB"},
        "activations": {"min_bytes": "16KiB"},
    }


#: every element-wise optimizer (NOTE [ Exact optimizer step ] rule 6) and the flags that change its math
OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "AdamW": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    "AdamW-foreach": (torch.optim.AdamW, {"lr": 1e-2, "foreach": True}),
    "AdamW-fused": (torch.optim.AdamW, {"lr": 1e-2, "fused": True}),
    "AdamW-amsgrad-maximize": (torch.optim.AdamW, {"lr": 1e-2, "amsgrad": True, "maximize": True}),
    "Adam": (torch.optim.Adam, {"lr": 1e-2}),
    "Adam-foreach": (torch.optim.Adam, {"lr": 1e-2, "foreach": True}),
    "Adam-fused": (torch.optim.Adam, {"lr": 1e-2, "fused": True}),
    "SGD-nesterov": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    "SGD-foreach": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "foreach": True}),
    "SGD-fused": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "fused": True}),
    "Adagrad": (torch.optim.Adagrad, {"lr": 0.1}),
    "RMSprop": (torch.optim.RMSprop, {"lr": 1e-2, "momentum": 0.5, "centered": True}),
    "Adamax": (torch.optim.Adamax, {"lr": 1e-2}),
    "NAdam": (torch.optim.NAdam, {"lr": 1e-2}),
    "RAdam": (torch.optim.RAdam, {"lr": 1e-2}),
    "Adadelta": (torch.optim.Adadelta, {"lr": 1.0}),
    "Rprop": (torch.optim.Rprop, {"lr": 1e-2}),
    "ASGD": (torch.optim.ASGD, {"lr": 1e-2, "t0": 1.0}),
}


def test_every_supported_optimizer_is_listed_here():
    assert {cls for cls, _ in OPTIMIZERS.values()} == set(SUPPORTED)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_sliced_step_is_bitwise_the_whole_step(tmp_path, name):
    """The embedding's home (master and states, 512 KiB to 1 MiB) is larger than the host (384 KiB): only slices fit."""
    cls, kwargs = OPTIMIZERS[name]
    plain = gpt()
    want_losses = train(plain, cls(plain.parameters(), **kwargs))
    with tiermem.Runtime(settings(tmp_path, 8 << 20, 384 * KiB)) as rt:
        model, optimizer = rt.manage(gpt(), cls, plan=PLAN, **kwargs)
        assert rt.plan.slice_bytes == 32 * KiB
        (embedding,) = [c for c in rt._model_states[-1].chunks if c.slice_span is not None]
        assert embedding.nbytes == 256 * KiB and embedding.home_bytes > rt.tiers["host"].capacity
        losses = train(model, optimizer)
        assert rt.tiers["host"].statistics().peak_bytes <= 384 * KiB
    assert bitwise(losses, want_losses)
    assert bitwise(list(model.parameters()), list(plain.parameters()))
    assert list(tmp_path.glob("tiermem-*")) == []


class NormalizedSGD(torch.optim.Optimizer):
    """Per parameter (it declares the contract truthfully) but not element-wise: each update is
    divided by its whole gradient's norm, which a slice's norm is not."""

    tiermem_per_parameter = True

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    state = self.state[p]
                    state["trace"] = state.get("trace", torch.zeros_like(p)).mul_(0.9).add_(p.grad)
                    p.add_(state["trace"] / state["trace"].norm(), alpha=-group["lr"])


def test_a_state_that_is_not_element_wise_stages_whole_or_is_refused_saying_why(tmp_path):
    with tiermem.Runtime(settings(tmp_path, 8 << 20, 384 * KiB)) as rt, pytest.raises(StatesMemoryError) as refused:
        rt.manage(gpt(), NormalizedSGD, plan=PLAN)
    message = str(refused.value)
    assert "the host needs" in message and "not element-wise, so they step whole" in message, message
    # with room for two whole homes it steps whole, bitwise
    plain = gpt()
    want_losses = train(plain, NormalizedSGD(plain.parameters()))
    plan = {key: value for key, value in PLAN.items() if key != "slice_bytes"}
    with tiermem.Runtime(settings(tmp_path, 8 << 20, 2 << 20)) as rt:
        model, optimizer = rt.manage(gpt(), NormalizedSGD, plan=plan)
        assert rt.plan.slice_bytes is None
        assert all(c.slice_span is None for c in rt._model_states[-1].chunks)
        losses = train(model, optimizer)
    assert bitwise(losses, want_losses) and bitwise(list(model.parameters()), list(plain.parameters()))


def test_a_slice_size_the_host_cannot_stage_is_refused(tmp_path):
    with tiermem.Runtime(settings(tmp_path, 8 << 20, 384 * KiB)) as rt, pytest.raises(StatesMemoryError) as refused:
        rt.manage(gpt(), torch.optim.AdamW, plan={**PLAN, "slice_bytes": "128KiB"})
    assert "slice_bytes=131072 stages two slices of 128KiB" in str(refused.value)


# -- vocabularies of released models at host 10% ---------------------------------------------------

README = Path(__file__).resolve().parent.parent / "README.md"


def hf_model(kind: str) -> torch.nn.Module:
    """The README's two models (section "Big vocabularies"): tiny widths, real vocabularies."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(
            n_layer=2, n_embd=32, n_head=2, vocab_size=50257, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0,
        )  # fmt: skip
        return transformers.GPT2LMHeadModel(config)
    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=2,
        vocab_size=128256, max_position_embeddings=16,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def least_device(message: str) -> int:
    found = re.search(r"\[device\] \S+ \((\d+) bytes\)", message)
    assert found, message
    return int(found.group(1))


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_a_large_vocabulary_trains_at_host_10_percent_and_the_least_device_the_readme_names(tmp_path, kind):
    reference = hf_model(kind)
    vocab = reference.config.vocab_size
    state = 16 * sum(p.numel() for p in reference.parameters())
    largest = max(p.nbytes for p in reference.parameters())
    generator = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, vocab, (1, 16), generator=generator) for _ in range(2)]

    def run(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        losses = []
        for batch in ids:
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach())
        return losses

    want_losses = run(reference, torch.optim.AdamW(reference.parameters(), lr=1e-3))
    host, nvme = state // 10, 4 * state
    with tiermem.Runtime(settings(tmp_path, 64 << 10, host, nvme)) as rt, pytest.raises(StatesMemoryError) as refused:
        rt.manage(hf_model(kind), torch.optim.AdamW, lr=1e-3)
    device = least_device(str(refused.value))
    # the largest parameter and its gradient (NOTE [ Default placement rule ] rule 7); the tied
    # GPT-2 embedding beside one small chunk a block's module uses with it
    assert 2 * largest <= device <= 2 * largest + (128 << 10)
    assert f"{device:,} bytes" in README.read_text(encoding="utf-8")
    with tiermem.Runtime(settings(tmp_path, device - 1, host, nvme)) as rt, pytest.raises(StatesMemoryError) as less:
        rt.manage(hf_model(kind), torch.optim.AdamW, lr=1e-3)
    assert least_device(str(less.value)) == device
    with tiermem.Runtime(settings(tmp_path, device, host, nvme)) as rt:
        # every home on NVMe, as the default rule puts them here, stated so that the first step
        # does not plan (the planner profiles for seconds, then keeps this placement: README)
        model, optimizer = rt.manage(hf_model(kind), torch.optim.AdamW, plan={"state_home": "nvme"}, lr=1e-3)
        losses = run(model, optimizer)
        peaks = {tier: rt.tiers[tier].statistics().peak_bytes for tier in ("device", "host")}
        assert rt.plan.slice_bytes is not None
    assert peaks["device"] <= device and peaks["host"] <= host
    assert bitwise(losses, want_losses)
    assert bitwise(list(model.parameters()), list(reference.parameters()))
    assert list(tmp_path.glob("tiermem-*")) == []


def test_the_planner_counts_sliced_steps_and_its_peaks_hold(tmp_path, monkeypatch):
    """``sample=``: the planner's packings stage a slice of the embedding's NVMe home (NOTE
    [ Default placement rule ] rule 6 in its host bytes), not the whole home; training is bitwise,
    and what the host holds while slices are staged stays within its predicted host peak (its
    fragmentation margin included; the device's peak is checked by tests/test_oversized_chunks.py),
    also where chunks that ran ahead are still writing their homes as the slices begin (about 1 run
    in 36 here, before the sliced step waited for them)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    plain = gpt()
    want_losses = train(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2))
    state = 16 * sum(p.numel() for p in plain.parameters())
    x, y = batches(1)[0]
    (tmp_path / "nvme").mkdir()
    staged: list[int] = []
    stage_slice = Homes.stage_slice

    def recorded(self: Homes, *args: Any, **kwargs: Any) -> Any:
        piece = stage_slice(self, *args, **kwargs)
        staged.append(self.store.registry.tier_statistics("host").current_bytes)
        return piece

    monkeypatch.setattr(Homes, "stage_slice", recorded)
    with tiermem.Runtime(settings(tmp_path / "nvme", state // 2, state // 4)) as rt:
        model, optimizer = rt.manage(gpt(), torch.optim.AdamW, lr=1e-2, sample=(x, y))
        plan = rt.plan
        assert plan.predicted.step_s is not None  # planned, not the default rule's fallback
        (embedding,) = [c for c in rt._model_states[-1].chunks if c.slice_span is not None]
        assert plan.slice_bytes == plan.chunk_size
        assert plan.predicted.peak_bytes["host"] < embedding.home_bytes  # not even one whole home
        losses = train(model, optimizer)
        assert rt.tiers["device"].statistics().peak_bytes <= rt.tiers["device"].capacity
    assert staged and max(staged) <= plan.predicted.peak_bytes["host"] * (1 + plan.predicted.fragmentation_margin)
    assert bitwise(losses, want_losses) and bitwise(list(model.parameters()), list(plain.parameters()))


def test_the_default_placement_slices_and_planning_at_the_first_step_stays_exact(tmp_path):
    """No plan, no sample: the default rule puts the embedding's home on NVMe and slices its step;
    the first ``optimizer.step()`` profiles on the streamed chunks, plans and re-packs (their
    gradients read out of NVMe, NOTE [ Sliced steps ] rule 4), and training stays bitwise."""
    plain = gpt()
    want_losses = train(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2))
    state = 16 * sum(p.numel() for p in plain.parameters())
    with tiermem.Runtime(settings(tmp_path, state // 2, state // 6)) as rt:
        model, optimizer = rt.manage(gpt(), torch.optim.AdamW, lr=1e-2)
        chunks = rt._model_states[-1].chunks
        assert any(c.slice_span is not None for c in chunks)
        losses = train(model, optimizer)
        assert any(c.slice_span is not None for c in rt._model_states[-1].chunks)
    assert bitwise(losses, want_losses) and bitwise(list(model.parameters()), list(plain.parameters()))


@pytest.mark.parametrize(
    "declared",
    [{"grad_accumulation_steps": 1, "keep_gradients": False}, {"grad_accumulation_steps": 2}],
    ids=["streamed gradients", "accumulation"],
)
def test_declared_loops_step_a_sliced_chunk_at_optimizer_step(tmp_path, declared):
    """NOTE [ Sliced steps ] rule 4: other chunks step early in backward, the sliced one at
    ``optimizer.step()`` from its gradients on NVMe; bitwise plain PyTorch either way."""
    accumulation = declared["grad_accumulation_steps"]

    def loop(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        losses = []
        for i, (x, y) in enumerate(batches(4)):
            loss = model(x, y)[1]
            (loss / accumulation).backward()
            losses.append(loss.detach())
            if (i + 1) % accumulation == 0:
                optimizer.step()
                optimizer.zero_grad()
        return losses

    plain = gpt()
    want_losses = loop(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2))
    with tiermem.Runtime(settings(tmp_path, 8 << 20, 384 * KiB)) as rt:
        model, optimizer = rt.manage(gpt(), torch.optim.AdamW, plan=PLAN, lr=1e-2, **declared)
        losses = loop(model, optimizer)
        states = rt._model_states[-1]
        assert states.stepper.early_chunk_steps > 0 and any(c.slice_span for c in states.chunks)
    assert bitwise(losses, want_losses) and bitwise(list(model.parameters()), list(plain.parameters()))


def test_mixed_precision_steps_in_slices_as_it_steps_whole(tmp_path):
    """bf16 working parameters, fp32 masters in sections twice as wide (NOTE [ Chunk layout rules ]
    rule 6): the slices' ranges of the masters, states and working copy give the whole step."""
    runs = {}
    whole = {"chunk_size": "16KiB", "persistent_chunks": 0, "state_home": "host"}
    for name, plan, host in [("sliced", PLAN, 1 << 20), ("whole", whole, 16 << 20)]:
        with tiermem.Runtime(settings(tmp_path, 8 << 20, host)) as rt:
            model, optimizer = rt.manage(gpt(), torch.optim.AdamW, plan=plan, lr=1e-2, param_dtype=torch.bfloat16)
            assert any(c.slice_span for c in rt._model_states[-1].chunks) == (name == "sliced")
            losses = train(model, optimizer)
            state = optimizer.state_dict()["state"][0]
            runs[name] = (losses, [p.detach().clone() for p in model.parameters()], state)
    (losses, params, state), (want_losses, want_params, want_state) = runs["sliced"], runs["whole"]
    assert bitwise(losses, want_losses) and bitwise(params, want_params)
    assert state.keys() == want_state.keys() and all(torch.equal(state[k], want_state[k]) for k in state)


def test_range_copies_of_an_nvme_object_go_through_the_registry_checksummed(tmp_path):
    """NOTE [ Managed object rules ] rule 8: ranges of one NVMe object read into and written from
    a host object at any offset, with checksums verifying every read (records split by partial
    writes); the object never moves and the link counts the bytes."""
    config = settings(tmp_path, 1 << 20, 1 << 20)
    config["nvme"]["checksum"] = True
    data = torch.arange(40_000, dtype=torch.uint8)
    with tiermem.Runtime(config) as rt:
        stored = rt.registry.register(data.clone(), "nvme", dedup=False)
        room = rt.registry.register(torch.zeros(10_000, dtype=torch.uint8), "host", dedup=False)
        room.fill_from(stored, nbytes=7_000, source_offset=12_345, offset=1_000).wait()  # a range read
        assert torch.equal(room.tensor("host")[1_000:8_000], data[12_345:19_345])
        room.tensor("host")[1_000:8_000].add_(1)
        stored.fill_from(room, nbytes=7_000, source_offset=1_000, offset=12_345).wait()  # a range write
        want = data.clone()
        want[12_345:19_345] += 1
        assert stored.tier == "nvme" and torch.equal(stored.copy_out()[:40_000], want)
        moved = rt.registry.link_statistics()
        assert moved["nvme->host"].bytes >= 7_000 and moved["host->nvme"].bytes >= 7_000


def test_an_error_in_a_slice_is_raised_and_leaves_no_slice_on_the_host(tmp_path, monkeypatch):
    """NOTE [ Sliced steps ] rule 5: the third slice's compute fails; ``optimizer.step()`` raises
    that error once the slice in flight ended, and every slice's host buffer is freed."""
    compute = ChunkStep.compute
    calls = []

    def failing(self: ChunkStep) -> None:
        calls.append(self)
        if len(calls) == 3:
            raise RuntimeError("injected slice failure")
        compute(self)

    # the host bytes are compared across the step: no shadow of a step run ahead may land in
    # between (NOTE [ Speculative steps ]: on the CPU too, NVMe homes' host gradients are watched)
    monkeypatch.setenv("TIERMEM_MODEL_STATES_SPECULATIVE_STEPS", "off")
    with tiermem.Runtime(settings(tmp_path, 8 << 20, 384 * KiB)) as rt:
        model, optimizer = rt.manage(gpt(), torch.optim.AdamW, plan=PLAN, lr=1e-2)
        x, y = batches(1)[0]
        model(x, y)[1].backward()
        optimizer.step()  # the first step re-packs in execution order and steps
        optimizer.zero_grad()
        model(x, y)[1].backward()
        host = rt.tiers["host"].statistics().current_bytes
        monkeypatch.setattr(ChunkStep, "compute", failing)
        with pytest.raises(RuntimeError, match="injected slice failure"):
            optimizer.step()
        assert len(calls) >= 3 and rt.tiers["host"].statistics().current_bytes == host
    assert list(tmp_path.glob("tiermem-*")) == []


def test_a_checkpoint_of_a_sliced_model_loads_at_the_same_host(tmp_path):
    """rt.load writes a home the plan never stages whole (NOTE [ Sliced steps ] rule 4) by ranges:
    at the least device and host 10%, save after one step, load into a fresh runtime and take the
    second step: bitwise the uninterrupted run (staging the whole home raised "raise [host] capacity")."""
    reference = hf_model("gpt2")
    state = 16 * sum(p.numel() for p in reference.parameters())
    generator = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, reference.config.vocab_size, (1, 16), generator=generator) for _ in range(2)]

    def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor) -> torch.Tensor:
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    plain = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    want = [step(reference, plain, batch) for batch in ids]
    host, nvme, device = state // 10, 4 * state, 12_910_592  # the least device the README names
    config = settings(tmp_path, device, host, nvme)
    with tiermem.Runtime(config) as rt:
        model, optimizer = rt.manage(hf_model("gpt2"), torch.optim.AdamW, plan={"state_home": "nvme"}, lr=1e-3)
        first = step(model, optimizer, ids[0])
        rt.save(tmp_path / "checkpoint")
    with tiermem.Runtime(config) as rt:
        model, optimizer = rt.manage(hf_model("gpt2"), torch.optim.AdamW, plan={"state_home": "nvme"}, lr=1e-3)
        assert rt.plan.slice_bytes is not None
        rt.load(tmp_path / "checkpoint")
        second = step(model, optimizer, ids[1])
        host_peak = rt.tiers["host"].statistics().peak_bytes
    assert host_peak <= host
    assert bitwise([first, second], want)
    assert bitwise(list(model.parameters()), list(reference.parameters()))


def test_clipping_by_hand_over_a_sliced_gradient_fits_the_host_and_is_bitwise(tmp_path):
    """``clip_grad_norm_`` over a model whose embedding steps in slices, at the least device and
    host 10%: its norm is kept as the gradient lands and its scaling runs on each slice the step
    reads (NOTE [ Stored gradients ] rule 6), so the whole gradient is never staged (that raised
    "raise [host] capacity") and the result is bitwise plain PyTorch's."""
    reference = hf_model("gpt2")
    state = 16 * sum(p.numel() for p in reference.parameters())
    generator = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, reference.config.vocab_size, (1, 16), generator=generator) for _ in range(3)]

    def run(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        out = []
        for batch in ids:
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            out.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5))
            optimizer.step()
            optimizer.zero_grad()
            out.append(loss.detach())
        return out

    want = run(reference, torch.optim.AdamW(reference.parameters(), lr=1e-3))
    host, nvme, device = state // 10, 4 * state, 12_910_592  # the least device the README names
    with tiermem.Runtime(settings(tmp_path, device, host, nvme)) as rt:
        model, optimizer = rt.manage(hf_model("gpt2"), torch.optim.AdamW, plan={"state_home": "nvme"}, lr=1e-3)
        got = run(model, optimizer)
        assert rt.plan.slice_bytes is not None
        host_peak = rt.tiers["host"].statistics().peak_bytes
    assert host_peak <= host
    assert bitwise(got, want)
    assert bitwise(list(model.parameters()), list(reference.parameters()))
