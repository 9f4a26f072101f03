"""Frozen parameters cost only what they use (issue 34 item 1): a LoRA base (PEFT's or
hand-written adapters) streams through a device of a tenth of its bytes for forward and backward
only, with no gradient buffer, optimizer state or staging for a step, and trains bitwise like
plain PyTorch; a model managed without an optimizer (a distillation teacher) is frozen and
streamed beside a trained one in the same Runtime."""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import tiermem
from tiermem.errors import PlanError, StatesMemoryError
from tiermem.layout.chunks import ParamInfo, pack
from tiermem.layout.placement import Budgets, ChunkNeeds, PlanRequest, decide
from tiermem.planner.state_costs import Packing, StatesChoice, states_cost
from tiermem.states.errors import StatesUsageError

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: one OpenMP thread (TRAPS 7)

MiB = 1 << 20
VOCAB = 2048
STEPS = 4
#: a plan whose every field follows the default rule (NOTE [ Default placement rule ]): no profiling
DEFAULT_RULE = {"chunk_size": "auto"}


def llama(seed: int = 0, layers: int = 6, width: int = 256) -> nn.Module:
    """The issue's base: 6 layers of width 256, vocabulary 2048, 22 MiB of fp32 weights."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        num_hidden_layers=layers, hidden_size=width, intermediate_size=3 * width, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def peft_lora(seed: int = 0) -> nn.Module:
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    with warnings.catch_warnings():  # peft 0.21.2 reads a property transformers 5 deprecates
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
        return peft.get_peft_model(llama(seed), config)


class LoRALinear(nn.Module):
    """A hand-written LoRA adapter around a frozen ``nn.Linear``: ``base(x) + B(A(x)) * alpha / r``."""

    def __init__(self, base: nn.Linear, r: int = 8, alpha: float = 16.0) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.a = nn.Parameter(torch.randn(r, base.in_features) / math.sqrt(base.in_features))
        self.b = nn.Parameter(torch.randn(base.out_features, r) * 0.01)  # nonzero: both adapters move from step 1
        self.scale = alpha / r

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.a.t() @ self.b.t()) * self.scale


def hand_lora(seed: int = 0) -> nn.Module:
    model = llama(seed).requires_grad_(False)
    for layer in model.model.layers:
        layer.self_attn.q_proj = LoRALinear(layer.self_attn.q_proj)
        layer.self_attn.v_proj = LoRALinear(layer.self_attn.v_proj)
    return model


def ids(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(step))


def lm_loop(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    losses = []
    for step in range(STEPS):
        loss = model(input_ids=ids(step), labels=ids(step)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return losses


def trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def frozen_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)


def config(tmp_path, device: int, host: int) -> dict[str, Any]:
    return {
        "device": {"capacity": device, "device": "cpu"},
        "host": {"capacity": host},
        "nvme": {"paths": [str(tmp_path)], "capacity": "256MiB", "block_size": "64KiB"},
        "scheduler": {"loop": "asyncio"},
    }


def assert_bitwise(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a.detach().reshape(-1).view(torch.uint8), b.detach().reshape(-1).view(torch.uint8))


def within_capacities(rt: tiermem.Runtime) -> dict[str, Any]:
    tiers = rt.stats().as_dict()["tiers"]
    for name in ("device", "host", "nvme"):
        assert tiers[name]["peak_bytes"] <= tiers[name]["capacity"], name
    return tiers


@pytest.mark.parametrize("build", [peft_lora, hand_lora], ids=["peft", "hand-written"])
def test_lora_at_a_tenth_of_the_base_trains_bitwise(tmp_path, monkeypatch, build: Callable[[], nn.Module]):
    """The issue's case: LoRA r=8 on q_proj/v_proj over a 22 MiB Llama, device and host 10% of the
    base bytes, the rest on NVMe (refused before: the placement charged frozen chunks gradient
    buffers and staging room). Frozen chunks never step: only the adapters' chunk does."""
    plain = build()
    want = lm_loop(plain, torch.optim.AdamW(trainable(plain), lr=1e-3))
    model = build()
    base = frozen_bytes(model)
    assert base > 20 * MiB
    with tiermem.Runtime(config(tmp_path, base // 10, base // 10)) as rt:
        # The default rule alone (a first-step plan's profiling costs seconds here; the planner's
        # side is test_the_planner_predicts_the_device_peak_of_lora)
        model, optimizer = rt.manage(model, torch.optim.AdamW, lr=1e-3, plan=DEFAULT_RULE)
        states = rt.__dict__["_model_states"][0]
        staged: list[bool] = []  # per NVMe home staged on the host for a step: is its chunk trainable?
        stage = states.homes.stage

        def stage_seen(chunk: Any, known: Any = None) -> None:
            staged.append(chunk.trainable)
            stage(chunk, known)

        monkeypatch.setattr(states.homes, "stage", stage_seen)
        got = lm_loop(model, optimizer)
        # NOTE [ Chunk layout rules ] rule 1: the adapters' one chunk leads; streamed here (the
        # device is too small to keep it), its home is the first the host takes, so no step
        # stages a home (a frozen one never would)
        assert states.chunks[0].trainable and not any(c.trainable for c in states.chunks[1:])
        assert states.plan.state_home[0] == "host" and "nvme" in states.plan.state_home
        assert staged == []
        assert any(not c.trainable and not c.persistent for c in states.chunks)  # the base streams
        model(input_ids=ids(0), labels=ids(0)).loss.backward()
        assert all(c.grad is None for c in states.chunks if not c.trainable)  # frozen: no gradient buffer
        assert all(c.grad is not None for c in states.chunks if c.trainable)
        optimizer.zero_grad()
        tiers = within_capacities(rt)
        assert tiers["nvme"]["peak_bytes"] > 0
    assert_bitwise(got, want)
    assert_bitwise(trainable(model), trainable(plain))  # the adapters
    assert_bitwise(list(model.parameters()), list(plain.parameters()))  # and the untouched base
    assert list(tmp_path.iterdir()) == []


def test_the_planner_predicts_the_device_peak_of_lora(tmp_path):
    """The planner's candidates and cost model count frozen chunks as parameter bytes streamed for
    forward and backward only: at 15% of the base bytes it finds a plan that streams the base,
    and the measured device peak is within the bounds of full training's (tests/test_planner.py:
    above the plan's demand less 15%, below the prediction plus 10%). It keeps the adapters' one
    chunk on the device (NOTE [ Cost model ] rule 8): streamed, it took the base's one buffer in
    every block and the base was read 3.9 times a step (89 MiB of NVMe for 22 MiB); kept, every
    base chunk is read at most once a pass."""
    plain = hand_lora()
    want = lm_loop(plain, torch.optim.AdamW(trainable(plain), lr=1e-3))
    model = hand_lora()
    capacity = frozen_bytes(model) * 15 // 100
    with tiermem.Runtime(config(tmp_path, capacity, capacity)) as rt:
        model, optimizer = rt.manage(
            model, torch.optim.AdamW, lr=1e-3, sample=lambda m: m(input_ids=ids(0), labels=ids(0)).loss
        )
        plan = rt.plan
        assert plan.persistent_chunks < plan.chunks  # the base streams
        chunks = rt.__dict__["_model_states"][0].chunks
        assert chunks[0].trainable and chunks[0].persistent  # the adapters stay on the device
        streamed = sum(c.nbytes for c in chunks if not c.persistent)
        rt.tiers["device"].reset_peak()  # the prediction is of the steps, not of the profiling
        before = rt.stats().as_dict()["links"]
        got = lm_loop(model, optimizer)
        after = rt.stats().as_dict()["links"]
        device = within_capacities(rt)["device"]
    read = sum(after[k]["bytes"] - before.get(k, {"bytes": 0})["bytes"] for k in ("nvme->device", "host->device"))
    assert read <= 2 * streamed * STEPS  # forward and backward, each chunk once at most
    demand = rt.decision.estimate.device_demand
    assert demand * 0.85 <= device["peak_bytes"] <= plan.predicted.peak_bytes["device"] * 1.1
    assert_bitwise(got, want)
    assert_bitwise(list(model.parameters()), list(plain.parameters()))


def test_a_teacher_without_an_optimizer_and_a_student_share_one_runtime(tmp_path):
    """Distillation: the teacher (weights larger than the device) is managed without an optimizer,
    frozen and streamed; the student trains beside it; the student's losses and weights are
    bitwise plain PyTorch's."""

    def student_of(seed: int) -> nn.Module:
        return llama(seed, layers=2, width=128)

    def distil(teacher: nn.Module, student: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        losses = []
        for step in range(STEPS):
            with torch.no_grad():
                target = teacher(input_ids=ids(step)).logits.log_softmax(-1)
            logits = student(input_ids=ids(step)).logits.log_softmax(-1)
            loss = nn.functional.kl_div(logits, target, log_target=True, reduction="batchmean")
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach())
        return losses

    plain_teacher, plain_student = llama(1), student_of(2)
    want = distil(plain_teacher, plain_student, torch.optim.AdamW(plain_student.parameters(), lr=1e-3))
    teacher, student = llama(1), student_of(2)
    teacher_bytes = sum(p.numel() * p.element_size() for p in teacher.parameters())
    student_state = 16 * sum(p.numel() for p in student.parameters())
    device = teacher_bytes // 10 + student_state // 4
    assert teacher_bytes > device
    with tiermem.Runtime(config(tmp_path, device, teacher_bytes // 10 + 2 * student_state)) as rt:
        managed = rt.manage(teacher)
        assert managed is teacher and not any(p.requires_grad for p in teacher.parameters())
        student, optimizer = rt.manage(student, torch.optim.AdamW, lr=1e-3, plan=DEFAULT_RULE)
        got = distil(teacher, student, optimizer)
        teacher_states = rt.__dict__["_model_states"][0]
        assert teacher_states.chunk_steps == 0 and all(c.grad is None for c in teacher_states.chunks)
        assert not all(c.persistent for c in teacher_states.chunks)  # it streamed
        within_capacities(rt)
        with pytest.raises(StatesUsageError, match="requires_grad"):  # frozen at rt.manage: no room for gradients
            teacher.lm_head.weight.requires_grad_(True)
            teacher(input_ids=ids(0))
        teacher.lm_head.weight.requires_grad_(False)
    assert_bitwise(got, want)
    assert_bitwise(list(student.parameters()), list(plain_student.parameters()))
    assert_bitwise(list(teacher.parameters()), list(plain_teacher.parameters()))
    assert list(tmp_path.iterdir()) == []


def test_manage_without_an_optimizer_refuses_what_needs_one(tmp_path):
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    with tiermem.Runtime(config(tmp_path, 1 * MiB, 1 * MiB)) as rt:
        with pytest.raises(StatesUsageError, match=r"grad_accumulation_steps=, lr= given without an optimizer"):
            rt.manage(model, grad_accumulation_steps=2, lr=1e-3)
        with pytest.raises(StatesUsageError, match="sample= given without an optimizer"):
            rt.manage(model, sample=(torch.randn(2, 8),))
        with pytest.raises(PlanError, match="persistent_chunks=99"):
            rt.manage(model, plan={"persistent_chunks": 99})
        assert all(p.requires_grad for p in model.parameters())  # refused: nothing changed
        assert rt.manage(model) is model
        x = torch.randn(4, 8)
        assert not model(x).requires_grad


def test_frozen_chunks_need_no_gradient_room_and_no_staging():
    """NOTE [ Default placement rule ] rules 1 and 3, and the planner's cost of the same chunks: a
    frozen chunk is charged a parameter buffer only, never room to stage its NVMe home for a step,
    and no step I/O."""
    frozen = [ChunkNeeds(4 * MiB, False, 0) for _ in range(8)]
    adapters = ChunkNeeds(256 << 10, True, 2)
    needs = [*frozen[:4], adapters, *frozen[4:]]
    budgets = Budgets(device=5 * MiB, host=2 * MiB, nvme=1 << 30)
    plan = decide(needs, chunk_size=4 * MiB, min_buffers=1, budgets=budgets, request=PlanRequest())
    # One 4 MiB slot and the adapters' gradient buffer: 4.25 MiB (was 2 x 4 MiB per slot, refused).
    assert plan.persistent_chunks == 0 and plan.buffers == 1
    # The host keeps room to stage the adapters' home (3 x 256 KiB) twice, not a frozen 4 MiB one.
    assert plan.state_home[4] == "host" and plan.state_home.count("nvme") == 8
    packing = Packing(4 * MiB, needs, 1, [])
    assert packing.host_bytes(0, 0) == 2 * adapters.home_bytes + adapters.grad_bytes
    cost = states_cost(_profile_stub(), StatesChoice(packing, 0, 1, 0))
    assert cost.nvme_step_bytes == 2 * adapters.home_bytes  # the adapters' home read and written back
    assert cost.reserve_device_bytes == 4 * MiB + adapters.nbytes


def _profile_stub() -> Any:
    """The fields ``states_cost`` reads of a profile."""

    class Stub:
        device = "cpu"
        cpu = True
        optimizer_s_per_byte = 0.0

    return Stub()


def test_a_checkpoint_of_frozen_chunks_loads_at_the_least_capacities(tmp_path):
    """A frozen chunk gets no host room to stage its home (it never steps), so rt.load writes its
    NVMe home by ranges within the room kept for a trainable home: at the smallest capacities the
    placement names, save after two steps, load into a fresh runtime, two more steps: bitwise the
    uninterrupted run (staging the whole frozen home raised "raise [host] capacity")."""

    def small(seed: int = 0) -> nn.Module:
        model = llama(seed, layers=2, width=64).requires_grad_(False)
        for layer in model.model.layers:
            layer.self_attn.q_proj = LoRALinear(layer.self_attn.q_proj, r=4)
        return model

    def steps(model: nn.Module, optimizer: torch.optim.Optimizer, which: range) -> list[torch.Tensor]:
        losses = []
        for step in which:
            loss = model(input_ids=ids(step), labels=ids(step)).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach())
        return losses

    reference = small()
    want = steps(reference, torch.optim.AdamW(trainable(reference), lr=1e-3), range(4))
    with tiermem.Runtime(config(tmp_path, 4096, 4096)) as rt, pytest.raises(StatesMemoryError) as refused:
        rt.manage(small(), torch.optim.AdamW, plan=DEFAULT_RULE, lr=1e-3)
    device, host = (int(n.replace(",", "")) for n in re.findall(r"\(([\d,]+) bytes\)", str(refused.value))[:2])
    with tiermem.Runtime(config(tmp_path, device, host)) as rt:
        model, optimizer = rt.manage(small(), torch.optim.AdamW, plan=DEFAULT_RULE, lr=1e-3)
        assert "nvme" in rt.plan.state_home
        got = steps(model, optimizer, range(2))
        rt.save(tmp_path / "checkpoint")
    with tiermem.Runtime(config(tmp_path, device, host)) as rt:
        model, optimizer = rt.manage(small(), torch.optim.AdamW, plan=DEFAULT_RULE, lr=1e-3)
        rt.load(tmp_path / "checkpoint")
        got += steps(model, optimizer, range(2, 4))
        within_capacities(rt)
    assert_bitwise(got, want)
    assert_bitwise(list(model.parameters()), list(reference.parameters()))


def gpt_lora(seed: int = 0) -> nn.Module:
    """tiermem's GPT (4 x 512, 12 MiB blocks), frozen, LoRA on each block's attention ``qkv``:
    at seq 256 a block saves more than a device of 40% of the base has room for, so blocks fall
    back to recompute."""
    from tiermem.app.models.gpt import GPT, GPTConfig

    torch.manual_seed(seed)
    model = GPT(GPTConfig(n_layer=4, d_model=512, n_head=4, vocab_size=512, seq_len=256)).requires_grad_(False)
    for block in model.blocks:
        block.attn.qkv = LoRALinear(block.attn.qkv)
    return model


def gpt_loop(model: nn.Module, optimizer: torch.optim.Optimizer, steps: range, seq: int = 256) -> list[torch.Tensor]:
    losses = []
    for step in steps:
        tokens = torch.randint(0, 512, (2, seq + 1), generator=torch.Generator().manual_seed(step))
        _, loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return losses


def test_a_recomputed_block_has_room_for_its_chunks_or_is_refused_up_front(tmp_path):
    """NOTE [ Default placement rule ] rule 4's floor: a block that falls back to recompute runs
    its forward again inside backward beside the chunk backward holds. Chunks of about a block
    (13 MiB) through one buffer failed mid-step (StatesMemoryError: a chunk needs 12 MiB, 13 of
    20 MiB in use); now that hand plan is refused at rt.manage, saying why, and the default rule
    trains bitwise plain with blocks recomputed, the device within its capacity."""
    model = gpt_lora()
    base = frozen_bytes(model)
    refused = r"\d buffers because a block whose activations may be recomputed"
    with (
        tiermem.Runtime(config(tmp_path, int(base * 0.4), int(base * 0.4))) as rt,
        pytest.raises(StatesMemoryError, match=refused),
    ):
        rt.manage(model, torch.optim.AdamW, lr=1e-3, plan={"chunk_size": "13MiB"})
    plain = gpt_lora()
    want = gpt_loop(plain, torch.optim.AdamW(trainable(plain), lr=1e-3), range(2))
    model = gpt_lora()
    with tiermem.Runtime(config(tmp_path, int(base * 0.4), int(base * 0.4))) as rt:
        model, optimizer = rt.manage(model, torch.optim.AdamW, lr=1e-3, plan=DEFAULT_RULE)
        assert rt.plan.buffers >= 2  # the floor: one module's chunk and the one backward holds
        got = gpt_loop(model, optimizer, range(2))
        assert rt.stats().as_dict()["activations"]["fallback_reasons"].get("device_full->recompute", 0) > 0
        within_capacities(rt)
    assert_bitwise(got, want)
    assert_bitwise(trainable(model), trainable(plain))


def test_the_adapters_one_chunk_leads_and_stays_on_the_device_where_it_fits():
    """NOTE [ Chunk layout rules ] rule 1: adapters used in every block pack into one chunk that
    comes first, so the default rule's persistent prefix keeps it on the device beside the base's
    buffers (it came after the first base chunk and streamed through the base's buffer: the 200M
    LoRA read 4,890 MiB of NVMe a step, 3,043 MiB with it on the device)."""
    base = ParamInfo(4 * MiB, (MiB,), torch.float32, False)
    adapter = ParamInfo(64 << 10, (16 << 10,), torch.float32, True)
    params = [base, base, adapter, base, adapter, base, base]  # a base layer, then one with adapters
    layouts = pack(params, range(len(params)), 8 * MiB)
    assert [c.trainable for c in layouts] == [True, False, False, False]
    assert [s.index for s in layouts[0].slots] == [2, 4]
    assert [s.index for s in layouts[1].slots] == [0, 1]  # the base keeps its order of first use
    needs = [ChunkNeeds(c.nbytes, c.trainable, 2) for c in layouts]
    plan = decide(
        needs, chunk_size=8 * MiB, min_buffers=1, budgets=Budgets(20 * MiB, 4 * MiB, 1 << 30), request=PlanRequest()
    )
    assert plan.persistent_chunks == 1 and plan.state_home[0] == "device"
    # every kind of its own when there is more than one trainable chunk: the order of first use
    layer = ParamInfo(4 * MiB, (MiB,), torch.float32, True)
    trained = pack([base, base, layer, adapter], range(4), 4 * MiB)
    assert [c.trainable for c in trained] == [False, False, True, True]


def bench_lora(seed: int = 0) -> nn.Module:
    """bench/lora.py's tiny shape: tiermem's GPT (6 x 256, vocabulary 512, LM head untied as in
    Llama), frozen, LoRA on each block's attention ``qkv`` and ``proj`` (20 MiB of base). At a
    tenth of the base the default placement streams its 1 MiB chunks through one buffer."""
    from tiermem.app.models.gpt import GPT, GPTConfig

    torch.manual_seed(seed)
    model = GPT(GPTConfig(n_layer=6, d_model=256, n_head=4, vocab_size=512, seq_len=64))
    model.lm_head.weight = nn.Parameter(model.wte.weight.detach().clone())
    model.requires_grad_(False)
    for block in model.blocks:
        block.attn.qkv = LoRALinear(block.attn.qkv)
        block.attn.proj = LoRALinear(block.attn.proj)
    return model


def test_the_first_step_plans_a_lora_whose_device_holds_one_streamed_chunk(tmp_path, caplog):
    """NOTE [ Profiling step ] rule 14: the streamed profiling pass recomputes its blocks only
    where the device holds a recomputed block's chunk beside the one backward pins. bench/lora.py's
    tiny run at device 10% (1.9 MiB: one 1 MiB chunk at a time) failed its profiling pass (a chunk
    needs 1.01 MiB, 1.01 MiB of 1.91 MiB in use) and then every later step, on the pins the failed
    pass left. Now the first step plans, and every step trains bitwise plain PyTorch."""
    plain = bench_lora()
    want = gpt_loop(plain, torch.optim.AdamW(trainable(plain), lr=1e-3), range(3), seq=64)
    model = bench_lora()
    base = frozen_bytes(model)
    with caplog.at_level("WARNING", logger="tiermem"), tiermem.Runtime(config(tmp_path, base // 10, base // 10)) as rt:
        model, optimizer = rt.manage(model, torch.optim.AdamW, lr=1e-3)
        got = gpt_loop(model, optimizer, range(3), seq=64)
        assert rt.plan.predicted.step_s is not None  # planned at the first step
        within_capacities(rt)
    assert "planning from the first step failed" not in caplog.text
    assert_bitwise(got, want)
    assert_bitwise(trainable(model), trainable(plain))


def test_a_backward_that_raised_half_way_leaves_no_chunk_pinned(tmp_path):
    """NOTE [ Model-state rules ] rule 3: the chunks a module's backward pins are unpinned when
    that backward ends, also when it raised half-way and the graph that held the pins' records
    is gone (a loop that catches the error, drops the loss and goes on). They were held weakly,
    so a pin outlived them: the next forward found its one buffer taken and failed."""

    class FailOnce(torch.autograd.Function):
        armed = True

        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x.view_as(x)

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            if FailOnce.armed:
                FailOnce.armed = False
                raise RuntimeError("a backward that fails once")
            return grad

    def failing(model: nn.Module) -> nn.Module:
        # a frozen module's backward pins its chunk from its output's node on: that node raises
        proj = model.blocks[2].mlp.proj
        forward = proj.forward
        proj.forward = lambda x: FailOnce.apply(forward(x))
        return model

    def loop(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        FailOnce.armed = True
        tokens = torch.randint(0, 512, (2, 65), generator=torch.Generator().manual_seed(9))
        loss = model(tokens[:, :-1], tokens[:, 1:])[1]  # the logits, and so the graph, dropped with it
        try:
            loss.backward()
        except RuntimeError as exc:  # caught and dropped: nothing keeps the graph alive after
            assert "fails once" in str(exc)
        else:
            pytest.fail("the backward did not raise")
        del loss
        optimizer.zero_grad()
        return gpt_loop(model, optimizer, range(2), seq=64)

    plain = failing(bench_lora())
    want = loop(plain, torch.optim.AdamW(trainable(plain), lr=1e-3))
    model = failing(bench_lora())
    base = frozen_bytes(model)
    with tiermem.Runtime(config(tmp_path, base // 10, base // 10)) as rt:
        model, optimizer = rt.manage(model, torch.optim.AdamW, lr=1e-3, plan=DEFAULT_RULE)
        assert rt.plan.buffers == 1
        got = loop(model, optimizer)
        states = rt.__dict__["_model_states"][0]
        assert all(c.pins == 0 for c in states.chunks)
        within_capacities(rt)
    assert_bitwise(got, want)
    assert_bitwise(trainable(model), trainable(plain))
