"""Child of tests/test_states_access.py: ops on managed parameters against a plain model.

Run as ``python access_child.py WHERE[,WHERE...] DEVICE`` (the suite forks it instead: ``CHILDREN``
and tests/forked_children.py) with each WHERE one of ``released`` (host homes, every chunk
released), ``cached`` (host homes, chunks left resident by a forward), ``nvme`` (NVMe homes).
Every op runs on the managed model and on a plain copy; outputs and every parameter after the op
must be bitwise equal. Exit status 0: all equal; 1: a difference (printed); a signal (a crash)
shows as a negative return code in the parent.
"""

from __future__ import annotations

import copy
import io
import pickle
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import tiermem

HOST = {"released": "64MiB", "cached": "64MiB", "nvme": "2500KiB"}


def make() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)])


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and isinstance(a, nn.Parameter) == isinstance(b, nn.Parameter)
            and torch.equal(a.detach().cpu(), b.detach().cpu())
        )
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return bool(a == b)


def saved(t: torch.Tensor) -> torch.Tensor:
    buffer = io.BytesIO()
    torch.save(t, buffer)
    buffer.seek(0)
    return torch.load(buffer)


def filled(seed: int, like: torch.Tensor) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(like.shape, generator=g).to(like.device)


def sd_edit(m: nn.Module) -> None:
    sd = {k: v.clone() for k, v in m.state_dict().items()}
    sd["3.weight"].mul_(-1)
    m.load_state_dict(sd)


X = torch.randn(4, 256, generator=torch.Generator().manual_seed(1))

Op = Callable[[nn.Module, list[nn.Parameter], dict[str, Any]], Any]
READS: list[tuple[str, Op]] = [
    ("norm", lambda m, P, k: P[14].norm()),
    ("sum", lambda m, P, k: P[14].sum()),
    ("data.sum", lambda m, P, k: P[14].data.sum()),
    ("clone", lambda m, P, k: P[14].clone()),
    ("detach.clone", lambda m, P, k: P[14].detach().clone()),
    ("to float64", lambda m, P, k: P[14].to(torch.float64)),
    ("index row", lambda m, P, k: P[14][3]),
    ("index column", lambda m, P, k: P[14][:, 5]),
    ("transpose", lambda m, P, k: P[14].T.contiguous()),
    ("times two", lambda m, P, k: P[15] * 2),
    ("eq self", lambda m, P, k: P[14].eq(P[14])),
    ("torch.equal", lambda m, P, k: torch.equal(P[14], P[14])),
    ("repr", lambda m, P, k: repr(P[14])),
    ("str data", lambda m, P, k: str(P[15].data)),
    ("torch.save", lambda m, P, k: saved(P[14])),
    ("parameters_to_vector", lambda m, P, k: nn.utils.parameters_to_vector(m.parameters())),
    ("mean", lambda m, P, k: P[14].mean()),
    ("abs max", lambda m, P, k: P[14].abs().max()),
    ("flatten slice", lambda m, P, k: P[14].flatten()[:5]),
    ("view item", lambda m, P, k: P[14].view(-1)[3].item()),
    ("tolist", lambda m, P, k: P[15].tolist()),
    ("numpy", lambda m, P, k: float(P[14].detach().cpu().numpy().sum())),
    ("stack", lambda m, P, k: torch.stack([P[0], P[2]])),
    ("cat", lambda m, P, k: torch.cat([P[1], P[3]])),
    ("F.linear", lambda m, P, k: F.linear(X.to(P[14].device), P[14], P[15])),
    ("deepcopy", lambda m, P, k: copy.deepcopy(P[14])),
    ("pickle", lambda m, P, k: pickle.loads(pickle.dumps(P[14]))),
    ("compare", lambda m, P, k: (P[14] > 0).sum()),
    ("std", lambda m, P, k: P[14].std()),
    ("allclose", lambda m, P, k: torch.allclose(P[0], P[0])),
    ("state_dict", lambda m, P, k: m.state_dict()["7.weight"]),
    ("l2 with grad", lambda m, P, k: sum(p.pow(2).sum() for p in m.parameters())),
    ("keep a view", lambda m, P, k: k.setdefault("view", P[12].data)[0, :4].clone()),
    ("eval forward", lambda m, P, k: m.eval()(X.to(P[0].device))),
]
WRITES: list[tuple[str, Op]] = [
    ("mul_", lambda m, P, k: P[14].mul_(0.5)),
    ("copy_", lambda m, P, k: P[14].copy_(filled(2, P[14]))),
    ("data.copy_", lambda m, P, k: P[12].data.copy_(filled(3, P[12]))),
    ("init.normal_", lambda m, P, k: nn.init.normal_(P[10], generator=torch.Generator(P[10].device).manual_seed(4))),
    ("init.zeros_", lambda m, P, k: nn.init.zeros_(P[11])),
    ("add_", lambda m, P, k: P[8].add_(1)),
    ("row fill_", lambda m, P, k: P[8][0].fill_(3)),
    ("data setitem", lambda m, P, k: P[6].data.__setitem__((0, slice(0, 5)), 1.0)),
    ("data assign", lambda m, P, k: setattr(P[4], "data", torch.ones_like(P[4]))),
    ("out=", lambda m, P, k: torch.add(P[2], 1, out=P[2])),
    ("clamp_", lambda m, P, k: P[0].clamp_(-0.01, 0.01)),
    ("lerp_", lambda m, P, k: P[1].lerp_(torch.ones_like(P[1]), 0.25)),
    ("load_state_dict", lambda m, P, k: sd_edit(m)),
    ("write a kept view", lambda m, P, k: k["view"].add_(2)),
    ("read the kept view", lambda m, P, k: k["view"].sum()),
]


def main(where: str, device: str) -> int:
    plain = make().to(device)
    cfg = {
        "device": {"capacity": "1MiB", "device": device},
        "host": {"capacity": HOST[where]},
        "nvme": {"capacity": "256MiB"},
    }
    failures: list[str] = []
    with tiermem.Runtime(cfg) as rt:
        model, opt = rt.manage(make(), torch.optim.AdamW)
        if where == "cached":
            with torch.no_grad():
                model(X.to(device))
                plain(X.to(device))
        mp, pp = list(model.parameters()), list(plain.parameters())
        mk: dict[str, Any] = {}
        pk: dict[str, Any] = {}
        for kind, ops in (("read", READS), ("write", WRITES)):
            for name, op in ops:
                results = []
                for m, P, k in ((model, mp, mk), (plain, pp, pk)):
                    try:
                        with torch.no_grad() if kind == "write" else torch.enable_grad():
                            results.append(("ok", op(m, P, k)))
                    except Exception as exc:  # noqa: BLE001 (compared below: the same error, or a failure)
                        results.append(("error", f"{type(exc).__name__}: {exc}"))
                (mkind, mout), (pkind, pout) = results
                if mkind != pkind or not same(mout, pout):
                    failures.append(
                        f"{kind} {name}: managed {mkind} {str(mout)[:200]!r} vs plain {pkind} {str(pout)[:200]!r}"
                    )
                if not all(same(a, b) for a, b in zip(mp, pp, strict=True)):
                    failures.append(f"{kind} {name}: parameters differ afterwards")
                    for a, b in zip(mp, pp, strict=True):
                        with torch.no_grad():
                            a.copy_(b)
        model.train(), plain.train()
        plain_opt = torch.optim.AdamW(plain.parameters())
        for step in range(2):  # the writes reach the forward and the optimizer
            opt.zero_grad(), plain_opt.zero_grad()
            losses = []
            for m, o in ((model, opt), (plain, plain_opt)):
                loss = m(X.to(device)).square().mean()
                loss.backward()
                o.step()
                losses.append(loss.detach())
            if not same(*losses):
                failures.append(f"step {step}: loss {losses[0]} vs {losses[1]}")
            if not all(same(a, b) for a, b in zip(mp, pp, strict=True)):
                failures.append(f"step {step}: parameters differ")
    for line in failures:
        print(f"FAIL {where}:", line)
    print(f"{where}: {len(READS)} reads, {len(WRITES)} writes, {len(failures)} failures", flush=True)
    return 1 if failures else 0


def every_where(wheres: str, device: str = "cpu") -> None:
    """Each WHERE (comma-separated) in the same process (one interpreter start for all: suite
    time); exit status 1 when any differs."""
    sys.exit(max(main(where, device) for where in wheres.split(",")))


#: the children by name, for tests/forked_children.py
CHILDREN = {"every-where": every_where}

if __name__ == "__main__":
    every_where(*sys.argv[1:])
