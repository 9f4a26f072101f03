"""What a checkpoint holds for the models a runtime manages, in DCP's own shapes: the nested
state dict ``{"model": <model.state_dict() names>, "optimizer": <get_optimizer_state_dict's
form: FQN-keyed state and param groups>}`` (later models under ``model_1``/``optimizer_1``, ...),
plus ``"tiermem": {"format", "version"}`` (a tiermem save's mark), the sources a save reads
each tensor from, and the targets a load writes each one into; plus the RNG states. Bytes
are reached only through each model's :class:`~tiermem.states.stateio.StateIO` (NOTE
[ Checkpoint rules ] rule 1), or, for an FSDP2-sharded model, its
:class:`~tiermem.states.sharded.stateio.ShardedStateIO`: its parameters are FSDP2's DTensors, saved
and loaded in place, and its optimizer states stand in as DTensors placed like their
parameters, each rank streaming its local shards (NOTE [ Checkpoints on ranks ]).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from tiermem.checkpoint.dcp_planners import ObjPath, Source, Target, stand_in
from tiermem.checkpoint.files import FORMAT, FORMAT_VERSION, MARKER
from tiermem.errors import CheckpointError
from tiermem.states import ModelStates
from tiermem.states.sharded.stateio import ShardedStateIO
from tiermem.states.sharded.step import as_like
from tiermem.states.stateio import StateIO, StateTensor


def keys_of(m: int) -> tuple[str, str]:
    """The top-level keys of model ``m`` (the first one's are DCP's usual ``model``/``optimizer``)."""
    return ("model", "optimizer") if m == 0 else (f"model_{m}", f"optimizer_{m}")


def _fqns(states: ModelStates) -> tuple[list[str], dict[str, int]]:
    """Each parameter's FQN as DCP's get_optimizer_state_dict names it (its first name), and
    every name (tied ones included) -> parameter index."""
    index = {id(p): i for i, p in enumerate(states.params)}
    first: dict[int, str] = {}
    every: dict[str, int] = {}
    for name, p in states.model.named_parameters(remove_duplicate=False):
        i = index[id(p)]
        first.setdefault(i, name)
        every[name] = i
    return [first[i] for i in range(len(states.params))], every


def _param_groups(states: ModelStates, fqns: list[str]) -> list[dict[str, Any]]:
    index = {id(p): i for i, p in enumerate(states.params)}
    return [
        {**{k: v for k, v in group.items() if k != "params"}, "params": [fqns[index[id(p)]] for p in group["params"]]}
        for group in states.optimizer.param_groups
    ]


def save_tree(all_states: Sequence[ModelStates]) -> tuple[dict[str, Any], dict[ObjPath, Source]]:
    """The state dict to plan (stand-ins for managed tensors) and where each managed tensor's
    bytes come from, read only when DCP's writer asks (rule 2)."""
    tree: dict[str, Any] = {}
    sources: dict[ObjPath, Source] = {}
    for m, states in enumerate(all_states):
        stateio = states.checkpoint_io("save")
        model_key, optim_key = keys_of(m)
        fqns, _ = _fqns(states)
        index = {id(p): i for i, p in enumerate(states.params)}
        values = {t.index: t for t in stateio.checkpoint_tensors() if t.key is None}

        def source(t: StateTensor, m: int = m, stateio: StateIO | ShardedStateIO = stateio) -> Source:
            return Source((m, t.chunk), lambda: stateio.read_tensor(t))

        model: dict[str, Any] = {}
        for name, value in states.model.state_dict(keep_vars=True).items():
            i = index.get(id(value)) if isinstance(value, torch.Tensor) else None
            if i is None or i not in values:  # buffers, extra state, FSDP2's shards: as they are
                model[name] = value.detach() if isinstance(value, torch.Tensor) else value
                continue
            model[name] = stand_in(values[i].shape, values[i].dtype)
            sources[(model_key, name)] = source(values[i])
        state: dict[str, dict[str, Any]] = {}
        for i, fqn in enumerate(fqns):
            entries = stateio.state_entries(i)
            if not entries:
                continue
            state[fqn] = {}
            for key, value in entries.items():
                if isinstance(value, StateTensor):  # a DTensor like its parameter's for a sharded model
                    state[fqn][key] = as_like(states.params[i], stand_in(value.shape, value.dtype))
                    sources[(optim_key, "state", fqn, key)] = source(value)
                else:
                    state[fqn][key] = value
        tree[model_key] = model
        tree[optim_key] = {"state": state, "param_groups": _param_groups(states, fqns)}
    # NOTE [ Checkpoint commit rules ] rule 4: marks the checkpoint tiermem's, manifest or not
    tree[MARKER] = {"format": FORMAT, "version": FORMAT_VERSION}
    return tree, sources


class LoadTree:
    """What a load asks of DCP for ``all_states`` given the checkpoint's ``metadata``, and what
    it does with the values that are not chunk bytes (scalars, param groups)."""

    def __init__(self, all_states: Sequence[ModelStates], metadata: Metadata, where: str) -> None:
        self.all_states = all_states
        self.where = where
        self.tree: dict[str, Any] = {}
        self.targets: dict[ObjPath, Target] = {}
        self.stateios = [states.checkpoint_io("load") for states in all_states]
        #: per model: parameter index -> its optimizer state in key order (tensors filled in on commit)
        self.states: list[dict[int, dict[str, Any]]] = [{} for _ in all_states]
        paths = dict(metadata.planner_data or {})
        if not paths:
            raise self._error("has no planner data (not saved with DCP's default planner)")
        known = set(keys_of(m)[k] for m in range(len(all_states)) for k in (0, 1))
        unknown = sorted({str(p[0]) for p in paths.values()} - known - {MARKER})
        if unknown:
            raise self._error(f"holds {unknown} beyond the {len(all_states)} model(s) this runtime manages")
        for m, states in enumerate(all_states):
            self._model(m, states, paths, metadata)

    def _error(self, what: str) -> CheckpointError:
        return CheckpointError(
            f"tiermem checkpoint: {self.where} {what}; load it after rt.manage() of the same models, in the same "
            "order.",
            self.where,
        )

    def _check_tensor(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, into: Any) -> None:
        """A saved tensor is written into its chunk (or in place) as it is: no broadcast, no cast.
        ``into``: a :class:`StateTensor` or a tensor (a DTensor's global shape)."""
        if shape != tuple(into.shape) or dtype != into.dtype:
            raise self._error(
                f"holds {name} with shape {list(shape)} and dtype {dtype}, but this model's is shape "
                f"{list(into.shape)} and dtype {into.dtype}; nothing was loaded"
            )

    def _check_state_key(self, states: ModelStates, i: int, fqn: str, key: str, shape: tuple[int, ...]) -> None:
        """A saved state of the parameter's own shape is one this optimizer keeps for it (as
        learned on samples, NOTE [ Exact optimizer step ] rule 3). Another optimizer's (``exp_avg`` where
        SGD keeps ``momentum_buffer``), or one other settings keep (``max_exp_avg_sq`` of
        ``amsgrad=True``), would load as a value nothing reads, and the param groups after it
        would bring that optimizer's hyper-parameters into this one's step."""
        facts = getattr(states, "facts", None)  # an FSDP2 model's sharded states keep no such record
        if facts is None or i not in facts.optimized or not shape or shape != tuple(facts.params[i].shape):
            return  # 0-d states (``step``) and other shapes are not told apart from this optimizer's
        if key not in facts.state_keys[i]:
            kept = ", ".join(facts.state_keys[i]) or "no state"
            raise self._error(
                f"holds optimizer state {key!r} of {fqn}, which this optimizer "
                f"({facts.optimizer_class.__name__}, as configured) does not keep (it keeps {kept}): it was saved "
                "from another optimizer, or with other settings; nothing was loaded"
            )

    def _section(
        self, m: int, states: ModelStates, i: int, key: str, values: dict[int, StateTensor]
    ) -> StateTensor | None:
        """Where optimizer state ``key`` of parameter ``i`` goes in its chunk (None: kept as a
        record's value, as ``step`` is); a sharded model's is this rank's local shard."""
        stateio = self.stateios[m]
        if isinstance(stateio, ShardedStateIO):
            return stateio.section(i, key) if stateio.has_section(i, key) else None
        if not states.facts.is_section(i, key):  # a small state is kept beside the chunks, not in them
            return None
        entry = stateio.state_entries(i).get(key)
        if isinstance(entry, StateTensor) or states.chunk_of(states.params[i]).sections:
            return StateTensor(i, key, values[i].shape, values[i].dtype, values[i].chunk)
        return None

    def _model(self, m: int, states: ModelStates, paths: dict[str, ObjPath], metadata: Metadata) -> None:
        model_key, optim_key = keys_of(m)
        stateio = self.stateios[m]
        _, by_name = _fqns(states)
        index = {id(p): i for i, p in enumerate(states.params)}
        values = {t.index: t for t in stateio.checkpoint_tensors() if t.key is None}
        flat_of = {path: flat for flat, path in paths.items()}
        model: dict[str, Any] = {}
        lacking = []
        for name, value in states.model.state_dict(keep_vars=True).items():
            i = index.get(id(value)) if isinstance(value, torch.Tensor) else None
            md = metadata.state_dict_metadata.get(flat_of.get((model_key, name), ""))
            if md is None and isinstance(value, torch.Tensor):
                lacking.append(f"{model_key}.{name}")
            if i is None or i not in values:  # buffers, extra state, FSDP2's shards: loaded in place
                if isinstance(value, torch.Tensor) and isinstance(md, TensorStorageMetadata):
                    self._check_tensor(f"{model_key}.{name}", tuple(md.size), md.properties.dtype, value)
                model[name] = value.detach() if isinstance(value, torch.Tensor) else value
                continue
            t = values[i]
            if isinstance(md, TensorStorageMetadata):
                self._check_tensor(f"{model_key}.{name}", tuple(md.size), md.properties.dtype, t)
            model[name] = stand_in(t.shape, t.dtype)
            self.targets[(model_key, name)] = Target(t.shape, t.dtype, (m, t.chunk), t)
        extra = sorted(f for f, p in paths.items() if p[0] == model_key and (len(p) != 2 or p[1] not in model))
        if extra:
            raise self._error(f"holds model entries this model does not have: {extra[:5]}")
        if lacking:  # before the optimizer's groups, which would differ too and say less
            raise self._error(
                f"lacks {len(lacking)} of this model's entries ({lacking[:5]}): it was saved from another "
                "architecture; nothing was loaded"
            )
        state: dict[str, dict[str, Any]] = {}
        groups: dict[int, dict[str, Any]] = {}
        # A model managed without an optimizer (a teacher, an evaluation: nothing it trains) loads
        # the model's entries of a training checkpoint and leaves the optimizer's in it.
        frozen = hasattr(states, "facts") and not states.facts.optimized  # FSDP2's are never frozen
        for flat, path in paths.items():
            if path[0] != optim_key or frozen:
                continue
            if len(path) == 4 and path[1] == "param_groups":
                groups.setdefault(int(path[2]), {})[path[3]] = None
                continue
            if len(path) != 4 or path[1] != "state" or path[2] not in by_name:
                raise self._error(f"holds optimizer entry {flat!r}, which matches no parameter of this model")
            fqn, key, i = path[2], path[3], by_name[path[2]]
            record = self.states[m].setdefault(i, {})
            record[key] = None
            md = metadata.state_dict_metadata[flat]
            if isinstance(md, BytesStorageMetadata):
                state.setdefault(fqn, {})[key] = None
                continue
            assert isinstance(md, TensorStorageMetadata)
            shape, dtype = tuple(md.size), md.properties.dtype
            self._check_state_key(states, i, fqn, key, shape)
            section = self._section(m, states, i, key, values)
            if section is not None:
                p = states.params[i]
                self._check_tensor(flat, shape, dtype, p if hasattr(p, "placements") else section)
                local = stand_in(section.shape, dtype)
                state.setdefault(fqn, {})[key] = as_like(p, local)  # a DTensor for a sharded model
                target = Target(section.shape, dtype, (m, section.chunk), section)
                self.targets[(optim_key, "state", fqn, key)] = target
            else:
                state.setdefault(fqn, {})[key] = stand_in(shape, dtype)
                self.targets[(optim_key, "state", fqn, key)] = Target(
                    shape, dtype, commit=lambda v, r=record, k=key: r.__setitem__(k, v)
                )
        self.tree[model_key] = model
        if not frozen:
            self.tree[optim_key] = {"state": state, "param_groups": [groups[g] for g in sorted(groups)]}

    def groups_tree(self) -> dict[str, Any]:
        """Only the optimizers' param groups: what :meth:`check_groups` needs, read first."""
        return {
            keys_of(m)[1]: {"param_groups": [dict(g) for g in self.tree[keys_of(m)[1]]["param_groups"]]}
            for m in range(len(self.all_states))
            if keys_of(m)[1] in self.tree  # a model without an optimizer asks for none
        }

    def _saved_groups(self, m: int, loaded: dict[ObjPath, Any]) -> list[dict[str, Any]]:
        optim_key = keys_of(m)[1]
        return [
            {k: loaded[(optim_key, "param_groups", g, k)] for k in group}
            for g, group in enumerate(self.tree[optim_key]["param_groups"])
        ]

    def check_groups(self, loaded: dict[ObjPath, Any]) -> None:
        """Before anything is written: the saved param groups hold this optimizer's parameters."""
        for m, states in enumerate(self.all_states):
            if keys_of(m)[1] not in self.tree:
                continue  # managed without an optimizer: nothing of the checkpoint's optimizer is loaded
            saved = self._saved_groups(m, loaded)
            current = _param_groups(states, _fqns(states)[0])
            if [s.get("params") for s in saved] != [c["params"] for c in current]:
                raise self._error(
                    f"has other optimizer parameter groups ({[len(s.get('params') or ()) for s in saved]} "
                    f"parameters) than this optimizer ({[len(c['params']) for c in current]}); nothing was loaded"
                )

    def finish(self, loaded: dict[ObjPath, Any]) -> None:
        """After DCP's reader: optimizer records (scalars, key order) and param groups' saved
        hyper-parameters (an LR schedule's current lr), checked by :meth:`check_groups`."""
        self.check_groups(loaded)
        for m, states in enumerate(self.all_states):
            _, optim_key = keys_of(m)
            if optim_key not in self.tree:
                continue
            _, by_name = _fqns(states)
            for path, value in loaded.items():
                if path[0] == optim_key and path[1] == "state":
                    self.states[m][by_name[path[2]]][path[3]] = value
            for i in range(len(states.params)):
                self.stateios[m].set_scalars(i, self.states[m].get(i))
            for group, values in zip(states.optimizer.param_groups, self._saved_groups(m, loaded), strict=True):
                group.update({k: v for k, v in values.items() if k != "params"})


def rng_state() -> dict[str, Any]:
    """Every RNG a training loop draws from (torch, CUDA where initialised, NumPy, Python)."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return {"torch": torch.get_rng_state(), "cuda": cuda, "numpy": np.random.get_state(), "python": random.getstate()}


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
